//! LoRA on MoE experts (`Device::lora_experts`, through the hook as the model calls it) on a
//! device with its own routing against the CPU device running the reference backend, on random
//! routings: adapters of mixed ranks each on a random subset of the experts (positions routed to
//! an expert an adapter lacks get nothing), some with gate_proj only, base rows interleaved
//! (which must stay bit for bit as they were), decode and prefill batches, widths that take the
//! tensor-core shrink, the vector paths and the scalar ones; then one decode shape run under
//! several routings and adapter mixes as a recorded step (CUDA: a graph replayed).
//!
//! The device groups positions in its own order within an expert, so rows are compared by
//! routed pair: pair i = r·k + j sits at `pos_of[i]` on each device.

use super::*;
use quiver_kernels::moe::HostRouting;
use quiver_kernels::{MoeRouting, RouterSpec};
use quiver_lora::{ExpertSite, MoeLoraDims};

/// Reads a device's routing back (the order of positions within an expert is its own).
pub type ReadRouting<'a> = &'a dyn Fn(&MoeRouting) -> HostRouting;

fn moe_dims(experts: usize, inter: usize) -> LoraModelDims {
    let moe = MoeLoraDims { num_experts: experts, expert_intermediate: inter, shared_intermediate: 0, mixtral_names: false, moe_layers: u128::MAX };
    LoraModelDims { moe: Some(moe), ..WIDE }
}

/// A PEFT adapter with per-expert modules `modules` on `experts` of every layer, rank `r`
/// (`rank_pattern` gives the first expert rank `r0`), bf16-representable values.
fn expert_adapter(dims: &LoraModelDims, rng: &mut StdRng, r: usize, r0: usize, experts: &[usize], modules: &[LoraModule]) -> std::path::PathBuf {
    let mut tensors = Vec::new();
    let mut targets = Vec::new();
    for (n, &e) in experts.iter().enumerate() {
        let rank = if n == 0 { r0 } else { r };
        for &m in modules {
            targets.push(format!("experts.{e}.{}", m.dense_part().name()));
            for l in 0..dims.num_layers {
                let path = m.expert_path(l, e, false, "model.");
                let (din, dout) = dims.module_dims(m);
                tensors.push(T { name: format!("base_model.model.{path}.lora_A.weight"), shape: vec![rank, din], data: (0..rank * din).map(|_| bf16_value(rng)).collect() });
                tensors.push(T { name: format!("base_model.model.{path}.lora_B.weight"), shape: vec![dout, rank], data: (0..dout * rank).map(|_| bf16_value(rng)).collect() });
            }
        }
    }
    let pattern: serde_json::Map<String, serde_json::Value> = modules.iter().map(|m| (format!("experts.{}.{}", experts[0], m.dense_part().name()), r0.into())).collect();
    let cfg = serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": 2.0 * r as f32, "target_modules": targets, "rank_pattern": pattern, "bias": "none"});
    let dir = temp_dir("experts");
    write_adapter(&dir, &cfg, &tensors);
    dir
}

/// Managers on the CPU (reference backend) and on `dev` holding the same expert adapters, one
/// slot each.
struct ExpertPair {
    cpu: LoraManager,
    gpu: LoraManager,
    keys: Vec<(AdapterKey, AdapterKey)>,
}

impl ExpertPair {
    fn new(dims: LoraModelDims, rmax: usize, dev: &Arc<dyn Device>, paths: &[std::path::PathBuf]) -> ExpertPair {
        let cfg = |backend: &str| LoraConfig {
            max_loras_per_batch: paths.len(),
            max_lora_rank: rmax,
            max_loaded_loras: paths.len(),
            target_modules: LoraModule::MOE[..3].to_vec(),
            backend: backend.into(),
            max_batch_tokens: 256,
            ..Default::default()
        };
        let mut cpu = LoraManager::new(dims, cfg("reference"), open_device(DeviceKind::Cpu).unwrap()).unwrap();
        let mut gpu = LoraManager::new(dims, cfg("auto"), dev.clone()).unwrap();
        let keys = paths.iter().enumerate().map(|(i, p)| (cpu.load_adapter(&format!("a{i}"), p).unwrap(), gpu.load_adapter(&format!("a{i}"), p).unwrap())).collect();
        ExpertPair { cpu, gpu, keys }
    }
}

