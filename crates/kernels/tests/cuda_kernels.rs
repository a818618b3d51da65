//! Every CUDA op against the CPU device (f32) on random inputs (the shared checks are in
//! `device_kernels`), and the CUDA-only fused GEMVs, bandwidth and GEMM input copy. Needs a GPU,
//! so the tests are ignored by default; `scripts/gpu-check.sh` runs them on the device machine
//! with `--ignored`.
#![cfg(feature = "cuda")]

mod device_kernels;

use device_kernels::*;
use quiver_kernels::cpu::CpuDevice;
use quiver_kernels::cuda::CudaDevice;
use quiver_kernels::{DType, Device, Weight};

fn gpu() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}"))
}

/// bf16 GEMMs round the input rows to bf16 too; f32 GEMMs may reassociate; the cache holds bf16
/// keys and values.
const CUDA_TOL: Tolerances = Tolerances { matmul_f32: 1e-5, matmul_bf16: 1e-2, attention: 1e-2 };

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn matmul_matches_cpu() {
    device_kernels::matmul_matches_cpu(&gpu(), &CUDA_TOL);
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn embedding_and_gather_match_cpu() {
    device_kernels::embedding_and_gather_match_cpu(&gpu());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn drawn_ids_resolve_to_the_last_draws() {
    device_kernels::drawn_ids_resolve_to_the_last_draws(&gpu());
}

/// Penalties, bias, bans and masks on the GPU, bit for bit the engine's old host path (the
/// roundings are explicit in logit_edits.cu), and the draws that follow them.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn logit_edits_match_the_host_path() {
    device_kernels::logit_edits::logit_edits_match_the_host_path(&gpu());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn norms_and_elementwise_match_cpu() {
    device_kernels::norms_and_elementwise_match_cpu(&gpu());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn rope_matches_cpu() {
    device_kernels::rope_matches_cpu(&gpu());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn paged_attention_matches_cpu() {
    device_kernels::paged_attention_matches_cpu(&gpu(), &CUDA_TOL);
}

/// `(q heads, kv heads, head dim, block size)` of the attention-by-KV-head checks on the mixed
/// steps of `paged_attention_cases_match_cpu`.
const KV_HEAD_CASES: &[(usize, usize, usize, usize)] = &[(16, 2, 128, 16), (8, 2, 256, 16), (12, 2, 64, 16), (8, 4, 128, 8), (32, 8, 128, 16)];
/// ... and on the long mixed-context decode steps: every head dim, groups of 1 to 8 query heads
/// per KV head (the 4- and 8-wide builds, odd groups too), block sizes 4, 8 and 16.
const KV_HEAD_DECODE_CASES: &[(usize, usize, usize, usize)] =
    &[(2, 2, 64, 4), (4, 2, 128, 8), (8, 2, 64, 16), (32, 8, 128, 16), (8, 1, 128, 4), (6, 2, 256, 16), (16, 2, 256, 8), (12, 2, 64, 8), (4, 4, 256, 4), (5, 1, 128, 16)];

/// Both checks of the attention by KV head, on the streamed kernel or (`v1`) the first; taken
/// from one row here, so the decode steps and the prefill rows of head dim 256 run on it.
fn attention_by_kv_head(v1: bool) {
    let g = gpu().with_attn_gqa_min_rows(1).with_attn_decode(v1);
    device_kernels::paged_attention_cases_match_cpu(&g, &CUDA_TOL, KV_HEAD_CASES);
    device_kernels::decode_attention_cases_match_cpu(&g, &CUDA_TOL, KV_HEAD_DECODE_CASES);
}

/// The attention by KV head (`decode_attention.cu`, the streamed kernel, the default) for every
/// head dim it is built for and groups of 1 to 8 query heads per KV head.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn attention_by_kv_head_matches_cpu() {
    attention_by_kv_head(false);
}

/// The same checks on the first attention-by-KV-head kernel (`QUIVER_CUDA_ATTN_DECODE=v1`).
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn attention_by_kv_head_v1_matches_cpu() {
    attention_by_kv_head(true);
}

/// The batch-1 GEMVs with RoPE or SiLU·mul fused into their epilogue against the CPU running
/// the two ops apart, and against the GPU running them apart (same dot products, so nearly
/// bit-equal). Head counts and dims that leave partly filled blocks; k = 67 takes the unfused path.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn fused_gemv_epilogues_match_cpu() {
    let (g, c) = (gpu(), CpuDevice::new());
    let mut r = Rng::fresh("fused gemv");
    for &(nh, nkv, hd, k) in &[(1, 1, 2, 8), (9, 3, 64, 576), (32, 8, 128, 4096), (6, 2, 80, 1000), (3, 1, 20, 67)] {
        let (tc, tg) = (rope_table(&c, hd, 4096), rope_table(&g, hd, 4096));
        let n = (nh + 2 * nkv) * hd;
        let (x, w, b) = (r.vec(k, 1.0), r.vec(n * k, 0.5), r.vec(n, 1.0));
        let pos = [r.below(4096) as u32];
        let (wc, wg) = (c.load_weight(Weight::from_f32(n, k, w.clone(), DType::Bf16)), g.load_weight(Weight::from_f32(n, k, w, DType::Bf16)));
        let (xc, xg) = (c.tensor_from(&x), g.tensor_from(&x));
        for bias in [None, Some(&b)] {
            let (bc, bg) = (bias.map(|b| c.tensor_from(b)), bias.map(|b| g.tensor_from(b)));
            let (mut yc, mut yg, mut yu) = (poisoned(&c, n), poisoned(&g, n), poisoned(&g, n));
            c.matmul_rope_qk(&xc, 1, &wc, bc.as_ref(), &mut yc, &pos, nh, nkv, &tc);
            g.matmul_rope_qk(&xg, 1, &wg, bg.as_ref(), &mut yg, &pos, nh, nkv, &tg);
            g.matmul(&xg, 1, &wg, bg.as_ref(), &mut yu);
            g.rope_qk(&mut yu, 1, &pos, nh, nkv, &tg);
            let what = format!("gemv + rope heads={nh}/{nkv} hd={hd} k={k} bias={}", bias.is_some());
            let fused = host(&g, &yg, n);
            check(&what, &fused, &yc.as_cpu()[..n], 1e-4);
            check(&format!("{what} vs unfused"), &fused, &host(&g, &yu, n), 1e-6);
        }
        let inter = n / 2;
        let (mut guc, mut gug, mut oc, mut og, mut ou) = (poisoned(&c, n), poisoned(&g, n), poisoned(&c, inter), poisoned(&g, inter), poisoned(&g, inter));
        c.matmul_silu_mul(&xc, 1, &wc, &mut guc, &mut oc);
        g.matmul_silu_mul(&xg, 1, &wg, &mut gug, &mut og);
        g.matmul(&xg, 1, &wg, None, &mut gug);
        g.silu_mul(&gug, 1, inter, &mut ou);
        let what = format!("gemv + silu_mul {n}x{k}");
        let fused = host(&g, &og, inter);
        check(&what, &fused, &oc.as_cpu()[..inter], 1e-4);
        check(&format!("{what} vs unfused"), &fused, &host(&g, &ou, inter), 1e-6);
    }
}

/// A weight with room beside its rows (`load_weight_strided`: rows `ld > cols` apart, what LoRA's
/// B beside the rows will need) gives what the packed weight gives through every op that reads
/// weights: the GEMV of one row (any k and k % 8 == 0, each fused epilogue), cuBLAS over several
/// rows (bf16, the hi + lo split of small weights, f32), and the embedding gather. The same
/// kernels run on both, so the GEMVs and the gather must agree exactly; cuBLAS may pick another
/// algorithm for another lda, so its results get f32 rounding room.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn weights_with_room_beside_their_rows_read_the_same() {
    let g = gpu();
    let mut r = Rng::fresh("weight room");
    let exact = |what: &str, a: &[f32], b: &[f32]| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(x.to_bits() == y.to_bits(), "{what}: element {i} is {x} with room beside the rows, {y} without");
        }
    };
    for &(m, n, k) in &[(1, 577, 576), (1, 130, 67), (3, 130, 67), (1, 4099, 4096), (5, 4099, 2048), (64, 256, 512), (300, 1000, 4096), (2, 64, 1000)] {
        for dtype in [DType::Bf16, DType::F32] {
            for room in [8, 72] {
                let (x, w, b) = (r.vec(m * k, 1.0), r.vec(n * k, 0.5), r.vec(n, 1.0));
                let packed = g.load_weight(Weight::from_f32(n, k, w.clone(), dtype));
                let roomy = g.load_weight_strided(Weight::from_f32(n, k, w, dtype), k + room);
                let (xg, bg) = (g.tensor_from(&x), g.tensor_from(&b));
                let (mut y0, mut y1) = (poisoned(&g, m * n), poisoned(&g, m * n));
                g.matmul(&xg, m, &packed, Some(&bg), &mut y0);
                g.matmul(&xg, m, &roomy, Some(&bg), &mut y1);
                let what = format!("matmul {m}x{n}x{k} {dtype:?} room {room}");
                let (a, b) = (host(&g, &y1, m * n), host(&g, &y0, m * n));
                if m == 1 && dtype == DType::Bf16 {
                    exact(&what, &a, &b);
                } else {
                    check(&what, &a, &b, 1e-6);
                }
            }
        }
    }
    // The fused single-row epilogues and the embedding gather, bf16.
    let (nh, nkv, hd, k) = (9, 3, 64, 576);
    let n = (nh + 2 * nkv) * hd;
    let t = rope_table(&g, hd, 4096);
    let (x, w) = (r.vec(k, 1.0), r.vec(n * k, 0.5));
    let packed = g.load_weight(Weight::from_f32(n, k, w.clone(), DType::Bf16));
    let roomy = g.load_weight_strided(Weight::from_f32(n, k, w, DType::Bf16), k + 24);
    let xg = g.tensor_from(&x);
    let pos = [r.below(4096) as u32];
    let (mut y0, mut y1) = (poisoned(&g, n), poisoned(&g, n));
    g.matmul_rope_qk(&xg, 1, &packed, None, &mut y0, &pos, nh, nkv, &t);
    g.matmul_rope_qk(&xg, 1, &roomy, None, &mut y1, &pos, nh, nkv, &t);
    exact("gemv + rope", &host(&g, &y1, n), &host(&g, &y0, n));
    let (mut gu0, mut gu1, mut o0, mut o1) = (poisoned(&g, n), poisoned(&g, n), poisoned(&g, n / 2), poisoned(&g, n / 2));
    g.matmul_silu_mul(&xg, 1, &packed, &mut gu0, &mut o0);
    g.matmul_silu_mul(&xg, 1, &roomy, &mut gu1, &mut o1);
    exact("gemv + silu_mul", &host(&g, &o1, n / 2), &host(&g, &o0, n / 2));
    let ids: Vec<u32> = (0..7).map(|_| r.below(n) as u32).collect();
    let (mut e0, mut e1) = (poisoned(&g, ids.len() * k), poisoned(&g, ids.len() * k));
    g.embedding(&packed, &ids, &mut e0);
    g.embedding(&roomy, &ids, &mut e1);
    exact("embedding", &host(&g, &e1, ids.len() * k), &host(&g, &e0, ids.len() * k));
}

