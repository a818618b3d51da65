//! The LoRA device op of a device with its own memory (through the pool, the packed groups and
//! the hook, as the model uses them) against the CPU reference backend on random batches: fresh
//! seeds (printed), ranks 1..R with several below R in one batch, base rows interleaved (which
//! must stay bit for bit as they were), slot reuse by smaller ranks, absent modules, 2- and
//! 3-slice expands of unequal widths, odd widths (scalar paths) and multiples of 8 (vector
//! paths), segments of length 1 to 2048, chunk boundaries, permuted rows, embedding and lm_head;
//! and one step shape run under several adapter mixes (CUDA: a recorded graph replayed). Shared
//! by `cuda_lora.rs` and `opencl_lora.rs`.
#![allow(dead_code)]

pub mod experts;

use crate::common::*;
use quiver_kernels::{open_device, AttnBatch, Device, DeviceKind, LoraX, Tensor};
use quiver_lora::backend::ReferenceBackend;
use quiver_lora::{AdapterKey, LinearSite, LoraBackend, LoraConfig, LoraHook, LoraManager, LoraModelDims, LoraModule, SiteRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Relative error of the delta. Adapters and inputs are bf16-representable (what the device
/// stores and, on tensor cores, multiplies), so the device and the f64 reference differ only by
/// f32 accumulation: far under bf16's own 1e-2. (With plain random f32 values a rank-1 site
/// whose `x·a` cancels to near zero measured 15% relative error from A's bf16 rounding alone.)
const TOL: f64 = 1e-3;
/// The delta of a long prompt on CUDA: through a bf16 copy of t (see `projections_with_epilogues_match_cpu`).
const PROMPT_GEMM_TOL: f64 = 5e-3;

/// A uniform value in [-1, 1) that bf16 represents exactly.
fn bf16_value(rng: &mut StdRng) -> f32 {
    half::bf16::from_f32(rng.random_range(-1.0..1.0)).to_f32()
}

/// Widths that are multiples of 8 (the kernels' 16-byte paths), unequal q / kv slices.
pub const WIDE: LoraModelDims = LoraModelDims { num_layers: 2, hidden: 256, q_out: 256, kv_out: 64, intermediate: 704, vocab: 1000, moe: None };

/// A pair of managers with the same adapters: CPU (reference backend, f32) and CUDA (`backend`).
struct Pair {
    cpu: LoraManager,
    gpu: LoraManager,
    dev: Arc<dyn Device>,
    keys: Vec<(AdapterKey, AdapterKey)>,
}

impl Pair {
    fn new(dims: LoraModelDims, slots: usize, rmax: usize, backend: &str, dev: Arc<dyn Device>, paths: &[std::path::PathBuf]) -> Pair {
        let cfg = |backend: &str| LoraConfig {
            max_loras_per_batch: slots,
            max_lora_rank: rmax,
            max_loaded_loras: paths.len().max(slots),
            target_modules: LoraModule::ALL.to_vec(),
            backend: backend.into(),
            max_batch_tokens: 64,
            ..Default::default()
        };
        let mut cpu = LoraManager::new(dims, cfg("reference"), open_device(DeviceKind::Cpu).unwrap()).unwrap();
        let mut gpu = LoraManager::new(dims, cfg(backend), dev.clone()).unwrap();
        let keys = paths.iter().enumerate().map(|(i, p)| (cpu.load_adapter(&format!("a{i}"), p).unwrap(), gpu.load_adapter(&format!("a{i}"), p).unwrap())).collect();
        Pair { cpu, gpu, dev, keys }
    }
}

/// Metadata of a batch of sequences with these row counts, as the model stages it.
struct Staging {
    starts: Vec<u32>,
    positions: Vec<u32>,
    ctx: Vec<u32>,
    tables: Vec<u32>,
    logits: Vec<u32>,
    ids: Vec<u32>,
}

impl Staging {
    fn new(lens: &[u32], vocab: usize, rng: &mut StdRng) -> Staging {
        let mut starts = vec![0u32];
        for l in lens {
            starts.push(starts.last().unwrap() + l);
        }
        let m = *starts.last().unwrap() as usize;
        Staging {
            positions: vec![0; m],
            ctx: lens.to_vec(),
            tables: vec![0; lens.len()],
            logits: starts[1..].iter().map(|s| s - 1).collect(),
            ids: (0..m).map(|_| rng.random_range(0..vocab as u32 + 3)).collect(),
            starts,
        }
    }
    fn attn(&self) -> AttnBatch<'_> {
        AttnBatch { seq_starts: &self.starts, positions: &self.positions, ctx_lens: &self.ctx, block_tables: &self.tables, block_table_stride: 1 }
    }
}

fn to_host(d: &dyn Device, t: &Tensor, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    d.to_host(t, len, &mut v);
    v
}

/// Runs every site of the prepared batch through the hook on both devices and compares: the
/// delta of every adapter row within `TOL` (relative, over the whole site), every other row
/// exactly as it was. Returns the sites checked.
fn check_batch(p: &mut Pair, seqs: &[Option<usize>], st: &Staging, rng: &mut StdRng, ctx: &str) -> usize {
    let ckeys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
    let gkeys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
    p.cpu.prepare_batch(&ckeys, &st.starts, &st.logits).unwrap();
    p.gpu.prepare_batch(&gkeys, &st.starts, &st.logits).unwrap();
    let dev = &*p.dev;
    let (info, ginfo) = (p.cpu.batch_info(), p.gpu.batch_info());
    let (t, l) = (&ginfo.tokens, &ginfo.logits);
    let staged: [&[u32]; 4] = [&t.packed_segments, &t.packed_chunks, &l.packed_segments, &l.packed_chunks];
    dev.stage_batch(&st.ids, &st.attn(), &st.logits, &staged);
    let cpu = open_device(DeviceKind::Cpu).unwrap();
    let mut checked = 0;
    for ((what, cs, emb, on_logits), (_, gs, _, _)) in pool_sites(&p.cpu).into_iter().zip(pool_sites(&p.gpu)) {
        let g = if on_logits { &info.logits } else { &info.tokens };
        let rows = g.rows();
        let (din, dout) = (cs.buffers.shape.in_dim, cs.buffers.shape.out_dim());
        let x: Vec<f32> = (0..rows * din).map(|_| bf16_value(rng)).collect();
        let y0: Vec<f32> = (0..rows * dout).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (xc, xg) = (Tensor::cpu(x.clone()), dev.tensor_from(&x));
        let (mut yc, mut yg) = (Tensor::cpu(y0.clone()), dev.tensor_from(&y0));
        let (ix, igx) = if emb { (LoraX::TokenIds(&st.ids), LoraX::TokenIds(&st.ids)) } else { (LoraX::Dense(&xc), LoraX::Dense(&xg)) };
        ReferenceBackend.apply(&*cpu, cs, g, ix, &mut yc);
        let gg = if on_logits { &ginfo.logits } else { &ginfo.tokens };
        p.gpu_backend_apply(dev, gs, gg, igx, &mut yg);
        let want = yc.as_cpu()[..rows * dout].to_vec();
        let got = to_host(dev, &yg, rows * dout);
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for r in 0..rows {
            let adapter = g.row_slot[r] >= 0 && cs.table.ranks_at(cs.entry)[g.row_slot[r] as usize] > 0;
            for c in 0..dout {
                let i = r * dout + c;
                assert!(got[i].is_finite(), "{ctx}: {what} row {r} col {c} is {}", got[i]);
                if adapter {
                    num += ((got[i] - want[i]) as f64).powi(2);
                    den += ((want[i] - y0[i]) as f64).powi(2);
                } else {
                    assert_eq!(got[i], y0[i], "{ctx}: {what}: row {r} (no adapter here) changed at column {c}");
                }
            }
        }
        let rel = (num / den.max(1e-30)).sqrt();
        if rel > TOL {
            // Which rows are off, by how much, and what the grouping was: enough to tell a
            // kernel's indexing from a race.
            for r in 0..rows {
                let slot = g.row_slot[r];
                let d: f64 = (0..dout).map(|c| ((got[r * dout + c] - want[r * dout + c]) as f64).powi(2)).sum::<f64>().sqrt();
                let w: f64 = (0..dout).map(|c| ((want[r * dout + c] - y0[r * dout + c]) as f64).powi(2)).sum::<f64>().sqrt();
                let rank = if slot >= 0 { cs.table.ranks_at(cs.entry)[slot as usize] } else { 0 };
                eprintln!("  row {r}: cpu slot {slot} rank {rank}, gpu slot {}, |err| {d:.3e}, |delta| {w:.3e}", gg.row_slot[r]);
            }
            eprintln!("  gpu packed segments {:?}\n  gpu packed chunks {:?}", &gg.packed_segments, &gg.packed_chunks);
        }
        assert!(rel <= TOL, "{ctx}: {what} ({rows} rows): relative error of the delta {rel:.3e} > {TOL:.0e}");
        checked += 1;
    }
    checked
}

impl Pair {
    /// The CUDA manager's own backend on one site (what `BatchHook` does).
    fn gpu_backend_apply(&self, dev: &dyn Device, s: SiteRef<'_>, g: &quiver_lora::batch::RowGrouping, x: LoraX<'_>, y: &mut Tensor) {
        let b = quiver_lora::backend::create_backend(self.gpu.backend_name(), dev.kind()).unwrap();
        b.apply(dev, s, g, x, y);
    }
}

fn adapters(dims: &LoraModelDims, rng: &mut StdRng, n: usize, rmax: usize) -> Vec<std::path::PathBuf> {
    let sets: [&[LoraModule]; 5] = [
        &LoraModule::ALL,
        &[LoraModule::QProj, LoraModule::VProj],
        &[LoraModule::KProj, LoraModule::UpProj, LoraModule::LmHead],
        &[LoraModule::GateProj, LoraModule::DownProj, LoraModule::OProj, LoraModule::EmbedTokens],
        &[LoraModule::QProj],
    ];
    (0..n)
        .map(|i| {
            let r = if i == 0 { rmax } else { rng.random_range(1..=rmax) };
            let mods = sets[rng.random_range(0..sets.len())];
            random_adapter_for(dims, "cuda", rng.random(), r, 2.0 * r as f32, mods, &|_, _| r, serde_json::json!({"use_rslora": i % 3 == 2}), true)
        })
        .collect()
}

/// Random batches through every backend against the CPU reference.
pub fn lora_matches_cpu_reference_on_random_batches(dev: Arc<dyn Device>, tag: &str) {
    let seed = fresh_seed();
    eprintln!("{tag} lora: seed {seed} (QUIVER_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut checked = 0;
    for (round, dims) in [DIMS, WIDE, DIMS, WIDE, WIDE, WIDE].into_iter().enumerate() {
        let rmax = [4usize, 8, 16, 16, 64, 32][round];
        let slots = rng.random_range(2..=5);
        let paths = adapters(&dims, &mut rng, slots + 2, rmax);
        for backend in ["segmented", "chunked", "auto"] {
            let mut p = Pair::new(dims, slots, rmax, backend, dev.clone(), &paths);
            for step in 0..6 {
                let decode = step % 2 == 0;
                // Decode steps past 64 rows too: there CUDA's tensor-core shrink meets tiles of a
                // few rows (many adapters), which it dots by warps.
                let nseq = if decode { rng.random_range(1..=96) } else { rng.random_range(1..=8) };
                let lens: Vec<u32> = (0..nseq).map(|_| if decode { 1 } else { [1u32, 2, 7, 15, 16, 17, 33, 100][rng.random_range(0..8)] }).collect();
                // At most `slots` distinct adapters, a quarter of the rows on the base model.
                let mut pick: Vec<usize> = (0..paths.len()).collect();
                for i in (1..pick.len()).rev() {
                    pick.swap(i, rng.random_range(0..=i));
                }
                pick.truncate(slots);
                let seqs: Vec<Option<usize>> = (0..nseq).map(|_| (!rng.random_bool(0.25)).then(|| pick[rng.random_range(0..pick.len())])).collect();
                let st = Staging::new(&lens, dims.vocab, &mut rng);
                checked += check_batch(&mut p, &seqs, &st, &mut rng, &format!("seed {seed} round {round} {backend} step {step}"));
            }
        }
    }
    // One 2048-row segment next to short ones (the prefill shape), every backend.
    let paths = adapters(&WIDE, &mut rng, 3, 16);
    for backend in ["segmented", "chunked", "auto"] {
        let mut p = Pair::new(WIDE, 3, 16, backend, dev.clone(), &paths);
        let st = Staging::new(&[2048, 1, 2, 33], WIDE.vocab, &mut rng);
        checked += check_batch(&mut p, &[Some(0), None, Some(1), Some(2)], &st, &mut rng, &format!("seed {seed} long segment {backend}"));
    }
    eprintln!("{tag} lora: {checked} site calls matched the CPU reference");
}

/// A slot rewritten by a rank-2 adapter lacking most modules after a rank-16 one with all of
/// them: bit for bit what a fresh pool holding only the small one gives.
pub fn slot_reuse_by_smaller_rank_leaks_nothing(dev: Arc<dyn Device>) {
    let seed = fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let big = random_adapter_for(&WIDE, "big", rng.random(), 16, 32.0, &LoraModule::ALL, &|_, _| 16, serde_json::json!({}), true);
    let small = random_adapter_for(&WIDE, "small", rng.random(), 2, 4.0, &[LoraModule::KProj, LoraModule::UpProj], &|_, _| 2, serde_json::json!({}), true);
    let cfg = || LoraConfig { max_loras_per_batch: 1, max_lora_rank: 16, max_loaded_loras: 2, target_modules: LoraModule::ALL.to_vec(), backend: "chunked".into(), ..Default::default() };
    let mut reused = LoraManager::new(WIDE, cfg(), dev.clone()).unwrap();
    let kb = reused.load_adapter("big", &big).unwrap();
    let ks = reused.load_adapter("small", &small).unwrap();
    let st = Staging::new(&[1, 1, 1, 1, 1], WIDE.vocab, &mut rng);
    reused.prepare_batch(&[Some(kb); 5], &st.starts, &st.logits).unwrap();
    let mut fresh = LoraManager::new(WIDE, cfg(), dev.clone()).unwrap();
    let kf = fresh.load_adapter("small", &small).unwrap();
    let x: Vec<f32> = (0..5 * WIDE.intermediate).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut outs = Vec::new();
    for (mgr, key) in [(&mut reused, ks), (&mut fresh, kf)] {
        let hook = mgr.prepare_batch(&[Some(key); 5], &st.starts, &st.logits).unwrap();
        dev.stage_batch(&st.ids, &st.attn(), &st.logits, &hook.staged());
        let mut all = Vec::new();
        for l in 0..WIDE.num_layers {
            for s in LinearSite::ALL {
                let (din, dout) = (WIDE.site_dims(s).0, { let (_, w, n) = WIDE.site_dims(s); w[..n].iter().sum::<usize>() });
                let xg = dev.tensor_from(&x[..5 * din]);
                let mut y = dev.tensor_from(&vec![0.0; 5 * dout]);
                hook.linear(&*dev, l, s, &xg, 5, &mut y);
                all.push(to_host(&*dev, &y, 5 * dout));
            }
        }
        outs.push(all);
    }
    assert_eq!(outs[0], outs[1], "seed {seed}: reused slot differs from a fresh one");
    let o_site = &outs[0][LinearSite::O.index()];
    assert!(o_site.iter().all(|&v| v == 0.0), "seed {seed}: o_proj delta leaked from the evicted adapter");
    let qkv = &outs[0][LinearSite::Qkv.index()];
    let out = WIDE.q_out + 2 * WIDE.kv_out;
    for r in 0..5 {
        let row = &qkv[r * out..(r + 1) * out];
        assert!(row[..WIDE.q_out].iter().all(|&v| v == 0.0), "q slice leaked");
        assert!(row[WIDE.q_out + WIDE.kv_out..].iter().all(|&v| v == 0.0), "v slice leaked");
        assert!(row[WIDE.q_out..WIDE.q_out + WIDE.kv_out].iter().any(|&v| v != 0.0), "k slice missing");
    }
}

/// One decode shape run under one shape key (on CUDA the first step records a graph, the others
/// replay it), with other adapter mixes: more segments and chunks than the first, other slots,
/// one adapter row, all base but one. Each must equal the CPU reference for its own mix (SGLang
/// shipped a graph that dropped every segment beyond the recorded count).
pub fn shape_keyed_steps_follow_the_adapter_mix(dev: Arc<dyn Device>) {
    let seed = fresh_seed();
    eprintln!("shape-keyed steps: seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let paths = adapters(&WIDE, &mut rng, 4, 16);
    let mut p = Pair::new(WIDE, 4, 16, "auto", dev.clone(), &paths);
    let rows = 24usize;
    let st = Staging::new(&vec![1; rows], WIDE.vocab, &mut rng);
    let mixes: Vec<Vec<Option<usize>>> = vec![
        vec![Some(0); rows],
        (0..rows).map(|i| [Some(0), Some(1), Some(2), Some(3), None][i % 5]).collect(),
        (0..rows).map(|i| (i == 7).then_some(2)).collect(),
        (0..rows).map(|i| Some([3, 1][i % 2])).collect(),
        (0..rows).map(|i| [Some(1), None][i % 2]).collect(),
    ];
    let (din, dout) = (WIDE.hidden, WIDE.q_out + 2 * WIDE.kv_out);
    let x: Vec<f32> = (0..rows * din).map(|_| bf16_value(&mut rng)).collect();
    let xg = dev.tensor_from(&x);
    let xc = Tensor::cpu(x.clone());
    let mut yg = dev.tensor_from(&vec![0.0; rows * dout]);
    for (n, mix) in mixes.iter().enumerate() {
        let ck: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
        let gk: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
        let want = {
            let hook = p.cpu.prepare_batch(&ck, &st.starts, &st.logits).unwrap();
            let mut y = Tensor::zeros_cpu(rows * dout);
            hook.linear(&quiver_kernels::cpu::CpuDevice::new(), 1, LinearSite::Qkv, &xc, rows, &mut y);
            y.as_cpu()[..rows * dout].to_vec()
        };
        let hook = p.gpu.prepare_batch(&gk, &st.starts, &st.logits).unwrap();
        dev.upload(&vec![0.0; rows * dout], &mut yg);
        dev.stage_batch(&st.ids, &st.attn(), &st.logits, &hook.staged());
        // The key changes with the grouping kind only (mix 0 takes segments, the others chunks):
        // mix 1 records, mixes 2-4 replay it.
        dev.run_step(rows, Some(0x5eed ^ hook.shape_key()), &mut || hook.linear(&*dev, 1, LinearSite::Qkv, &xg, rows, &mut yg));
        let got = to_host(&*dev, &yg, rows * dout);
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (r, s) in mix.iter().enumerate() {
            for c in 0..dout {
                let i = r * dout + c;
                if s.is_none() {
                    assert_eq!(got[i], 0.0, "mix {n}: base row {r} changed");
                }
                num += ((got[i] - want[i]) as f64).powi(2);
                den += (want[i] as f64).powi(2);
            }
        }
        let rel = (num / den.max(1e-30)).sqrt();
        eprintln!("shape-keyed step, mix {n}: relative error {rel:.2e}");
        assert!(rel <= TOL, "seed {seed}: replay with mix {n}: relative error {rel:.3e}");
    }
}

/// Rotate-half RoPE tables for heads of `hd` at positions below `max_pos` (base 10000) on `d`.
fn rope_table(d: &dyn Device, hd: usize, max_pos: usize) -> quiver_kernels::RopeTable {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..max_pos {
        for i in 0..hd / 2 {
            let a = pos as f64 * 10000f64.powf(-2.0 * i as f64 / hd as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    quiver_kernels::RopeTable { head_dim: hd, rotary_dim: hd, max_pos, cos: d.tensor_from(&cos), sin: d.tensor_from(&sin) }
}

/// Projections through the hook (`LoraHook::project`) against the CPU reference for every site
/// and epilogue (RoPE, SiLU·mul, the residual after o / down), at one row (CUDA: the single-row
/// GEMV computing the delta itself, RoPE or SiLU·mul still fused), at 12 decode rows of two
/// adapters and base rows (CUDA: the delta beside the GEMM, into the residual or a buffer the
/// epilogue adds), at 160 (CUDA: the expand after the GEMM) and over two long prompts (CUDA:
/// cuBLAS GEMMs per prompt): ranks below the max, rsLoRA, an
/// adapter lacking some modules, two slots for three adapters (slot reuse), a qkv bias every
/// other round. The error is measured against the delta (projection with the adapter minus
/// without it on the CPU), so a delta that went missing fails.
pub fn projections_with_epilogues_match_cpu(dev: Arc<dyn Device>) {
    use quiver_kernels::{DType, Epilogue, RopeTable, Weight};
    let seed = fresh_seed();
    eprintln!("one-row projections: seed {seed} (QUIVER_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let paths = vec![
        random_adapter_for(&WIDE, "full", rng.random(), 16, 32.0, &LoraModule::ALL, &|_, _| 16, serde_json::json!({}), true),
        random_adapter_for(&WIDE, "low", rng.random(), 5, 7.0, &LoraModule::ALL, &|_, _| 5, serde_json::json!({"use_rslora": true}), true),
        random_adapter_for(&WIDE, "some", rng.random(), 8, 16.0, &[LoraModule::QProj, LoraModule::VProj, LoraModule::UpProj, LoraModule::DownProj], &|_, _| 8, serde_json::json!({}), true),
    ];
    let mut p = Pair::new(WIDE, 2, 16, "auto", dev.clone(), &paths);
    let cpu = open_device(DeviceKind::Cpu).unwrap();
    let (hd, max_pos) = (64usize, 64usize);
    let (heads, kv_heads) = (WIDE.q_out / hd, WIDE.kv_out / hd);
    let (tc, tg) = (rope_table(&*cpu, hd, max_pos), rope_table(&*dev, hd, max_pos));
    let mut checked = 0;
    // One-row rounds (CUDA: the GEMV computing the delta itself), then decode steps of 12 rows
    // over two adapters and base rows (the delta beside the GEMM, into the residual or a
    // buffer the RoPE / SiLU·mul adds), 160 decode rows (the expand after the GEMM), and two
    // prompts of 320 and 300 rows around a base one (CUDA: the delta as cuBLAS GEMMs).
    let prefill = [320u32, 8, 300];
    for (round, lens) in [&[1u32][..], &[1], &[1], &[1], &[1], &[1], &[1; 12], &[1; 12], &[1; 160], &prefill].into_iter().enumerate() {
        let a = round % 3;
        let rows = lens.iter().sum::<u32>() as usize;
        let mut st = Staging::new(lens, WIDE.vocab, &mut rng);
        for q in st.positions.iter_mut() {
            *q = rng.random_range(0..max_pos as u32);
        }
        let seqs: Vec<Option<usize>> = (0..lens.len()).map(|i| if lens.len() == 1 { Some(a) } else { [Some(a), None, Some((a + 1) % 3)][i % 3] }).collect();
        let ckeys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
        let gkeys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
        let ch = p.cpu.prepare_batch(&ckeys, &st.starts, &st.logits).unwrap();
        let gh = p.gpu.prepare_batch(&gkeys, &st.starts, &st.logits).unwrap();
        dev.stage_batch(&st.ids, &st.attn(), &st.logits, &gh.staged());
        for layer in 0..WIDE.num_layers {
            for site in LinearSite::ALL {
                let (din, widths, n) = WIDE.site_dims(site);
                let dout: usize = widths[..n].iter().sum();
                let x: Vec<f32> = (0..rows * din).map(|_| bf16_value(&mut rng)).collect();
                let resid0: Vec<f32> = (0..rows * dout).map(|_| rng.random_range(-1.0..1.0)).collect();
                let scale = 1.0 / (din as f32).sqrt();
                let w: Vec<f32> = (0..dout * din).map(|_| bf16_value(&mut rng) * scale).collect();
                let bias: Option<Vec<f32>> = (site == LinearSite::Qkv && round % 2 == 1).then(|| (0..dout).map(|_| rng.random_range(-1.0..1.0)).collect());
                let inter = dout / 2;
                let out_len = rows * if site == LinearSite::GateUp { inter } else { dout };
                // Runs the projection on `d` through `hook` (None: no adapter) and returns what
                // the layer reads next: after o_proj and down_proj the residual plus the output
                // (a device may put the delta in either).
                let run = |d: &dyn Device, hook: Option<&dyn LoraHook>, t: &RopeTable| -> Vec<f32> {
                    let mut wt = d.load_weight(Weight::from_f32(dout, din, w.clone(), DType::Bf16));
                    // As the engine does: the weight keeps the site's B beside its rows where the
                    // device adds deltas that way (CUDA with LoRA tails; nothing elsewhere).
                    if let Some((b, _)) = gh.pool().site(layer, site) {
                        d.lora_attach_tail(&mut wt, b);
                    }
                    let xt = d.tensor_from(&x);
                    let bt = bias.as_ref().map(|b| d.tensor_from(b));
                    let mut y = d.tensor_from(&vec![0.0; rows * dout]);
                    let mut act = d.tensor_from(&vec![0.0; rows * inter]);
                    let mut resid = d.tensor_from(&resid0);
                    let residual = matches!(site, LinearSite::O | LinearSite::Down);
                    let epi = match site {
                        LinearSite::Qkv => Epilogue::RopeQk { positions: &st.positions, n_heads: heads, n_kv_heads: kv_heads, table: t },
                        LinearSite::GateUp => Epilogue::SiluMul { out: &mut act },
                        _ => Epilogue::Residual { resid: &mut resid },
                    };
                    match hook {
                        Some(h) => h.project(d, layer, site, &xt, rows, &wt, bt.as_ref(), epi, &mut y),
                        None => d.matmul_lora(&xt, rows, &wt, bt.as_ref(), None, epi, &mut y),
                    }
                    if residual {
                        // What the layer does next (`Epilogue::Residual`'s contract): add the
                        // output into the residual, where a device may also add a deferred delta.
                        d.add_inplace(&mut resid, &y, out_len);
                        return to_host(d, &resid, out_len);
                    }
                    to_host(d, if site == LinearSite::GateUp { &act } else { &y }, out_len)
                };
                let base = run(&*cpu, None, &tc);
                let want = run(&*cpu, Some(&ch), &tc);
                let got = run(&*dev, Some(&gh), &tg);
                let (mut num, mut den, mut mag) = (0.0f64, 0.0f64, 0.0f64);
                for i in 0..out_len {
                    assert!(got[i].is_finite(), "seed {seed} round {round}: {site:?} column {i} is {}", got[i]);
                    num += ((got[i] - want[i]) as f64).powi(2);
                    den += ((want[i] - base[i]) as f64).powi(2);
                    mag += (want[i] as f64).powi(2);
                }
                // Sites the adapter lacks: the projection alone, to f32 accumulation order.
                let rel = if den > 1e-12 * mag { (num / den).sqrt() } else { (num / mag.max(1e-30)).sqrt() };
                // A long prompt's delta may go through a bf16 copy of t (CUDA's cuBLAS GEMMs take
                // one element type, as the base GEMM takes x in bf16): 2^-9 relative per element.
                // So does a LoRA tail's t̂ (CUDA, opt-in: the delta inside the base GEMM).
                let tailed = gh.pool().site(layer, site).is_some_and(|(b, _)| b.tail.lock().unwrap().is_some());
                let tol = if (lens == &prefill[..] && matches!(dev.kind(), DeviceKind::Cuda(_))) || tailed { PROMPT_GEMM_TOL } else { TOL };
                assert!(rel <= tol, "seed {seed} round {round} adapter {a} layer {layer} {site:?}: relative error {rel:.3e} > {tol:.0e} (|delta|² {den:.3e})");
                checked += 1;
            }
        }
    }
    eprintln!("projections (1, 12, 160 and 628 rows): {checked} matched the CPU reference");
}

/// The RMSNorm that makes qkv's and gate_up's input, through the hook (`LoraHook::norm`: a
/// device may compute the site's shrink in it; CUDA's decode steps do), then the projection
/// through the hook, against the CPU: at 1 row (CUDA: the GEMV computing its own shrink, or
/// with `QUIVER_CUDA_LORA_AHEAD=1` adding the one computed ahead), 12 rows of two adapters and base rows, 128 rows (the largest step that computes it
/// ahead) and 160 (the shrink back with the projection), `add_rms_norm` and `rms_norm` in turn;
/// then one 24-row step shape recorded once and replayed under other adapter mixes (a graph must
/// stay right whatever adapters occupy the slots). The delta is compared, not the output: each
/// device's projection with the adapter minus its projection without it (CUDA's GEMM of several
/// rows rounds the normed input to bf16, which cancels in the difference), within `TOL` of the
/// CPU's; the residual after the add and the normed output must match the CPU's too. On CUDA
/// every eager step of 2..=128 rows (1..=128 with `QUIVER_CUDA_LORA_AHEAD=1`) must have taken
/// the norm's shrink, others not.
pub fn norms_before_projections_match_cpu(dev: Arc<dyn Device>) {
    use quiver_kernels::{DType, Epilogue, RopeTable, Weight};
    let seed = fresh_seed();
    eprintln!("norms before projections: seed {seed} (QUIVER_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let paths = vec![
        random_adapter_for(&WIDE, "full", rng.random(), 16, 32.0, &LoraModule::ALL, &|_, _| 16, serde_json::json!({}), true),
        random_adapter_for(&WIDE, "low", rng.random(), 5, 7.0, &LoraModule::ALL, &|_, _| 5, serde_json::json!({"use_rslora": true}), true),
        random_adapter_for(&WIDE, "some", rng.random(), 8, 16.0, &[LoraModule::QProj, LoraModule::VProj, LoraModule::UpProj], &|_, _| 8, serde_json::json!({}), true),
    ];
    let mut p = Pair::new(WIDE, 2, 16, "auto", dev.clone(), &paths);
    let cpu = open_device(DeviceKind::Cpu).unwrap();
    let (hd, max_pos, h, eps) = (64usize, 64usize, WIDE.hidden, 1e-5f32);
    let (heads, kv_heads) = (WIDE.q_out / hd, WIDE.kv_out / hd);
    let (tc, tg) = (rope_table(&*cpu, hd, max_pos), rope_table(&*dev, hd, max_pos));
    let cuda = matches!(dev.kind(), DeviceKind::Cuda(_));
    let ahead_count = |d: &dyn Device| -> u64 { d.stats().and_then(|s| s.rsplit(": ").next()?.parse().ok()).unwrap_or(0) };
    let two = |a: usize, i: usize| [Some(a), None, Some((a + 1) % 3)][i % 3];
    // (rows, adapter mixes, recorded shape key)
    type Round = (usize, Vec<Vec<Option<usize>>>, Option<u64>);
    let mut rounds: Vec<Round> = vec![];
    for (i, rows) in [1usize, 1, 1, 12, 12, 128, 160].into_iter().enumerate() {
        let a = i % 3;
        rounds.push((rows, vec![(0..rows).map(|r| if rows == 1 { Some(a) } else { two(a, r) }).collect()], None));
    }
    rounds.push((24, vec![vec![Some(0); 24], (0..24).map(|r| two(1, r)).collect(), (0..24).map(|r| (r == 7).then_some(2)).collect()], Some(0x0a4e_ad00)));
    let mut checked = 0;
    for (round, (rows, mixes, key)) in rounds.into_iter().enumerate() {
        let with_delta = round % 2 == 0;
        let mut st = Staging::new(&vec![1; rows], WIDE.vocab, &mut rng);
        for q in st.positions.iter_mut() {
            *q = rng.random_range(0..max_pos as u32);
        }
        for site in [LinearSite::Qkv, LinearSite::GateUp] {
            let layer = round % WIDE.num_layers;
            let (din, widths, n) = WIDE.site_dims(site);
            assert_eq!(din, h);
            let dout: usize = widths[..n].iter().sum();
            let scale = 1.0 / (din as f32).sqrt();
            let w: Vec<f32> = (0..dout * din).map(|_| bf16_value(&mut rng) * scale).collect();
            let wn: Vec<f32> = (0..h).map(|_| rng.random_range(0.5..1.5)).collect();
            // Each device's buffers, allocated once a round: a recorded step replays on them.
            struct Bufs {
                w: Weight,
                wn: Tensor,
                x: Tensor,
                d: Tensor,
                xn: Tensor,
                y: Tensor,
                /// gate_up's SiLU·mul output.
                s: Tensor,
            }
            let bufs = |d: &dyn Device| Bufs {
                w: d.load_weight(Weight::from_f32(dout, din, w.clone(), DType::Bf16)),
                wn: d.tensor_from(&wn),
                x: d.tensor_from(&vec![0.0; rows * h]),
                d: d.tensor_from(&vec![0.0; rows * h]),
                xn: d.tensor_from(&vec![0.0; rows * h]),
                y: d.tensor_from(&vec![0.0; rows * dout]),
                s: d.tensor_from(&vec![0.0; rows * dout / 2]),
            };
            let (mut bc, mut bg) = (bufs(&*cpu), bufs(&*dev));
            // As the engine does (CUDA with LoRA tails; nothing elsewhere): the site's B beside
            // the weight's rows, t̂ beside x's, the delta inside the base GEMM.
            if let Some((b, _)) = p.gpu.pool().site(layer, site) {
                dev.lora_attach_tail(&mut bg.w, b);
            }
            let tailed = p.gpu.pool().site(layer, site).is_some_and(|(b, _)| b.tail.lock().unwrap().is_some());
            for (mi, mix) in mixes.iter().enumerate() {
                let x0: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
                let d0: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
                let ckeys: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
                let gkeys: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
                let ch = p.cpu.prepare_batch(&ckeys, &st.starts, &st.logits).unwrap();
                let gh = p.gpu.prepare_batch(&gkeys, &st.starts, &st.logits).unwrap();
                dev.stage_batch(&st.ids, &st.attn(), &st.logits, &gh.staged());
                // The norm then the projection on `d` through `hook`, with the adapter's delta or
                // without it (the norm goes through the hook either way); what comes out: the
                // projection (after RoPE for qkv; for gate_up its SiLU·mul with `silu`), the
                // residual, the normed input.
                let run = |d: &dyn Device, hook: &dyn LoraHook, b: &mut Bufs, with_lora: bool, silu: bool, t: &RopeTable, key: Option<u64>| -> [Vec<f32>; 3] {
                    d.upload(&x0, &mut b.x);
                    d.upload(&d0, &mut b.d);
                    let Bufs { w, wn, x, d: dl, xn, y, s: so } = b;
                    let mut body = || {
                        hook.norm(d, layer, site, x, with_delta.then_some(&*dl), wn, eps, rows, h, xn);
                        let epi = match site {
                            LinearSite::Qkv => Epilogue::RopeQk { positions: &st.positions, n_heads: heads, n_kv_heads: kv_heads, table: t },
                            _ if silu => Epilogue::SiluMul { out: &mut *so },
                            _ => Epilogue::Plain,
                        };
                        if with_lora {
                            hook.project(d, layer, site, xn, rows, w, None, epi, y);
                        } else {
                            d.matmul_lora(xn, rows, w, None, None, epi, y);
                        }
                    };
                    match key {
                        Some(k) => d.run_step(rows, Some(k ^ with_lora as u64 ^ (site as u64) << 8 ^ (silu as u64) << 9), &mut body),
                        None => body(),
                    }
                    let out = if silu { to_host(d, so, rows * dout / 2) } else { to_host(d, y, rows * dout) };
                    [out, to_host(d, x, rows * h), to_host(d, xn, rows * h)]
                };
                let before = ahead_count(&*dev);
                let [want, want_x, want_xn] = run(&*cpu, &ch, &mut bc, true, false, &tc, None);
                let [base, _, _] = run(&*cpu, &ch, &mut bc, false, false, &tc, None);
                let [got, got_x, got_xn] = run(&*dev, &gh, &mut bg, true, false, &tg, key);
                let [gbase, _, _] = run(&*dev, &gh, &mut bg, false, false, &tg, None);
                // gate_up through SiLU·mul too (CUDA may add the delta inside it,
                // lora_epilogue.rs): against SiLU·mul of this device's own base projection plus
                // the CPU's delta, so the base GEMM's bf16 input rounding cancels as above.
                let fused = (site == LinearSite::GateUp).then(|| {
                    let [got_s, _, _] = run(&*dev, &gh, &mut bg, true, true, &tg, key);
                    let [gbase_s, _, _] = run(&*dev, &gh, &mut bg, false, true, &tg, None);
                    (got_s, gbase_s)
                });
                let ctx = format!("seed {seed} round {round} ({rows} rows, mix {mi}) layer {layer} {site:?}");
                if cuda && key.is_none() {
                    // cuda/init.rs: by default past the one-launch delta's steps (QUIVER_CUDA_LORA_ROWS_MAX,
                    // 64; 0 with QUIVER_CUDA_LORA_ROWS=0), from 2 rows with QUIVER_CUDA_LORA_AHEAD=2,
                    // from 1 with =1, never with =0.
                    let var = |k: &str| std::env::var(k).ok();
                    let rows_max = match var("QUIVER_CUDA_LORA_ROWS").as_deref() {
                        Some("0") => 0,
                        _ => var("QUIVER_CUDA_LORA_ROWS_MAX").and_then(|v| v.parse::<usize>().ok()).unwrap_or(64).min(128),
                    };
                    // The epilogue expand (default on, `0` off) takes the norm's shrink from 2 rows.
                    let epilogue = var("QUIVER_CUDA_LORA_EPILOGUE").as_deref() != Some("0");
                    let min = match var("QUIVER_CUDA_LORA_AHEAD").as_deref() {
                        Some("1") => 1,
                        Some("2") => 2,
                        Some("0") => usize::MAX,
                        _ if epilogue => 2,
                        _ => rows_max.max(1) + 1,
                    };
                    let took = ahead_count(&*dev) - before;
                    assert_eq!(took > 0, (min..=128).contains(&rows), "{ctx}: the norm computed the shrink {took} times");
                }
                for i in 0..rows * h {
                    assert!((got_x[i] - want_x[i]).abs() <= 1e-6 * want_x[i].abs().max(1.0), "{ctx}: residual {i}: {} vs {}", got_x[i], want_x[i]);
                    assert!((got_xn[i] - want_xn[i]).abs() <= 1e-5 * want_xn[i].abs().max(1.0), "{ctx}: normed {i}: {} vs {}", got_xn[i], want_xn[i]);
                }
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for (r, seq) in mix.iter().enumerate() {
                    for c in 0..dout {
                        let i = r * dout + c;
                        assert!(got[i].is_finite(), "{ctx}: output {i} is {}", got[i]);
                        let (gd, wd) = ((got[i] - gbase[i]) as f64, (want[i] - base[i]) as f64);
                        if seq.is_none() && !tailed {
                            assert_eq!(got[i], gbase[i], "{ctx}: base row {r} got a delta");
                        } else if seq.is_none() {
                            // Its GEMM runs over the tail's zeros too: f32 rounding apart.
                            assert!((got[i] - gbase[i]).abs() <= 1e-4 * gbase[i].abs().max(1.0), "{ctx}: base row {r} got a delta: {} vs {}", got[i], gbase[i]);
                        }
                        num += (gd - wd).powi(2);
                        den += wd.powi(2);
                    }
                }
                let rel = (num / den.max(1e-30)).sqrt();
                assert!(den > 0.0, "{ctx}: the adapters add nothing here");
                // Past 128 rows CUDA's shrink runs on tensor cores, which take the normed input
                // (not bf16-representable, unlike the other tests' inputs) rounded to bf16:
                // 2^-9 relative per element (measured 1.7e-3).
                // A LoRA tail's t̂ is bf16 too (CUDA, opt-in).
                let tol = if (cuda && rows > 128) || tailed { PROMPT_GEMM_TOL } else { TOL };
                assert!(rel <= tol, "{ctx}: relative error of the delta {rel:.3e} > {tol:.0e}");
                if let Some((got_s, gbase_s)) = fused {
                    let inter = dout / 2;
                    let silu_mul = |g: f32, u: f32| g / (1.0 + (-g).exp()) * u;
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for (r, seq) in mix.iter().enumerate() {
                        for c in 0..inter {
                            let (i, gi, ui) = (r * inter + c, r * dout + c, r * dout + inter + c);
                            assert!(got_s[i].is_finite(), "{ctx}: SiLU·mul output {i} is {}", got_s[i]);
                            if seq.is_none() && !tailed {
                                assert_eq!(got_s[i], gbase_s[i], "{ctx}: base row {r} got a delta through SiLU·mul");
                            } else if seq.is_none() {
                                assert!((got_s[i] - gbase_s[i]).abs() <= 1e-4 * gbase_s[i].abs().max(1.0), "{ctx}: base row {r} got a delta through SiLU·mul");
                            }
                            let plain = silu_mul(gbase[gi], gbase[ui]) as f64;
                            let want_s = silu_mul(gbase[gi] + (want[gi] - base[gi]), gbase[ui] + (want[ui] - base[ui])) as f64;
                            num += (got_s[i] as f64 - want_s).powi(2);
                            den += (want_s - plain).powi(2);
                        }
                    }
                    let rel = (num / den.max(1e-30)).sqrt();
                    assert!(rel <= tol, "{ctx}: relative error of the delta through SiLU·mul {rel:.3e} > {tol:.0e}");
                }
                checked += 1;
            }
        }
    }
    eprintln!("norms before projections (1, 12, 128, 160 rows, a recorded 24-row step under 3 mixes): {checked} matched the CPU reference");
}
