//! Every backend against `reference` on random batches: mixed ranks below R, base rows,
//! slot reuse by smaller ranks, absent modules, 2- and 3-slice expands, chunk boundaries,
//! segments of length 1 and long ones, embedding and lm_head on pruned rows.

mod common;

use common::*;
use quiver_kernels::cpu::CpuDevice;
use quiver_kernels::{DeviceKind, LoraX, Tensor};
use quiver_lora::backend::create_backend;
use quiver_lora::batch::RowGrouping;
use quiver_lora::{AdapterKey, LinearSite, LoraConfig, LoraHook, LoraManager, LoraModule, SiteRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BACKENDS: [&str; 3] = ["segmented", "chunked", "auto"];

fn run(name: &str, site: SiteRef<'_>, g: &RowGrouping, input: LoraX<'_>, y0: &[f32]) -> Vec<f32> {
    let b = create_backend(name, DeviceKind::Cpu).unwrap();
    let mut y = Tensor::cpu(y0.to_vec());
    b.apply(&CpuDevice::new(), site, g, input, &mut y);
    y.as_cpu()[..y0.len()].to_vec()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], y0: &[f32]) {
    let scale = want.iter().zip(y0).map(|(w, b)| (w - b).abs()).fold(1e-3f32, f32::max);
    let err = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-5 * scale.max(1.0), "{what}: max abs error {err} vs delta scale {scale}");
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