/// Bandwidth of the single-row GEMV on the Llama-3.1-8B shapes against a device-to-device copy, in
/// the same process (prints a table; asserts only that the numbers are finite). Three copies of
/// each weight are rotated so a matrix that fits in L2 is not measured from L2.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn gemv_bandwidth_vs_copy() {
    let g = gpu();
    let copy_len = 256 << 20; // 1 GiB of floats each way
    let (src, mut dst) = (g.tensor_from(&vec![1.5f32; copy_len]), g.alloc(copy_len));
    let copy_ms = g.time_ms(20, &mut || g.copy(&src, &mut dst, copy_len)).unwrap();
    let copy_tb_s = 2.0 * (copy_len * 4) as f64 / (copy_ms * 1e-3) / 1e12;
    eprintln!("gemv bandwidth: copy {copy_tb_s:.2} TB/s (read + write)");
    let (h, kv, ffn, vocab) = (4096usize, 1024usize, 14336usize, 128256usize);
    let shapes = [("qkv", h + 2 * kv, h, 32), ("o", h, h, 32), ("gate_up", 2 * ffn, h, 32), ("down", h, ffn, 32), ("lm_head", vocab, h, 1)];
    let (mut step_ms, mut step_bytes) = (0.0, 0.0);
    for (name, n, k, per_step) in shapes {
        let w: Vec<f32> = (0..n * k).map(|i| ((i % 251) as f32 - 125.0) * 1e-3).collect();
        let copies = if n * k * 2 > (512 << 20) { 1 } else { 3 };
        let ws: Vec<Weight> = (0..copies).map(|_| g.load_weight(Weight::from_f32(n, k, w.clone(), DType::Bf16))).collect();
        drop(w);
        let x = g.tensor_from(&(0..k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect::<Vec<_>>());
        let mut y = g.alloc(n);
        let mut i = 0;
        let ms = g
            .time_ms(30, &mut || {
                g.matmul(&x, 1, &ws[i % copies], None, &mut y);
                i += 1;
            })
            .unwrap();
        let bytes = (n * k * 2) as f64;
        let tb_s = bytes / (ms * 1e-3) / 1e12;
        assert!(tb_s.is_finite() && tb_s > 0.0);
        eprintln!("gemv bandwidth: {name:<8} {n:>6}x{k:<6} {:>8.1} us {tb_s:>6.2} TB/s = {:.2} of copy", ms * 1e3, tb_s / copy_tb_s);
        step_ms += ms * per_step as f64;
        step_bytes += bytes * per_step as f64;
    }
    eprintln!(
        "gemv bandwidth: one 8B decode step's GEMVs back to back {step_ms:.2} ms for {:.2} GB = {:.2} TB/s; weight-streaming bound {:.2} ms",
        step_bytes / 1e9,
        step_bytes / (step_ms * 1e-3) / 1e12,
        step_bytes / (copy_tb_s * 1e12) * 1e3
    );
}

