//! The pool's expert sites: sized by experts × rank and capped with an error that says what to
//! lower; and the experts' delta over a layer's routed positions, each position getting its
//! expert's delta in its row's adapter (base rows nothing), alike under every policy and equal to
//! a per-position loop over the adapters' own weights.

use quiver_kernels::{open_device, DeviceKind, MoeRouting, RouterSpec};
use quiver_lora::{ExpertSite, LoraAdapter, LoraConfig, LoraHook, LoraManager, LoraModelDims, LoraModule, MoeLoraDims};

fn moe(num_layers: usize, hidden: usize, experts: usize, inter: usize) -> LoraModelDims {
    let moe = MoeLoraDims { num_experts: experts, expert_intermediate: inter, shared_intermediate: 0, mixtral_names: false, moe_layers: u128::MAX };
    LoraModelDims { num_layers, hidden, q_out: hidden, kv_out: hidden / 2, intermediate: 3 * hidden, vocab: 50, moe: Some(moe) }
}

#[test]
fn expert_sites_past_the_cap_are_refused_saying_what_to_lower() {
    // Qwen3-30B-A3B: 48 layers of 128 experts of 768; 4 slots of rank 16 is about 12.4 GiB.
    let cfg = LoraConfig { max_loras_per_batch: 4, max_lora_rank: 16, target_modules: LoraModule::MOE.to_vec(), ..Default::default() };
    let err = match LoraManager::new(moe(48, 2048, 128, 768), cfg, open_device(DeviceKind::Cpu).unwrap()) {
        Ok(_) => panic!("a 12 GiB expert pool was allocated"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("GiB") && err.contains("128 experts") && err.contains("max_lora_rank"), "{err}");
}

#[test]
fn expert_deltas_reach_only_routed_rows_alike_under_every_policy() {
    let (hidden, e, inter, k) = (16, 4, 8, 2);
    let dims = moe(1, hidden, e, inter);
    let dev = open_device(DeviceKind::Cpu).unwrap();
    let ads = [LoraAdapter::synthetic("a", &dims, &LoraModule::MOE[..3], 4, 8.0, 0.3, 1).unwrap(), LoraAdapter::synthetic("b", &dims, &LoraModule::MOE[..3], 2, 2.0, 0.3, 2).unwrap()];
    // Rows: two of `a` (a prefill segment), one base, two of `b`.
    let (seq_ads, starts, m) = ([Some(0), None, Some(1)], [0u32, 2, 3, 5], 5);
    let mut s = 7u64;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    };
    let mut route = MoeRouting::host(m, RouterSpec { num_experts: e, top_k: k, renormalize: true });
    dev.moe_route(&dev.tensor_from(&rnd(m * e)), m, &mut route);
    let h = route.as_host().unwrap();
    let x = rnd(m * k * hidden);
    let mut outs = Vec::new();
    for backend in ["segmented", "chunked", "auto"] {
        let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 4, target_modules: LoraModule::MOE[..3].to_vec(), backend: backend.into(), ..Default::default() };
        let mut mgr = LoraManager::new(dims, cfg, dev.clone()).unwrap();
        let keys: Vec<_> = ads.iter().map(|a| mgr.install_adapter(&a.name, a.clone(), false).unwrap()).collect();
        let seqs: Vec<_> = seq_ads.iter().map(|a| a.map(|i: usize| keys[i])).collect();
        let hook = mgr.prepare_batch(&seqs, &starts, &[4]).unwrap();
        let mut y = dev.tensor_from(&vec![0.0; m * k * 2 * inter]);
        hook.experts(&*dev, 0, ExpertSite::GateUp, &route, &dev.tensor_from(&x), &mut y);
        let mut host = vec![0.0; m * k * 2 * inter];
        dev.to_host(&y, host.len(), &mut host);
        outs.push(host);
    }
    assert!(outs.iter().all(|o| o == &outs[0]), "policies disagree");
    // Position p holds row row_of[p]'s input for the expert whose range holds p.
    let row_ad = |r: usize| if r < 2 { Some(0) } else if r >= 3 { Some(1) } else { None };
    for x_e in 0..e {
        for p in h.offsets[x_e] as usize..h.offsets[x_e + 1] as usize {
            let xp = &x[p * hidden..(p + 1) * hidden];
            for (j, m_j) in [LoraModule::ExpertGateProj, LoraModule::ExpertUpProj].into_iter().enumerate() {
                for o in 0..inter {
                    let want = row_ad(h.row_of[p] as usize).map_or(0.0, |i| {
                        let w = ads[i].expert(0, x_e, m_j).unwrap();
                        let t: Vec<f64> = (0..w.rank).map(|q| (0..hidden).map(|c| w.a[q * hidden + c] as f64 * xp[c] as f64).sum()).collect();
                        w.scaling as f64 * (0..w.rank).map(|q| w.b[o * w.rank + q] as f64 * t[q]).sum::<f64>()
                    });
                    let got = outs[0][p * 2 * inter + j * inter + o] as f64;
                    assert!((got - want).abs() < 1e-5, "position {p} (expert {x_e}) column {}: {got} vs {want}", j * inter + o);
                }
            }
        }
    }
}