/// The token rows' slots of the batch `keys` and the ranks of every expert-table entry
/// (`[layer·2 + site][slot·E + expert]`), as `prepare_batch` assigns them (the hook it returns
/// holds the manager, so they are read from a first preparation; a second one gives the same
/// slots to the same resident adapters).
fn slots_and_ranks(m: &mut LoraManager, keys: &[Option<AdapterKey>], st: &Staging) -> (Vec<i32>, Vec<Vec<u32>>) {
    m.prepare_batch(keys, &st.starts, &st.logits).unwrap();
    let t = m.pool().expert_table();
    (m.batch_info().tokens.row_slot.clone(), (0..t.entries).map(|en| t.ranks_at(en).to_vec()).collect())
}

/// Random router logits (continuous: no ties, so both devices choose the same experts).
fn logits(rng: &mut StdRng, rows: usize, experts: usize) -> Vec<f32> {
    (0..rows * experts).map(|_| rng.random_range(-3.0..3.0)).collect()
}

/// `per_pair[i]` (rows of `w`) placed at `pos_of[i]`.
fn by_position(per_pair: &[f32], pos_of: &[u32], w: usize) -> Vec<f32> {
    let mut out = vec![0.0; per_pair.len()];
    for (i, &p) in pos_of.iter().enumerate() {
        out[p as usize * w..(p as usize + 1) * w].copy_from_slice(&per_pair[i * w..(i + 1) * w]);
    }
    out
}

/// One site's outputs on both devices for the routing `(cpu, dev)`: the delta of every pair
/// with an adapter within `TOL` of the reference (relative, over the site), every other pair
/// exactly its input. Returns the pairs that had a delta.
#[allow(clippy::too_many_arguments)]
fn compare(ctx: &str, want: &[f32], got: &[f32], y0: &[f32], rc: &HostRouting, rg: &HostRouting, row_slot: &[i32], ranks: &[u32], e: usize, k: usize, w: usize) -> usize {
    let (mut num, mut den, mut with) = (0.0f64, 0.0f64, 0);
    for i in 0..row_slot.len() * k {
        let (pc, pg) = (rc.pos_of[i] as usize, rg.pos_of[i] as usize);
        let slot = row_slot[i / k];
        let adapter = slot >= 0 && ranks[slot as usize * e + rc.expert[i] as usize] > 0;
        with += adapter as usize;
        for c in 0..w {
            let (a, b, y) = (want[pc * w + c], got[pg * w + c], y0[i * w + c]);
            assert!(b.is_finite(), "{ctx}: pair {i} column {c} is {b}");
            if adapter {
                num += ((b - a) as f64).powi(2);
                den += ((a - y) as f64).powi(2);
            } else {
                assert_eq!(b, y, "{ctx}: pair {i} (row {} of slot {slot}, expert {}: no delta) changed at column {c}", i / k, rc.expert[i]);
            }
        }
    }
    let rel = (num / den.max(1e-30)).sqrt();
    assert!(with == 0 || den > 0.0, "{ctx}: pairs with adapters but no delta on the CPU");
    assert!(rel <= TOL, "{ctx}: relative error of the experts' delta {rel:.3e} > {TOL:.0e} over {with} pairs");
    with
}

/// Routes `lg` on both devices (`route_c` on the CPU, `route_g` on `dev`) and checks that they
/// chose the same experts; returns both routings as the host sees them.
fn route_both(cpu: &dyn Device, dev: &dyn Device, read: ReadRouting<'_>, lg: &[f32], rows: usize, route_c: &mut MoeRouting, route_g: &mut MoeRouting, lg_g: &mut Tensor) -> (HostRouting, HostRouting) {
    cpu.moe_route(&Tensor::cpu(lg.to_vec()), rows, route_c);
    dev.upload(lg, lg_g);
    dev.moe_route(lg_g, rows, route_g);
    let h = route_c.as_host().unwrap();
    let n = rows * route_c.spec.top_k;
    let rc = HostRouting { expert: h.expert[..n].to_vec(), weight: h.weight[..n].to_vec(), offsets: h.offsets.clone(), row_of: h.row_of[..n].to_vec(), pos_of: h.pos_of[..n].to_vec() };
    let rg = read(route_g);
    assert_eq!(rg.expert, rc.expert, "the devices routed the rows to different experts");
    (rc, rg)
}