/// Norms, SiLU·mul and prefill attention hand a cuBLAS GEMM the bf16 copy of their output, made in
/// the same pass. It must be used only when nothing has touched that output since: here the
/// output is changed in between (add_inplace, an upload), and the GEMM must see the change.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn gemm_input_copy_is_not_reused_after_a_change() {
    gemm_input_copy_checks(&gpu());
}

/// The shared checks again on a device that keeps room beside every weight's rows and after each
/// row of the bf16 GEMM inputs the ops write (`with_rooms`, what LoRA's B and shrink will use):
/// every op reads and writes both through their row strides. The checks whose GEMMs read an op's
/// bf16 copy: a norm's (`gemm_input_copy_checks`), the attention's (the decode cases), SiLU·mul's
/// (`norms_and_elementwise`' down projection).
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn ops_read_weights_and_gemm_inputs_through_their_row_strides() {
    let g = gpu().with_rooms(24, 40).with_attn_gqa_min_rows(1);
    device_kernels::matmul_matches_cpu(&g, &CUDA_TOL);
    device_kernels::embedding_and_gather_match_cpu(&g);
    device_kernels::norms_and_elementwise_match_cpu(&g);
    device_kernels::paged_attention_matches_cpu(&g, &CUDA_TOL);
    device_kernels::paged_attention_cases_match_cpu(&g, &CUDA_TOL, KV_HEAD_CASES);
    device_kernels::decode_attention_cases_match_cpu(&g, &CUDA_TOL, KV_HEAD_DECODE_CASES);
    gemm_input_copy_checks(&g);
}