/// Checks all sites of the last prepared batch: every backend vs reference.
fn check_all(mgr: &LoraManager, rng: &mut StdRng, ids: &[u32], ctx: &str) -> usize {
    let info = mgr.batch_info();
    let m = info.tokens.rows();
    let mut checked = 0;
    for (what, v, is_embed, on_logits) in pool_sites(mgr) {
        let g = if on_logits { &info.logits } else { &info.tokens };
        let rows = g.rows();
        let (din, dout) = (v.buffers.shape.in_dim, v.buffers.shape.out_dim());
        let x = Tensor::cpu((0..rows * din).map(|_| rng.random_range(-1.0..1.0)).collect());
        let y0: Vec<f32> = (0..rows * dout).map(|_| rng.random_range(-1.0..1.0)).collect();
        let input = if is_embed { LoraX::TokenIds(ids) } else { LoraX::Dense(&x) };
        let want = run("reference", v, g, input, &y0);
        let serial = pool(1).install(|| run("chunked", v, g, input, &y0));
        for b in BACKENDS {
            for threads in [1, 2, 3] {
                let got = pool(threads).install(|| run(b, v, g, input, &y0));
                assert_close(&format!("{ctx}: {b} {what} (m={m}, {threads} threads)"), &got, &want, &y0);
                // Bit-identical across backends and thread splits: `auto` may switch backend
                // between steps and a row's output must not depend on its batch.
                assert!(got == serial, "{ctx}: {b} {what} (m={m}, {threads} threads) differs in the last bits from serial chunked");
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn backends_match_reference_on_random_batches() {
    let seed = fresh_seed();
    eprintln!("seed {seed} (QUIVER_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let module_sets: [&[LoraModule]; 5] = [
        &LoraModule::ALL,
        &[LoraModule::QProj, LoraModule::VProj],
        &[LoraModule::KProj, LoraModule::UpProj, LoraModule::LmHead],
        &[LoraModule::GateProj, LoraModule::DownProj, LoraModule::OProj, LoraModule::EmbedTokens],
        &[LoraModule::QProj],
    ];
    for round in 0..4 {
        let rmax = [4usize, 8, 16][round % 3];
        let slots = rng.random_range(2..=5);
        let cfg = LoraConfig {
            max_loras_per_batch: slots,
            max_lora_rank: rmax,
            max_loaded_loras: 16,
            target_modules: LoraModule::ALL.to_vec(),
            backend: "reference".into(),
            ..Default::default()
        };
        let mut mgr = LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
        // More adapters than slots, ranks 1..=R (several below R), varied modules.
        let mut keys: Vec<AdapterKey> = Vec::new();
        for i in 0..slots + 3 {
            let r = if i == 0 { rmax } else { rng.random_range(1..=rmax) };
            let mods = module_sets[rng.random_range(0..module_sets.len())];
            let dir = simple_adapter("rand", rng.random(), r, mods);
            keys.push(mgr.load_adapter(&format!("a{i}"), &dir).unwrap());
        }
        let mut checked = 0;
        for step in 0..8 {
            let nseq = rng.random_range(1..=10);
            let lens = [1u32, 1, 1, 2, 7, 15, 16, 17, 31, 33];
            let mut starts = vec![0u32];
            let mut seqs = Vec::new();
            // Pick at most `slots` distinct adapters for this batch.
            let mut pool: Vec<AdapterKey> = keys.clone();
            for i in (1..pool.len()).rev() {
                pool.swap(i, rng.random_range(0..=i));
            }
            pool.truncate(slots);
            let decode = step % 2 == 0;
            for _ in 0..nseq {
                let len = if decode { 1 } else { lens[rng.random_range(0..lens.len())] };
                starts.push(starts.last().unwrap() + len);
                seqs.push(if rng.random_bool(0.25) { None } else { Some(pool[rng.random_range(0..pool.len())]) });
            }
            let m = *starts.last().unwrap() as usize;
            let logits: Vec<u32> = starts[1..].iter().map(|s| s - 1).collect();
            let ids: Vec<u32> = (0..m).map(|_| rng.random_range(0..DIMS.vocab as u32)).collect();
            mgr.prepare_batch(&seqs, &starts, &logits).unwrap();
            checked += check_all(&mgr, &mut rng, &ids, &format!("seed {seed} round {round} step {step}"));
        }
        assert!(checked > 0);
    }
}

#[test]
fn chunk_boundaries_and_segment_lengths() {
    let seed = fresh_seed();
    eprintln!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let cfg = LoraConfig { max_loras_per_batch: 3, max_lora_rank: 8, target_modules: LoraModule::ALL.to_vec(), ..Default::default() };
    let mut mgr = LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let a = mgr.load_adapter("a", simple_adapter("cb", rng.random(), 8, &LoraModule::ALL)).unwrap();
    let b = mgr.load_adapter("b", simple_adapter("cb", rng.random(), 3, &LoraModule::ALL)).unwrap();
    for rows in [1u32, 15, 16, 17, 31, 32, 33, 48, 300] {
        // One long segment of `a`.
        mgr.prepare_batch(&[Some(a)], &[0, rows], &[rows - 1]).unwrap();
        let ids: Vec<u32> = (0..rows).map(|i| i % DIMS.vocab as u32).collect();
        check_all(&mgr, &mut rng, &ids, &format!("single segment of {rows}"));
        // Decode: `rows` sequences of one row, adapters interleaved with base rows.
        let seqs: Vec<Option<AdapterKey>> = (0..rows).map(|i| [Some(a), Some(b), None][i as usize % 3]).collect();
        let starts: Vec<u32> = (0..=rows).collect();
        let logits: Vec<u32> = (0..rows).collect();
        mgr.prepare_batch(&seqs, &starts, &logits).unwrap();
        check_all(&mgr, &mut rng, &ids, &format!("interleaved decode of {rows}"));
    }
}

/// A rank-2 adapter lacking most modules reuses the only slot after a rank-8 adapter with all
/// modules: its output must equal a fresh pool holding only it (no stale tail, absent modules
/// zero).
#[test]
fn slot_reuse_by_smaller_rank_leaks_nothing() {
    let seed = fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let big = simple_adapter("big", rng.random(), 8, &LoraModule::ALL);
    let small = simple_adapter("small", rng.random(), 2, &[LoraModule::KProj, LoraModule::UpProj]);
    let cfg = || LoraConfig { max_loras_per_batch: 1, max_lora_rank: 8, max_loaded_loras: 2, target_modules: LoraModule::ALL.to_vec(), backend: "reference".into(), ..Default::default() };
    let mut reused = LoraManager::new(DIMS, cfg(), quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let kb = reused.load_adapter("big", &big).unwrap();
    let ks = reused.load_adapter("small", &small).unwrap();
    reused.prepare_batch(&[Some(kb)], &[0, 5], &[4]).unwrap();
    let mut fresh = LoraManager::new(DIMS, cfg(), quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let kf = fresh.load_adapter("small", &small).unwrap();
    let rows = 5usize;
    let x_q: Vec<f32> = (0..rows * 64).map(|_| rng.random_range(-1.0..1.0)).collect();
    let ids: Vec<u32> = (0..rows as u32).collect();
    for backend in ["reference", "segmented", "chunked", "auto"] {
        let mut outs = Vec::new();
        for (mgr, key) in [(&mut reused, ks), (&mut fresh, kf)] {
            let hook = mgr.prepare_batch(&[Some(key)], &[0, rows as u32], &[4]).unwrap();
            let _ = hook;
            let info = mgr.batch_info();
            let b = create_backend(backend, DeviceKind::Cpu).unwrap();
            let mut all = Vec::new();
            for (_, v, emb, on_logits) in pool_sites(mgr) {
                let g = if on_logits { &info.logits } else { &info.tokens };
                let (din, dout) = (v.buffers.shape.in_dim, v.buffers.shape.out_dim());
                let mut y = Tensor::zeros_cpu(g.rows() * dout);
                let x = &x_q[..g.rows() * din.min(64)];
                let xfull = Tensor::cpu((0..g.rows() * din).map(|i| x[i % x.len()]).collect());
                let input = if emb { LoraX::TokenIds(&ids) } else { LoraX::Dense(&xfull) };
                b.apply(&CpuDevice::new(), v, g, input, &mut y);
                all.push(y.as_cpu()[..g.rows() * dout].to_vec());
            }
            outs.push(all);
        }
        assert_eq!(outs[0], outs[1], "{backend}: reused slot differs from a fresh one (seed {seed})");
        // Sites the small adapter lacks (q, v, o, gate, down, embed, lm_head) add nothing.
        let o_site = &outs[0][LinearSite::O.index()];
        assert!(o_site.iter().all(|&v| v == 0.0), "{backend}: o_proj delta leaked");
        let qkv = &outs[0][LinearSite::Qkv.index()];
        let out = DIMS.q_out + 2 * DIMS.kv_out;
        for r in 0..rows {
            let row = &qkv[r * out..(r + 1) * out];
            assert!(row[..DIMS.q_out].iter().all(|&v| v == 0.0), "{backend}: q slice leaked");
            assert!(row[DIMS.q_out + DIMS.kv_out..].iter().all(|&v| v == 0.0), "{backend}: v slice leaked");
            assert!(row[DIMS.q_out..DIMS.q_out + DIMS.kv_out].iter().any(|&v| v != 0.0), "{backend}: k slice missing");
        }
    }
}

/// The hook the model calls: base rows untouched, adapter rows changed; NoLora semantics.
#[test]
fn batch_hook_touches_only_adapter_rows() {
    let mut rng = StdRng::seed_from_u64(fresh_seed());
    let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 4, target_modules: LoraModule::ALL.to_vec(), ..Default::default() };
    let mut mgr = LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let a = mgr.load_adapter("a", simple_adapter("hook", rng.random(), 4, &LoraModule::ALL)).unwrap();
    let hook = mgr.prepare_batch(&[None, Some(a), None], &[0, 2, 5, 6], &[1, 4, 5]).unwrap();
    assert!(hook.is_active());
    let out = DIMS.q_out + 2 * DIMS.kv_out;
    let x = quiver_kernels::Tensor::cpu((0..6 * DIMS.hidden).map(|i| (i as f32 * 0.37).sin()).collect());
    let mut y = quiver_kernels::Tensor::zeros_cpu(6 * out);
    hook.linear(&quiver_kernels::cpu::CpuDevice::new(), 1, LinearSite::Qkv, &x, 6, &mut y);
    let y = y.as_cpu();
    for r in 0..6 {
        let touched = y[r * out..(r + 1) * out].iter().any(|&v| v != 0.0);
        assert_eq!(touched, (2..5).contains(&r), "row {r}");
    }
    let x = quiver_kernels::Tensor::cpu((0..3 * DIMS.hidden).map(|i| (i as f32 * 0.11).cos()).collect());
    let mut logits = quiver_kernels::Tensor::zeros_cpu(3 * DIMS.vocab);
    hook.lm_head(&quiver_kernels::cpu::CpuDevice::new(), &x, &[1, 4, 5], &mut logits);
    let l = logits.as_cpu();
    assert!(l[..DIMS.vocab].iter().all(|&v| v == 0.0));
    assert!(l[DIMS.vocab..2 * DIMS.vocab].iter().any(|&v| v != 0.0));
    assert!(l[2 * DIMS.vocab..].iter().all(|&v| v == 0.0));
    let hook = mgr.prepare_batch(&[None], &[0, 3], &[2]).unwrap();
    assert!(!hook.is_active());
}
