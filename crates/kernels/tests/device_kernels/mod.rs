//! Device ops against the CPU device (f32) on random inputs, for any device: fresh seeds each run
//! (printed), outputs poisoned with NaN before the op so an unwritten element fails, shapes that
//! are not multiples of any block, tile or warp size. Shared by `cuda_kernels.rs` and
//! `opencl_kernels.rs` (and `logit_edits.rs`, on the CPU); the q/k-norm and MoE checks are in `moe`,
//! the logit edits' in `logit_edits`.
#![allow(dead_code)]

pub mod logit_edits;
pub mod moe;

use quiver_kernels::cpu::CpuDevice;
use quiver_kernels::sample::{self, SampleOut, SampleSpec, DRAWN};
use quiver_kernels::{AttnBatch, DType, Device, KvLayout, RopeTable, Tensor, Weight};
use rand::{rngs::StdRng, Rng as _, SeedableRng};

/// Relative errors a device may show against the CPU (what it rounds differently).
pub struct Tolerances {
    pub matmul_f32: f64,
    pub matmul_bf16: f64,
    pub attention: f64,
}

/// Fresh seed per run (printed, so a failure can be replayed).
pub struct Rng(pub StdRng);

impl Rng {
    pub fn fresh(tag: &str) -> Self {
        let seed = std::env::var("QUIVER_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64);
        eprintln!("{tag}: seed {seed} (QUIVER_TEST_SEED to replay)");
        Rng(StdRng::seed_from_u64(seed))
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.0.random_range(-1.0f32..1.0) * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }
}

pub fn poisoned(d: &dyn Device, len: usize) -> Tensor {
    d.tensor_from(&vec![f32::NAN; len])
}

pub fn host(d: &dyn Device, t: &Tensor, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    d.to_host(t, len, &mut v);
    v
}

/// ‖got − want‖ / ‖want‖, failing on any NaN (an unwritten element).
pub fn rel_err(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g} (unwritten or overflow); want {w}");
        num += ((g - w) as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_err(what, got, want);
    eprintln!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// Weight GEMMs of every shape class (one row, odd widths, k not a multiple of any tile), f32 and
/// bf16 weights, with and without bias.
pub fn matmul_matches_cpu(g: &dyn Device, tol: &Tolerances) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("matmul");
    for &(m, n, k) in &[(1, 1, 1), (1, 577, 576), (3, 130, 67), (17, 1000, 129), (64, 256, 512), (200, 33, 1000), (5, 4099, 2048), (8, 300, 4096), (8, 129, 64), (2, 64, 1000), (1, 4099, 4096), (1, 33, 14336), (1, 1000, 1000), (1, 7, 8), (1, 130, 67), (1, 9, 520)] {
        for dtype in [DType::Bf16, DType::F32] {
            for with_bias in [false, true] {
                let x = r.vec(m * k, 1.0);
                let w = r.vec(n * k, 0.5);
                let b = r.vec(n, 1.0);
                let wc = c.load_weight(Weight::from_f32(n, k, w.clone(), dtype));
                let wg = g.load_weight(Weight::from_f32(n, k, w, dtype));
                let (bc, bg) = (c.tensor_from(&b), g.tensor_from(&b));
                let (xc, xg) = (c.tensor_from(&x), g.tensor_from(&x));
                let (mut yc, mut yg) = (poisoned(&c, m * n), poisoned(g, m * n));
                c.matmul(&xc, m, &wc, with_bias.then_some(&bc), &mut yc);
                g.matmul(&xg, m, &wg, with_bias.then_some(&bg), &mut yg);
                let tol = if dtype == DType::Bf16 { tol.matmul_bf16 } else { tol.matmul_f32 };
                check(&format!("matmul m={m} n={n} k={k} {dtype:?} bias={with_bias}"), &host(g, &yg, m * n), &yc.as_cpu()[..m * n], tol);
            }
        }
    }
}

pub fn embedding_and_gather_match_cpu(g: &dyn Device) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("embedding");
    for &(vocab, dim, rows) in &[(10, 1, 1), (1000, 67, 13), (32000, 576, 40)] {
        for dtype in [DType::Bf16, DType::F32] {
            let t = r.vec(vocab * dim, 1.0);
            let tc = c.load_weight(Weight::from_f32(vocab, dim, t.clone(), dtype));
            let tg = g.load_weight(Weight::from_f32(vocab, dim, t, dtype));
            let ids: Vec<u32> = (0..rows).map(|_| r.below(vocab) as u32).collect();
            let (mut oc, mut og) = (poisoned(&c, rows * dim), poisoned(g, rows * dim));
            c.embedding(&tc, &ids, &mut oc);
            g.embedding(&tg, &ids, &mut og);
            check(&format!("embedding {vocab}x{dim} rows={rows} {dtype:?}"), &host(g, &og, rows * dim), &oc.as_cpu()[..rows * dim], 0.0);

            let pick: Vec<u32> = (0..rows / 2 + 1).map(|_| r.below(rows) as u32).collect();
            let (mut pc, mut pg) = (poisoned(&c, pick.len() * dim), poisoned(g, pick.len() * dim));
            c.gather_rows(&oc, &pick, dim, &mut pc);
            g.gather_rows(&og, &pick, dim, &mut pg);
            check(&format!("gather_rows dim={dim} n={}", pick.len()), &host(g, &pg, pick.len() * dim), &pc.as_cpu()[..pick.len() * dim], 0.0);
        }
    }
}