fn gemm_input_copy_checks(g: &CudaDevice) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("gemm input copy");
    // A weight over the split mode's limit (16 MiB of bf16), so the GEMM reads the bf16 copy.
    let (rows, dim, n) = (5, 2048, 4100);
    let (x, d, nw) = (r.vec(rows * dim, 2.0), r.vec(rows * dim, 3.0), r.vec(dim, 1.0));
    let w = r.vec(n * dim, 0.5);
    let (wc, wg) = (c.load_weight(Weight::from_f32(n, dim, w.clone(), DType::Bf16)), g.load_weight(Weight::from_f32(n, dim, w, DType::Bf16)));
    let (nc, ng) = (c.tensor_from(&nw), g.tensor_from(&nw));
    let (xc, xg) = (c.tensor_from(&x), g.tensor_from(&x));
    let (dc, dg) = (c.tensor_from(&d), g.tensor_from(&d));
    for change in ["none", "add_inplace", "upload"] {
        let (mut oc, mut og) = (poisoned(&c, rows * dim), poisoned(g, rows * dim));
        c.rms_norm(&xc, &nc, 1e-5, rows, dim, &mut oc);
        g.rms_norm(&xg, &ng, 1e-5, rows, dim, &mut og);
        match change {
            "add_inplace" => {
                c.add_inplace(&mut oc, &dc, rows * dim);
                g.add_inplace(&mut og, &dg, rows * dim);
            }
            "upload" => {
                c.upload(&d, &mut oc);
                g.upload(&d, &mut og);
            }
            _ => {}
        }
        let (mut yc, mut yg) = (poisoned(&c, rows * n), poisoned(g, rows * n));
        c.matmul(&oc, rows, &wc, None, &mut yc);
        g.matmul(&og, rows, &wg, None, &mut yg);
        check(&format!("rms_norm, {change}, matmul"), &host(g, &yg, rows * n), &yc.as_cpu()[..rows * n], 1e-2);
    }
    // The other writers of a GEMM's bf16 input: add + norm, SiLU·mul (gate_up → down).
    let (mut rc, mut rg, mut oc, mut og) = (c.tensor_from(&x), g.tensor_from(&x), poisoned(&c, rows * dim), poisoned(g, rows * dim));
    c.add_rms_norm(&mut rc, &dc, &nc, 1e-5, rows, dim, &mut oc);
    g.add_rms_norm(&mut rg, &dg, &ng, 1e-5, rows, dim, &mut og);
    let (mut yc, mut yg) = (poisoned(&c, rows * n), poisoned(g, rows * n));
    c.matmul(&oc, rows, &wc, None, &mut yc);
    g.matmul(&og, rows, &wg, None, &mut yg);
    check("add_rms_norm, matmul", &host(g, &yg, rows * n), &yc.as_cpu()[..rows * n], 1e-2);
    let gu = r.vec(rows * 2 * dim, 2.0);
    let (guc, gug) = (c.tensor_from(&gu), g.tensor_from(&gu));
    let (mut sc, mut sg) = (poisoned(&c, rows * dim), poisoned(g, rows * dim));
    c.silu_mul(&guc, rows, dim, &mut sc);
    g.silu_mul(&gug, rows, dim, &mut sg);
    let (mut yc, mut yg) = (poisoned(&c, rows * n), poisoned(g, rows * n));
    c.matmul(&sc, rows, &wc, None, &mut yc);
    g.matmul(&sg, rows, &wg, None, &mut yg);
    check("silu_mul, matmul", &host(g, &yg, rows * n), &yc.as_cpu()[..rows * n], 1e-2);
}