/// Random batches (decode and prefill, mixed adapters and base rows) on random routings.
pub fn expert_lora_matches_cpu_reference(dev: Arc<dyn Device>, read: ReadRouting<'_>, tag: &str) {
    let seed = fresh_seed();
    eprintln!("{tag} expert lora: seed {seed} (QUIVER_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let cpu = open_device(DeviceKind::Cpu).unwrap();
    // (experts, expert width, top-k, pool rank): widths that are multiples of 64 (the
    // tensor-core shrink from 64 positions), of 8 only (vector paths), and odd (scalar shrink
    // of down, scalar expand of gate_up).
    for (round, &(e, inter, k, rmax)) in [(8usize, 64usize, 2usize, 8usize), (16, 96, 4, 16), (60, 37, 8, 16), (8, 128, 8, 32)].iter().enumerate() {
        let dims = moe_dims(e, inter);
        let n_ad = rng.random_range(2..=4);
        let paths: Vec<_> = (0..n_ad)
            .map(|a| {
                let r = if a == 0 { rmax } else { rng.random_range(1..=rmax) };
                let mut experts: Vec<usize> = (0..e).filter(|_| rng.random_bool(0.7)).collect();
                if experts.is_empty() {
                    experts.push(rng.random_range(0..e));
                }
                let mods: &[LoraModule] = if a == 1 { &LoraModule::MOE[..1] } else { &LoraModule::MOE[..3] };
                let r0 = rng.random_range(1..=r);
                expert_adapter(&dims, &mut rng, r, r0, &experts, mods)
            })
            .collect();
        let mut p = ExpertPair::new(dims, rmax, &dev, &paths);
        let spec = RouterSpec { num_experts: e, top_k: k, renormalize: round % 2 == 0 };
        let mut route_c = cpu.alloc_routing(256, spec);
        let mut route_g = dev.alloc_routing(256, spec);
        let mut lg_g = dev.alloc(256 * e);
        // Decode rows (one per sequence), then prefill segments with base rows between.
        let batches: [&[u32]; 4] = [&[1; 24], &[1; 80], &[37, 5, 120, 1, 9], &[200, 1, 1, 30]];
        let mut pairs = 0;
        for (b, lens) in batches.iter().enumerate() {
            let st = Staging::new(lens, dims.vocab, &mut rng);
            let rows = *st.starts.last().unwrap() as usize;
            let seqs: Vec<Option<usize>> = (0..lens.len()).map(|s| (s % (n_ad + 1)).checked_sub(1).filter(|_| rng.random_bool(0.85))).collect();
            let ck: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
            let gk: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
            let (rc, rg) = route_both(&*cpu, &*dev, read, &logits(&mut rng, rows, e), rows, &mut route_c, &mut route_g, &mut lg_g);
            let (row_slot, ranks) = slots_and_ranks(&mut p.cpu, &ck, &st);
            let hc = p.cpu.prepare_batch(&ck, &st.starts, &st.logits).unwrap();
            let hg = p.gpu.prepare_batch(&gk, &st.starts, &st.logits).unwrap();
            dev.stage_batch(&st.ids, &st.attn(), &st.logits, &hg.staged());
            for layer in 0..dims.num_layers {
                for site in [ExpertSite::GateUp, ExpertSite::Down] {
                    let (din, w, n) = dims.expert_site_dims(site, false);
                    let out: usize = w[..n].iter().sum();
                    let n_pairs = rows * k;
                    let x: Vec<f32> = (0..n_pairs * din).map(|_| bf16_value(&mut rng)).collect();
                    let y0: Vec<f32> = (0..n_pairs * out).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut yc = Tensor::cpu(by_position(&y0, &rc.pos_of, out));
                    hc.experts(&*cpu, layer, site, &route_c, &Tensor::cpu(by_position(&x, &rc.pos_of, din)), &mut yc);
                    let mut yg = dev.tensor_from(&by_position(&y0, &rg.pos_of, out));
                    hg.experts(&*dev, layer, site, &route_g, &dev.tensor_from(&by_position(&x, &rg.pos_of, din)), &mut yg);
                    let ctx = format!("{tag} round {round} ({e} experts of {inter}, top-{k}) batch {b} layer {layer} {site:?}");
                    pairs += compare(&ctx, &yc.as_cpu()[..n_pairs * out], &to_host(&*dev, &yg, n_pairs * out), &y0, &rc, &rg, &row_slot, &ranks[2 * layer + site.index()], e, k, out);
                }
            }
        }
        eprintln!("{tag} expert lora round {round}: {e} experts of {inter}, top-{k}, {n_ad} adapters: {pairs} pairs with a delta checked");
        assert!(pairs > 0, "round {round} checked no pair with a delta");
    }
}

/// One decode shape (40 one-row sequences, top-4 of 16) as a recorded step under several
/// routings and adapter mixes: the first records (CUDA: a graph of the grouping, shrink and
/// expand), the others replay it with new routing and slots in the same buffers.
pub fn recorded_expert_steps_follow_routing_and_adapters(dev: Arc<dyn Device>, read: ReadRouting<'_>) {
    let seed = fresh_seed();
    eprintln!("recorded expert steps: seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let cpu = open_device(DeviceKind::Cpu).unwrap();
    let (e, inter, k) = (16usize, 64usize, 4usize);
    let dims = moe_dims(e, inter);
    let paths: Vec<_> = (0..3)
        .map(|a| {
            let experts: Vec<usize> = (0..e).filter(|x| (x + a) % 3 != 0).collect();
            expert_adapter(&dims, &mut rng, [16, 4, 9][a], [3, 4, 16][a], &experts, &LoraModule::MOE[..3])
        })
        .collect();
    let mut p = ExpertPair::new(dims, 16, &dev, &paths);
    let rows = 40usize;
    let st = Staging::new(&vec![1; rows], dims.vocab, &mut rng);
    let spec = RouterSpec { num_experts: e, top_k: k, renormalize: true };
    let (mut route_c, mut route_g) = (cpu.alloc_routing(rows, spec), dev.alloc_routing(rows, spec));
    let mut lg_g = dev.alloc(rows * e);
    let site = ExpertSite::GateUp;
    let (din, out) = (dims.hidden, 2 * inter);
    let n_pairs = rows * k;
    let (mut xg, mut yg) = (dev.alloc(n_pairs * din), dev.alloc(n_pairs * out));
    let mixes: Vec<Vec<Option<usize>>> = vec![
        (0..rows).map(|i| [Some(0), Some(1), Some(2), None][i % 4]).collect(),
        vec![Some(1); rows],
        (0..rows).map(|i| (i == 11).then_some(2)).collect(),
        (0..rows).map(|i| [Some(2), None][i % 2]).collect(),
        (0..rows).map(|i| Some([0, 2][i % 2])).collect(),
    ];
    for (n, mix) in mixes.iter().enumerate() {
        let ck: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].0)).collect();
        let gk: Vec<Option<AdapterKey>> = mix.iter().map(|s| s.map(|i| p.keys[i].1)).collect();
        let (rc, rg) = route_both(&*cpu, &*dev, read, &logits(&mut rng, rows, e), rows, &mut route_c, &mut route_g, &mut lg_g);
        let x: Vec<f32> = (0..n_pairs * din).map(|_| bf16_value(&mut rng)).collect();
        let y0: Vec<f32> = (0..n_pairs * out).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (row_slot, ranks) = slots_and_ranks(&mut p.cpu, &ck, &st);
        let hc = p.cpu.prepare_batch(&ck, &st.starts, &st.logits).unwrap();
        let mut yc = Tensor::cpu(by_position(&y0, &rc.pos_of, out));
        hc.experts(&*cpu, 1, site, &route_c, &Tensor::cpu(by_position(&x, &rc.pos_of, din)), &mut yc);
        let hg = p.gpu.prepare_batch(&gk, &st.starts, &st.logits).unwrap();
        dev.upload(&by_position(&x, &rg.pos_of, din), &mut xg);
        dev.upload(&by_position(&y0, &rg.pos_of, out), &mut yg);
        dev.stage_batch(&st.ids, &st.attn(), &st.logits, &hg.staged());
        // Every mix has adapter rows: one key, mix 0 records, the others replay.
        // One key whatever the mix (the expert launches do not depend on the grouping the
        // dense sites' key tells apart): mix 0 records, the others replay it.
        dev.run_step(rows, Some(0xe4e7), &mut || hg.experts(&*dev, 1, site, &route_g, &xg, &mut yg));
        let with = compare(&format!("recorded expert step, mix {n}"), &yc.as_cpu()[..n_pairs * out], &to_host(&*dev, &yg, n_pairs * out), &y0, &rc, &rg, &row_slot, &ranks[2 + site.index()], e, k, out);
        eprintln!("recorded expert step, mix {n}: {with} pairs with a delta within {TOL:.0e}");
    }
    if let Some(s) = dev.stats() {
        eprintln!("{s}");
    }
}