/// A step whose ids name the last launch's draws (`sample::DRAWN | i`): the embedding reads
/// the drawn tokens, the ones `sample_collect` returns, whether the step was queued before the
/// collect (the overlapped engine's order) or after it.
pub fn drawn_ids_resolve_to_the_last_draws(g: &dyn Device) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("resolve_drawn");
    let (vocab, dim, draws) = (1000, 67, 5);
    let logits = r.vec(draws * vocab, 4.0);
    let lt = g.tensor_from(&logits);
    // Greedy draws: each row's argmax, known here.
    let specs: Vec<SampleSpec> = (0..draws as u32).map(|row| SampleSpec { row, top_p: 1.0, logprobs: -1, ..Default::default() }).collect();
    let want: Vec<u32> = logits.chunks(vocab).map(sample::argmax).collect();
    let t = r.vec(vocab * dim, 1.0);
    let tc = c.load_weight(Weight::from_f32(vocab, dim, t.clone(), DType::F32));
    let tg = g.load_weight(Weight::from_f32(vocab, dim, t, DType::F32));
    let ids = [3, DRAWN | 4, 17, DRAWN, DRAWN | 2, 999, DRAWN | 4];
    let plain: Vec<u32> = ids.iter().map(|&t| if t & DRAWN != 0 { want[(t & !DRAWN) as usize] } else { t }).collect();
    let rows = ids.len();
    let positions: Vec<u32> = (0..rows as u32).collect();
    let (starts, ctx) = ([0, rows as u32], [rows as u32]);
    let batch = AttnBatch { seq_starts: &starts, positions: &positions, ctx_lens: &ctx, block_tables: &[0], block_table_stride: 1 };
    let mut oc = poisoned(&c, rows * dim);
    c.embedding(&tc, &plain, &mut oc);
    for collect_first in [false, true] {
        g.sample_launch(&lt, vocab, &specs);
        let mut outs = vec![SampleOut::default(); draws];
        if collect_first {
            g.sample_collect(&mut outs);
        }
        g.stage_batch(&ids, &batch, &[], &[]);
        let mut resolved = Vec::new();
        let step_ids = g.resolve_drawn(&ids, &mut resolved);
        let mut og = poisoned(g, rows * dim);
        g.embedding(&tg, step_ids, &mut og);
        if !collect_first {
            g.sample_collect(&mut outs);
        }
        assert_eq!(outs.iter().map(|o| o.token).collect::<Vec<_>>(), want, "collected draws");
        check(&format!("embedding of ids naming draws (collected {})", if collect_first { "before" } else { "after" }), &host(g, &og, rows * dim), &oc.as_cpu()[..rows * dim], 0.0);
    }
}