/// q/k RMSNorm per head (Qwen3) and over the whole projections (OLMoE), v untouched.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn qk_norm_matches_cpu() {
    device_kernels::moe::qk_norm_matches_cpu(&gpu());
}

/// A whole MoE block on both devices (bf16 experts within CUDA's bf16 GEMM tolerance) and the
/// shared expert's sigmoid-gated add.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn moe_block_matches_cpu() {
    device_kernels::moe::moe_block_matches_cpu(&gpu(), 1e-2, false);
}

/// The peer collectives of a CUDA tensor-parallel group (`cuda/collective.rs`), ranks sharing
/// the GPUs there are (`QUIVER_CUDA_TP_SHARE_GPUS=1`, which the GPU scripts set): each rank adds
/// one to its buffer on the device and all-reduces it, round after round, so a collective that
/// read a partial before its kernel wrote it, or a kernel that read the sum before every rank's
/// part was in, shows; the sums must be the rank-ordered f32 sums bit for bit, the gathered
/// columns exact. Lengths from one element to past a block's chunk.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-tp.sh"]
fn collectives_sum_in_rank_order_on_every_rank() {
    for n in [2usize, 4] {
        let group = gpu().tensor_parallel_group(n).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
        for len in [1usize, 3, 256, 1856, 65_537] {
            let rounds = 6;
            let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
                let hs: Vec<_> = group
                    .iter()
                    .map(|(d, c)| {
                        sc.spawn(move || {
                            let r = c.rank();
                            let mut t = d.tensor_from(&(0..len).map(|i| ((i % 97) * 10 + r) as f32 * 0.1).collect::<Vec<_>>());
                            let one = d.tensor_from(&vec![1.0; len]);
                            let mut seen = Vec::new();
                            for _ in 0..rounds {
                                d.add_inplace(&mut t, &one, len);
                                c.all_reduce_sum(&mut t, len);
                                let mut h = vec![0.0; len];
                                d.to_host(&t, len, &mut h);
                                seen.push(h);
                            }
                            let (rows, cols) = (3, len.min(50));
                            let local = d.tensor_from(&(0..rows * cols).map(|i| (r * 1000 + i) as f32).collect::<Vec<_>>());
                            let mut out = d.tensor_from(&vec![0.0; rows * cols * n]);
                            c.all_gather_cols(&local, rows, cols, &mut out);
                            let mut h = vec![0.0; rows * cols * n];
                            d.to_host(&out, rows * cols * n, &mut h);
                            for i in 0..rows {
                                for q in 0..n {
                                    for j in 0..cols {
                                        assert_eq!(h[i * cols * n + q * cols + j], (q * 1000 + i * cols + j) as f32, "{n} ranks, gather on rank {r}");
                                    }
                                }
                            }
                            seen
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            // The host's rank-ordered sums, round by round.
            let mut want: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| ((i % 97) * 10 + r) as f32 * 0.1).collect()).collect();
            for round in 0..rounds {
                let sum: Vec<f32> = (0..len).map(|i| (1..n).fold(want[0][i] + 1.0, |s, r| s + (want[r][i] + 1.0))).collect();
                for (r, seen) in got.iter().enumerate() {
                    if let Some(i) = (0..len).find(|&i| seen[round][i].to_bits() != sum[i].to_bits()) {
                        panic!("{n} ranks, {len} elements, round {round}: rank {r} element {i} is {} (want {})", seen[round][i], sum[i]);
                    }
                }
                want = vec![sum; n];
            }
            eprintln!("{n} ranks, {len} elements: {rounds} rounds of all-reduce identical to the rank-ordered sum");
        }
    }
}
