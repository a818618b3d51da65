//! The pool's image path (an adapter converted once into the pool's layout, activation copies
//! from it; what CUDA does with page-locked bf16) on a CPU device that makes f32 images: the
//! shared device-op checks against the reference backend, and pools filled through images bit
//! for bit equal to pools filled directly, over every kind of site (dense, shared expert,
//! per-expert slots, embedding, LM head), slot reuse by a smaller rank included.

mod common;
mod device_lora;

use quiver_kernels::cpu::CpuDevice;
use quiver_kernels::{Device, LoraSiteBuffers};
use quiver_lora::{AdapterId, AdapterKey, EvictionPolicy, ExpertSite, LinearSite, LoraAdapter, LoraMemoryPool, LoraModelDims, LoraModule, MoeLoraDims};
use std::sync::Arc;

fn imaging() -> Arc<dyn Device> {
    Arc::new(CpuDevice::with_lora_images())
}

#[test]
fn image_path_matches_the_reference_on_random_batches() {
    device_lora::lora_matches_cpu_reference_on_random_batches(imaging(), "cpu images");
}

#[test]
fn image_path_slot_reuse_by_smaller_rank_leaks_nothing() {
    device_lora::slot_reuse_by_smaller_rank_leaks_nothing(imaging());
}

#[test]
fn image_path_projections_with_epilogues_match_cpu() {
    device_lora::projections_with_epilogues_match_cpu(imaging());
}

#[test]
fn image_path_norms_before_projections_match_cpu() {
    device_lora::norms_before_projections_match_cpu(imaging());
}

/// Every slot's bytes and the rank / scaling tables of two pools.
fn contents(p: &LoraMemoryPool, dims: &LoraModelDims) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut add = |b: Option<(&LoraSiteBuffers, usize)>| {
        if let Some((b, _)) = b {
            out.push(b.a.host().to_vec());
            out.push(b.b.host().to_vec());
        }
    };
    for l in 0..dims.num_layers {
        for s in LinearSite::ALL {
            add(p.site(l, s));
        }
        for s in ExpertSite::ALL {
            add(p.expert_site(l, s));
            add(p.shared_site(l, s));
        }
    }
    add(p.embedding());
    add(p.lm_head());
    for t in [p.table(), p.expert_table()] {
        out.push(t.ranks.iter().map(|&r| r as f32).collect());
        out.push(t.scalings.clone());
    }
    out
}

#[test]
fn pools_filled_through_images_equal_pools_filled_directly() {
    let moe = MoeLoraDims { num_experts: 4, expert_intermediate: 24, shared_intermediate: 40, mixtral_names: false, moe_layers: 0b10 };
    let dims = LoraModelDims { num_layers: 2, hidden: 32, q_out: 32, kv_out: 16, intermediate: 48, vocab: 60, moe: Some(moe) };
    let mods: Vec<LoraModule> = LoraModule::ALL.iter().chain(&LoraModule::MOE).copied().collect();
    let big = LoraAdapter::synthetic("big", &dims, &mods, 8, 16.0, 0.3, 1).unwrap();
    let small = LoraAdapter::synthetic("small", &dims, &[LoraModule::KProj, LoraModule::ExpertUpProj, LoraModule::SharedDownProj, LoraModule::LmHead], 3, 3.0, 0.3, 2).unwrap();
    let pool = |dev: Arc<dyn Device>| LoraMemoryPool::new(dev, dims, 2, 8, &mods, EvictionPolicy::Lru).unwrap();
    let (mut direct, mut imaged) = (pool(Arc::new(CpuDevice::new())), pool(imaging()));
    let key = |i: u32| AdapterKey { id: AdapterId(i), version: i as u64 };
    // Both slots, then the big adapter's slot rewritten by the small one (its image made at
    // the first load, reused at the second).
    for (slot, a, k) in [(0, &big, 1), (1, &small, 2), (0, &small, 3)] {
        for p in [&mut direct, &mut imaged] {
            if p.owner(slot).is_some() {
                p.free_slot(slot);
            }
            p.load(slot, key(k), a).unwrap();
        }
        assert_eq!(contents(&direct, &dims), contents(&imaged, &dims), "after loading {} into slot {slot}", a.name);
    }
    assert!(contents(&direct, &dims).iter().any(|v| v.iter().any(|&x| x != 0.0)), "the pools hold nothing: the comparison would be empty");
}

/// A tensor-parallel group's pools (two ranks on one imaging device, as the CPU group shares
/// its device): each rank's cut of an adapter has its own image, made once by the joined maker
/// (what the engine's loader thread holds) and kept across the other rank's activations, and
/// every rank's slots equal a pool of the same cut filled directly.
#[test]
fn every_tensor_parallel_rank_keeps_its_own_image() {
    use quiver_lora::shard::TpShard;
    let dims = LoraModelDims { num_layers: 2, hidden: 32, q_out: 32, kv_out: 16, intermediate: 48, vocab: 60, moe: None };
    let mods = LoraModule::ALL.to_vec();
    let shard = |r: usize| TpShard { rank: r, ranks: 2, q: r * 16..(r + 1) * 16, kv: r * 8..(r + 1) * 8, inter: r * 24..(r + 1) * 24, vocab: r * 30..(r + 1) * 30 };
    let imager = imaging();
    let pool = |dev: Arc<dyn Device>, r: usize| LoraMemoryPool::new_shard(dev, dims, &shard(r), 2, 8, &mods, EvictionPolicy::Lru).unwrap();
    let mut direct: Vec<LoraMemoryPool> = (0..2).map(|r| pool(Arc::new(CpuDevice::new()), r)).collect();
    let mut imaged: Vec<LoraMemoryPool> = (0..2).map(|r| pool(imager.clone(), r)).collect();
    let a = LoraAdapter::synthetic("a", &dims, &mods, 8, 16.0, 0.3, 7).unwrap();
    let b = LoraAdapter::synthetic("b", &dims, &mods[..3], 4, 4.0, 0.3, 8).unwrap();
    imaged[0].image_maker().join([imaged[1].image_maker()]).prepare(&a);
    let made = a.image_layouts();
    assert_eq!(made.len(), 2, "one image per rank's layout: {made:?}");
    assert_ne!(made[0], made[1]);
    let key = |i: u32| AdapterKey { id: AdapterId(i), version: i as u64 };
    // Ranks take turns, as the manager fills a slot on every rank in one call; the second
    // adapter's images are made by the pools' own loads.
    for (slot, ad, k) in [(0, &a, 1), (1, &b, 2), (0, &b, 3), (1, &a, 4)] {
        for r in 0..2 {
            for p in [&mut direct[r], &mut imaged[r]] {
                if p.owner(slot).is_some() {
                    p.free_slot(slot);
                }
                p.load(slot, key(k), ad).unwrap();
            }
            assert_eq!(contents(&direct[r], &dims), contents(&imaged[r], &dims), "rank {r} after loading {} into slot {slot}", ad.name);
        }
    }
    assert_eq!(a.image_layouts(), made, "an activation on one rank rebuilt another rank's image");
    assert_eq!(b.image_layouts().len(), 2);
    assert!(contents(&direct[1], &dims).iter().any(|v| v.iter().any(|&x| x != 0.0)), "the pools hold nothing: the comparison would be empty");
}