pub fn norms_and_elementwise_match_cpu(g: &dyn Device) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("norms");
    for &(rows, dim) in &[(1, 1), (3, 7), (9, 576), (33, 2051), (2, 4096)] {
        let n = rows * dim;
        let (x, d, w) = (r.vec(n, 3.0), r.vec(n, 1.0), r.vec(dim, 1.0));
        let (wc, wg) = (c.tensor_from(&w), g.tensor_from(&w));
        let (xc, xg) = (c.tensor_from(&x), g.tensor_from(&x));
        let (mut oc, mut og) = (poisoned(&c, n), poisoned(g, n));
        c.rms_norm(&xc, &wc, 1e-5, rows, dim, &mut oc);
        g.rms_norm(&xg, &wg, 1e-5, rows, dim, &mut og);
        check(&format!("rms_norm {rows}x{dim}"), &host(g, &og, n), &oc.as_cpu()[..n], 1e-5);

        let (mut rc, mut rg) = (c.tensor_from(&x), g.tensor_from(&x));
        let (dc, dg) = (c.tensor_from(&d), g.tensor_from(&d));
        let (mut oc, mut og) = (poisoned(&c, n), poisoned(g, n));
        c.add_rms_norm(&mut rc, &dc, &wc, 1e-6, rows, dim, &mut oc);
        g.add_rms_norm(&mut rg, &dg, &wg, 1e-6, rows, dim, &mut og);
        check(&format!("add_rms_norm out {rows}x{dim}"), &host(g, &og, n), &oc.as_cpu()[..n], 1e-5);
        check(&format!("add_rms_norm resid {rows}x{dim}"), &host(g, &rg, n), &rc.as_cpu()[..n], 1e-6);

        c.add_inplace(&mut rc, &dc, n);
        g.add_inplace(&mut rg, &dg, n);
        check(&format!("add_inplace {n}"), &host(g, &rg, n), &rc.as_cpu()[..n], 1e-6);

        let gu = r.vec(rows * 2 * dim, 4.0);
        let (gc, gg) = (c.tensor_from(&gu), g.tensor_from(&gu));
        let (mut oc, mut og) = (poisoned(&c, n), poisoned(g, n));
        c.silu_mul(&gc, rows, dim, &mut oc);
        g.silu_mul(&gg, rows, dim, &mut og);
        check(&format!("silu_mul {rows}x{dim}"), &host(g, &og, n), &oc.as_cpu()[..n], 1e-5);
    }
}

pub fn rope_table(d: &dyn Device, head_dim: usize, max_pos: usize) -> RopeTable {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..max_pos {
        for i in 0..half {
            let a = p as f64 * 10000f64.powf(-((2 * i) as f64) / head_dim as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    RopeTable { head_dim, rotary_dim: head_dim, max_pos, cos: d.tensor_from(&cos), sin: d.tensor_from(&sin) }
}

pub fn rope_matches_cpu(g: &dyn Device) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("rope");
    for &(rows, nh, nkv, hd) in &[(1, 1, 1, 2), (5, 9, 3, 64), (37, 32, 8, 128), (4, 6, 2, 80)] {
        let (tc, tg) = (rope_table(&c, hd, 4096), rope_table(g, hd, 4096));
        let width = (nh + 2 * nkv) * hd;
        let x = r.vec(rows * width, 2.0);
        let pos: Vec<u32> = (0..rows).map(|_| r.below(4096) as u32).collect();
        let (mut xc, mut xg) = (c.tensor_from(&x), g.tensor_from(&x));
        c.rope_qk(&mut xc, rows, &pos, nh, nkv, &tc);
        g.rope_qk(&mut xg, rows, &pos, nh, nkv, &tg);
        check(&format!("rope rows={rows} heads={nh}/{nkv} hd={hd}"), &host(g, &xg, rows * width), &xc.as_cpu()[..rows * width], 1e-5);
    }
}

/// Varlen prefill of several sequences (block tables scattered over a shuffled pool), then a
/// decode step of one row each, then a prefill chunk continuing each sequence (new rows attend to
/// a cached prefix), then a mixed step (one row for half the sequences, a chunk for the others,
/// interleaved): every step's output against the CPU. Lengths straddle the prefill kernel's
/// 64-row and 64-key tiles; head dims that are not multiples of its 32-dim padding.
pub fn paged_attention_matches_cpu(g: &dyn Device, tol: &Tolerances) {
    paged_attention_cases_match_cpu(g, tol, &[(4, 4, 16, 16), (9, 3, 64, 16), (32, 8, 128, 16), (6, 2, 80, 8), (8, 2, 96, 16), (4, 1, 40, 16), (2, 2, 8, 16), (3, 1, 20, 16)]);
}

/// The checks of [`paged_attention_matches_cpu`] over `(q heads, kv heads, head dim, block size)`.
/// Block tables of `seqs` sequences of `max_blocks` blocks each, drawn without repeats from a
/// shuffled pool of a few more blocks (so no table is in order): the pool's size and the tables.
fn shuffled_block_tables(r: &mut Rng, seqs: usize, max_blocks: usize) -> (usize, Vec<u32>) {
    let num_blocks = seqs * max_blocks + 3;
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, r.below(i + 1));
    }
    pool.truncate(seqs * max_blocks);
    (num_blocks, pool)
}

pub fn paged_attention_cases_match_cpu(g: &dyn Device, tol: &Tolerances, cases: &[(usize, usize, usize, usize)]) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("attention");
    for &(nh, nkv, hd, bs) in cases {
        let lens = [1usize, 5, 17, 40, 64, 130, 200, 3]; // 8 rows in the decode step
        let chunk = 70;
        // Step 3 mixes them: even sequences decode one row, odd ones bring a chunk of `mix`
        // rows, so a mixed step's one-row sequences sit between the others' rows.
        let mix = 9;
        let max_blocks = (lens.iter().max().unwrap() + 2 + chunk + mix).div_ceil(bs);
        let (num_blocks, tables) = shuffled_block_tables(&mut r, lens.len(), max_blocks);
        let layout = KvLayout { num_layers: 2, num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let (mut kc, mut kg) = (c.alloc_kv(layout), g.alloc_kv(layout));
        let width = (nh + 2 * nkv) * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        for step in 0..4 {
            let (mut starts, mut positions, mut ctx) = (vec![0u32], Vec::new(), Vec::new());
            for (s, &l) in lens.iter().enumerate() {
                let (from, to) = match step {
                    0 => (0, l),
                    1 => (l, l + 1),
                    2 => (l + 1, l + 1 + chunk),
                    _ => (l + 1 + chunk, l + 1 + chunk + if s % 2 == 0 { 1 } else { mix }),
                };
                positions.extend(from as u32..to as u32);
                starts.push(positions.len() as u32);
                ctx.push(to as u32);
            }
            let rows = positions.len();
            let b = AttnBatch { seq_starts: &starts, positions: &positions, ctx_lens: &ctx, block_tables: &tables, block_table_stride: max_blocks };
            let qkv = r.vec(rows * width, 2.0);
            let (qc, qg) = (c.tensor_from(&qkv), g.tensor_from(&qkv));
            let (mut oc, mut og) = (poisoned(&c, rows * nh * hd), poisoned(g, rows * nh * hd));
            c.paged_attention(&qc, &b, &mut kc, 1, nh, scale, &mut oc);
            g.paged_attention(&qg, &b, &mut kg, 1, nh, scale, &mut og);
            check(&format!("attention heads={nh}/{nkv} hd={hd} bs={bs} step={step} rows={rows}"), &host(g, &og, rows * nh * hd), &oc.as_cpu()[..rows * nh * hd], tol.attention);
        }
    }
}

/// Decode attention over long, mixed contexts: sequences of 0 to 1100 cached tokens (one prefill
/// step, checked as a whole like `paged_attention_cases_match_cpu`'s), then two decode steps of
/// one row per sequence (40 rows, contexts from one key to 1102, across tile and block edges),
/// each row checked on its own. The last step's output
/// then goes through a bf16 GEMM too, large enough not to split its input, so a device that hands
/// the GEMM a bf16 copy of the attention output written in the same pass has that copy checked.
/// Cases are `(q heads, kv heads, head dim, block size)`.
pub fn decode_attention_cases_match_cpu(g: &dyn Device, tol: &Tolerances, cases: &[(usize, usize, usize, usize)]) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("decode attention");
    let lens = [0usize, 1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 380, 511, 1100, 0, 5, 9, 24, 48, 80, 160, 177, 3, 12, 40, 96, 150, 190, 700, 1023, 7];
    for &(nh, nkv, hd, bs) in cases {
        let max_blocks = (lens.iter().max().unwrap() + 2).div_ceil(bs);
        let (num_blocks, tables) = shuffled_block_tables(&mut r, lens.len(), max_blocks);
        let layout = KvLayout { num_layers: 1, num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let (mut kc, mut kg) = (c.alloc_kv(layout), g.alloc_kv(layout));
        let width = (nh + 2 * nkv) * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        for step in 0..3 {
            // Step 0 prefills the sequences with cached tokens (only those: no empty sequences).
            let seqs: Vec<usize> = (0..lens.len()).filter(|&s| step > 0 || lens[s] > 0).collect();
            let (mut starts, mut positions, mut ctx, mut tab) = (vec![0u32], Vec::new(), Vec::new(), Vec::new());
            for &s in &seqs {
                let (from, to) = if step == 0 { (0, lens[s]) } else { (lens[s] + step - 1, lens[s] + step) };
                positions.extend(from as u32..to as u32);
                starts.push(positions.len() as u32);
                ctx.push(to as u32);
                tab.extend_from_slice(&tables[s * max_blocks..(s + 1) * max_blocks]);
            }
            let rows = positions.len();
            let b = AttnBatch { seq_starts: &starts, positions: &positions, ctx_lens: &ctx, block_tables: &tab, block_table_stride: max_blocks };
            let qkv = r.vec(rows * width, 2.0);
            let (qc, qg) = (c.tensor_from(&qkv), g.tensor_from(&qkv));
            let (mut oc, mut og) = (poisoned(&c, rows * nh * hd), poisoned(g, rows * nh * hd));
            // The last step's GEMM: n past the 16 MB of weight under which CUDA splits the input.
            let k = nh * hd;
            let n = (16 << 20) / (2 * k) + 8;
            let gemm = (step == 2).then(|| {
                let w = r.vec(n * k, 0.5);
                let wg = g.load_weight(Weight::from_f32(n, k, w.clone(), DType::Bf16));
                (w, wg, poisoned(g, rows * n))
            });
            c.paged_attention(&qc, &b, &mut kc, 0, nh, scale, &mut oc);
            // Not staged first, like every op of these checks: the decode steps' metadata vectors
            // have one length, so a fresh one may sit at the last one's address, which a device
            // staging implicitly must not take for the old batch (CUDA compared the address
            // alone until session 23, and both attention kernels read step 1's positions here).
            g.paged_attention(&qg, &b, &mut kg, 0, nh, scale, &mut og);
            let gemm = gemm.map(|(w, wg, mut yg)| {
                g.matmul(&og, rows, &wg, None, &mut yg); // right after the attention
                (w, yg)
            });
            let what = format!("decode attention heads={nh}/{nkv} hd={hd} bs={bs} step={step} rows={rows}");
            let (got, want) = (host(g, &og, rows * nh * hd), &oc.as_cpu()[..rows * nh * hd]);
            if step == 0 {
                check(&what, &got, want, tol.attention);
            } else {
                let mut worst = 0.0f64;
                for (i, &p) in positions.iter().enumerate() {
                    let at = i * nh * hd..(i + 1) * nh * hd;
                    let e = rel_err(&what, &got[at.clone()], &want[at]);
                    assert!(e <= tol.attention, "{what}: row {i} (context {}) relative error {e:.3e} > {:.0e}", p + 1, tol.attention);
                    worst = worst.max(e);
                }
                eprintln!("{what}: worst row rel err {worst:.2e}");
            }
            if let Some((w, yg)) = gemm {
                let wc = c.load_weight(Weight::from_f32(n, k, w, DType::Bf16));
                let mut yc = poisoned(&c, rows * n);
                c.matmul(&oc, rows, &wc, None, &mut yc);
                check(&format!("{what} then matmul n={n}"), &host(g, &yg, rows * n), &yc.as_cpu()[..rows * n], tol.attention + tol.matmul_bf16);
            }
        }
    }
}
