//! The LoRA memory pool: `S` slots of max rank `R`, allocated once on the model's device, per
//! layer and site:
//! - qkv: A `(S, 3R, hidden)`, Bᵀ `(S, R, q_out + 2·kv_out)`
//! - o: A `(S, R, q_out)`, Bᵀ `(S, R, hidden)`
//! - gate_up: A `(S, 2R, hidden)`, Bᵀ `(S, R, 2·inter)`
//! - down: A `(S, R, inter)`, Bᵀ `(S, R, hidden)`
//! - embedding (one, not per layer): A `(S, R, vocab)`, Bᵀ `(S, R, hidden)`
//! - lm_head: A `(S, R, hidden)`, Bᵀ `(S, R, vocab)`
//!
//! The buffers are the device's (`Device::lora_alloc_site`: f32 host memory on CPU, bf16 device
//! memory on CUDA), so the kernels read them where they compute and nothing is copied per step.
//! B is stored transposed (PEFT's `lora_B` is `(out, r)`) so the expand walks contiguous output
//! columns. A Bᵀ row is `b_ld ≥ out` floats apart ([`b_row_stride`]): an odd number of cache
//! lines, so the `r` rows that one CPU expand block reads at the same column fall in `r`
//! different cache sets. At the unpadded stride a 3072-wide gate_up row is 192 lines, a multiple
//! of the L1's 64 sets, and all 16 rows of a rank-16 block (and the next block, prefetched) fell
//! in one 8-way set. Host buffers are 64-byte aligned, so every row starts on a line.
//!
//! - MoE layers, per expert site (gate_up, down) when `experts.*` are targets: the same
//!   shapes at the expert's width with `S·E` slots, expert e of adapter slot w at slot `w·E + e`
//!   (its own `LoraTable`, so ranks and scalings stay per expert); Qwen2-MoE's shared expert
//!   as two ordinary sites. Expert sites grow the pool by E× a dense MLP's at the same rank,
//!   so they are capped ([`MAX_EXPERT_POOL_BYTES`]) with an error saying what to lower.
//!
//! A site's buffers exist only if one of its projections is a configured target (vocab-sized
//! buffers are large). Slot layout and its zero-tail invariant: see the crate docs. Slot
//! metadata (site rank, per-slice scaling) is a `LoraTable` `[entry][slot]`, mirrored on the
//! device after every load or free, so a kernel finds one contiguous per-slot row for its
//! (layer, site).

use std::sync::Arc;

use crate::adapter::LoraAdapter;
use crate::config::LoraModule;
use crate::error::{LoraError, Result};
use crate::eviction_policy::{EvictionPolicy, EvictionTracker};
use crate::registry::AdapterKey;
use crate::shard::{SiteCut, TpShard};
use crate::{ExpertSite, LinearSite, LoraModelDims};
use quiver_kernels::lora::MAX_SLICES;
use quiver_kernels::{Device, LoraSiteBuffers, LoraSiteShape, LoraTable};

/// One site's buffers and which adapter module fills each of its slices.
pub struct PoolSite {
    pub buffers: LoraSiteBuffers,
    pub modules: [Option<LoraModule>; MAX_SLICES],
    /// A tensor-parallel rank's cut of the adapter's weights; `None` takes them whole.
    pub cut: Option<SiteCut>,
}

/// Floats between two Bᵀ rows of output width `out`: `out` rounded up to whole 64-byte lines,
/// plus one line when that count is even. An odd line count is coprime with any power-of-two
/// number of cache sets, so rows `k = 0..r` at one column map to `r` distinct sets (up to the
/// cache's set count) whatever `out` is. Costs at most 2 lines a row.
pub fn b_row_stride(out: usize) -> usize {
    let lines = out.div_ceil(16);
    16 * (lines | 1)
}

fn site_shape(slots: usize, max_rank: usize, in_dim: usize, widths: &[usize]) -> LoraSiteShape {
    let n = widths.len();
    let mut offsets = [0; MAX_SLICES + 1];
    for j in 0..n {
        offsets[j + 1] = offsets[j] + widths[j];
    }
    LoraSiteShape { slots, max_rank, in_dim, n_slices: n, offsets, b_ld: b_row_stride(offsets[n]) }
}

/// Most bytes the expert sites of a pool may take: `S·E` slots of every MoE layer's gate_up
/// and down at rank `R` (Qwen3-30B-A3B at S = 4, R = 16: about 12.4 GiB in f32 over its 48
/// layers, so whole-model expert LoRA at that size needs fewer slots or a lower rank).
pub const MAX_EXPERT_POOL_BYTES: usize = 8 << 30;

/// Table entry of a shared-expert site, after the embedding and the LM head.
fn shared_entry(l: usize, layer: usize, site: ExpertSite) -> usize {
    4 * l + 2 + 2 * layer + site.index()
}

/// Index of the table entry for the embedding and the LM head, after the `4·L` sites.
fn embed_entry(l: usize) -> usize {
    4 * l
}
fn lm_head_entry(l: usize) -> usize {
    4 * l + 1
}

pub struct LoraMemoryPool {
    pub dims: LoraModelDims,
    device: Arc<dyn Device>,
    /// Makes adapters' images for this pool's layout (also from the engine's loader thread).
    images: LoraImageMaker,
    num_slots: usize,
    max_rank: usize,
    modules: Vec<LoraModule>,
    /// `layer * 4 + site`.
    sites: Vec<Option<PoolSite>>,
    embed: Option<PoolSite>,
    lm_head: Option<PoolSite>,
    /// Per layer, the experts' (gate_up, down) sites, `S·E` slots each.
    experts: Vec<[Option<PoolSite>; 2]>,
    /// Per layer, Qwen2-MoE's shared expert (gate_up, down).
    shared: Vec<[Option<PoolSite>; 2]>,
    /// Experts per MoE layer (0 on a dense model).
    num_experts: usize,
    /// Ranks and scalings of the expert sites, `[layer·2 + site][w·E + e]`.
    expert_table: LoraTable,
    table: LoraTable,
    owner: Vec<Option<AdapterKey>>,
    pinned: Vec<bool>,
    tracker: EvictionTracker,
}

impl LoraMemoryPool {
    /// Allocates every buffer once on `device`. `modules` are the targets the pool accepts.
    pub fn new(device: Arc<dyn Device>, dims: LoraModelDims, num_slots: usize, max_rank: usize, modules: &[LoraModule], policy: EvictionPolicy) -> Result<Self> {
        Self::new_for(device, dims, None, num_slots, max_rank, modules, policy)
    }

    /// The pool of one tensor-parallel rank of a model of `dims`: buffers sized by the rank's
    /// shard, and each adapter cut to it as it fills a slot ([`crate::shard`]). Rank 0 holds
    /// the embedding's LoRA whole; the others none.
    pub fn new_shard(device: Arc<dyn Device>, dims: LoraModelDims, shard: &TpShard, num_slots: usize, max_rank: usize, modules: &[LoraModule], policy: EvictionPolicy) -> Result<Self> {
        if dims.moe.is_some() {
            return Err(LoraError::Invalid("tensor parallelism of a mixture-of-experts model".into()));
        }
        Self::new_for(device, dims, Some(shard), num_slots, max_rank, modules, policy)
    }

    fn new_for(device: Arc<dyn Device>, full_dims: LoraModelDims, shard: Option<&TpShard>, num_slots: usize, max_rank: usize, modules: &[LoraModule], policy: EvictionPolicy) -> Result<Self> {
        let dims = shard.map_or(full_dims, |s| s.local_dims(&full_dims));
        if num_slots == 0 {
            return Err(LoraError::Invalid("max_loras_per_batch must be at least 1".into()));
        }
        if max_rank == 0 {
            return Err(LoraError::Invalid("max_lora_rank must be at least 1".into()));
        }
        let mut mods = modules.to_vec();
        mods.sort();
        mods.dedup();
        let site = |in_dim: usize, widths: &[usize], ms: &[LoraModule], cut: Option<SiteCut>| {
            let mut m = [None; MAX_SLICES];
            for (j, x) in ms.iter().enumerate() {
                m[j] = Some(*x);
            }
            PoolSite { buffers: device.lora_alloc_site(site_shape(num_slots, max_rank, in_dim, widths)), modules: m, cut }
        };
        let mut sites = Vec::with_capacity(dims.num_layers * 4);
        for _ in 0..dims.num_layers {
            for s in LinearSite::ALL {
                let ms = s.modules();
                if ms.iter().any(|m| mods.contains(m)) {
                    let (in_dim, w, n) = dims.site_dims(s);
                    sites.push(Some(site(in_dim, &w[..n], ms, shard.map(|sh| sh.site_cut(s)))));
                } else {
                    sites.push(None);
                }
            }
        }
        let embed_whole = shard.is_none_or(|sh| sh.rank == 0);
        let embed = (embed_whole && mods.contains(&LoraModule::EmbedTokens)).then(|| site(full_dims.vocab, &[dims.hidden], &[LoraModule::EmbedTokens], None));
        let lm_head = mods.contains(&LoraModule::LmHead).then(|| site(dims.hidden, &[dims.vocab], &[LoraModule::LmHead], shard.map(TpShard::lm_head_cut)));
        let moe = dims.moe.unwrap_or_default();
        let e = moe.num_experts;
        let moe_layers: Vec<usize> = (0..dims.num_layers).filter(|&l| dims.is_moe_layer(l)).collect();
        let wants = |site: ExpertSite, shared: bool| {
            let ms = if shared { site.shared_modules() } else { site.expert_modules() };
            ms.iter().any(|m| mods.contains(m))
        };
        let expert_sites = ExpertSite::ALL.into_iter().filter(|&s| wants(s, false));
        let bytes: usize = expert_sites
            .map(|s| {
                let (in_dim, w, n) = dims.expert_site_dims(s, false);
                let sh = site_shape(num_slots * e, max_rank, in_dim, &w[..n]);
                (sh.a_slot_len() + sh.b_slot_len()) * sh.slots * 4 * moe_layers.len()
            })
            .sum();
        if bytes > 0 {
            device.lora_experts_supported(num_slots, e).map_err(|why| LoraError::Invalid(format!("LoRA on experts: {why}; drop `experts` from the LoRA target modules")))?;
        }
        if bytes > MAX_EXPERT_POOL_BYTES {
            return Err(LoraError::Invalid(format!(
                "LoRA on experts needs {:.1} GiB of pool ({num_slots} slots × {e} experts × rank {max_rank} over {} MoE layers), above the {} GiB cap: lower max_loras_per_batch or max_lora_rank, or drop `experts` from the LoRA target modules",
                bytes as f64 / (1u64 << 30) as f64,
                moe_layers.len(),
                MAX_EXPERT_POOL_BYTES >> 30
            )));
        }
        let mut experts = Vec::with_capacity(dims.num_layers);
        let mut shared = Vec::with_capacity(dims.num_layers);
        for l in 0..dims.num_layers {
            let is_moe = dims.is_moe_layer(l);
            let make = |s: ExpertSite, sh: bool, slots: usize| {
                let ms = if sh { s.shared_modules() } else { s.expert_modules() };
                let (in_dim, w, n) = dims.expert_site_dims(s, sh);
                let mut m = [None; MAX_SLICES];
                for (j, x) in ms.iter().enumerate() {
                    m[j] = Some(*x);
                }
                PoolSite { buffers: device.lora_alloc_site(site_shape(slots, max_rank, in_dim, &w[..n])), modules: m, cut: None }
            };
            experts.push(ExpertSite::ALL.map(|s| (is_moe && wants(s, false)).then(|| make(s, false, num_slots * e))));
            shared.push(ExpertSite::ALL.map(|s| (is_moe && moe.shared_intermediate > 0 && wants(s, true)).then(|| make(s, true, num_slots))));
        }
        let mut table = device.lora_alloc_table(6 * dims.num_layers + 2, num_slots);
        device.lora_sync_table(&mut table);
        let mut expert_table = device.lora_alloc_table(2 * dims.num_layers, (num_slots * e).max(1));
        device.lora_sync_table(&mut expert_table);
        let images = LoraImageMaker { device: device.clone(), sites: Arc::new(Vec::new()), elems: 0, layout: 0, also: Arc::new(Vec::new()) };
        let mut pool = LoraMemoryPool {
            dims,
            images,
            device,
            num_slots,
            max_rank,
            modules: mods,
            sites,
            embed,
            lm_head,
            experts,
            shared,
            num_experts: e,
            expert_table,
            table,
            owner: vec![None; num_slots],
            pinned: vec![false; num_slots],
            tracker: EvictionTracker::new(policy, num_slots),
        };
        pool.images = pool.make_image_maker();
        Ok(pool)
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
    pub fn max_rank(&self) -> usize {
        self.max_rank
    }
    pub fn modules(&self) -> &[LoraModule] {
        &self.modules
    }
    pub fn has_embedding(&self) -> bool {
        self.embed.is_some()
    }
    pub fn has_lm_head(&self) -> bool {
        self.lm_head.is_some()
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
    /// Every site's buffers.
    fn all_sites(&self) -> impl Iterator<Item = &PoolSite> {
        self.sites.iter().flatten().chain(&self.embed).chain(&self.lm_head).chain(self.experts.iter().chain(&self.shared).flatten().flatten())
    }
    /// Bytes held by all A/B buffers.
    pub fn size_bytes(&self) -> usize {
        self.all_sites().map(|s| s.buffers.size_bytes()).sum()
    }
    /// Buffers and expert-table entry of an MoE layer's expert site (slot `w·E + e`).
    pub fn expert_site(&self, layer: usize, site: ExpertSite) -> Option<(&LoraSiteBuffers, usize)> {
        self.experts.get(layer)?[site.index()].as_ref().map(|b| (&b.buffers, 2 * layer + site.index()))
    }
    /// Buffers and table entry of a shared-expert site.
    pub fn shared_site(&self, layer: usize, site: ExpertSite) -> Option<(&LoraSiteBuffers, usize)> {
        self.shared.get(layer)?[site.index()].as_ref().map(|b| (&b.buffers, shared_entry(self.dims.num_layers, layer, site)))
    }
    pub fn expert_table(&self) -> &LoraTable {
        &self.expert_table
    }
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    pub fn table(&self) -> &LoraTable {
        &self.table
    }

    /// Buffers and table entry of a linear site, `None` if the pool has no buffers for it.
    pub fn site(&self, layer: usize, site: LinearSite) -> Option<(&LoraSiteBuffers, usize)> {
        let e = layer * 4 + site.index();
        self.sites.get(e)?.as_ref().map(|b| (&b.buffers, e))
    }
    pub fn embedding(&self) -> Option<(&LoraSiteBuffers, usize)> {
        self.embed.as_ref().map(|b| (&b.buffers, embed_entry(self.dims.num_layers)))
    }
    pub fn lm_head(&self) -> Option<(&LoraSiteBuffers, usize)> {
        self.lm_head.as_ref().map(|b| (&b.buffers, lm_head_entry(self.dims.num_layers)))
    }
    /// Largest A width of any site's shrink output (`n·R`).
    pub fn max_shrink_width(&self) -> usize {
        self.all_sites().map(|s| s.buffers.shape.shrink_width()).max().unwrap_or(0)
    }

    /// Largest site rank of a slot (0 = empty).
    pub fn slot_max_rank(&self, slot: usize) -> u32 {
        let s = self.num_slots;
        let dense = (0..self.table.entries).map(|e| self.table.ranks[e * s + slot]).max().unwrap_or(0);
        let (t, ne) = (&self.expert_table, self.num_experts);
        let experts = (0..t.entries).flat_map(|en| t.ranks_at(en)[slot * ne..(slot + 1) * ne].iter().copied()).max().unwrap_or(0);
        dense.max(experts)
    }

    // ---- slot ownership -------------------------------------------------------------------

    pub fn owner(&self, slot: usize) -> Option<AdapterKey> {
        self.owner[slot]
    }
    pub fn slot_of(&self, key: AdapterKey) -> Option<usize> {
        self.owner.iter().position(|o| *o == Some(key))
    }
    pub fn is_pinned(&self, slot: usize) -> bool {
        self.pinned[slot]
    }
    pub fn set_pinned(&mut self, slot: usize, pinned: bool) {
        self.pinned[slot] = pinned;
    }
    pub fn pinned_count(&self) -> usize {
        self.pinned.iter().filter(|p| **p).count()
    }
    pub fn mark_used(&mut self, slot: usize) {
        self.tracker.used(slot);
    }

    /// A slot for a new resident: the lowest free slot, else the policy's victim among slots
    /// that are neither pinned nor `protected` (used by the batch being built).
    pub fn choose_slot(&self, protected: impl Fn(AdapterKey) -> bool) -> Result<usize> {
        if let Some(s) = self.owner.iter().position(Option::is_none) {
            return Ok(s);
        }
        self.tracker
            .victim(|s| !self.pinned[s] && !self.owner[s].is_some_and(&protected))
            .ok_or_else(|| {
                LoraError::NoSlot(format!(
                    "all {} slots hold adapters that are pinned ({}) or used by the current batch; lower the number of distinct adapters per batch or raise max_loras_per_batch",
                    self.num_slots,
                    self.pinned_count()
                ))
            })
    }

    fn clear_ranks(&mut self, slot: usize) {
        let s = self.num_slots;
        for e in 0..self.table.entries {
            self.table.ranks[e * s + slot] = 0;
        }
        let (t, ne) = (&mut self.expert_table, self.num_experts);
        for en in 0..t.entries {
            t.ranks[en * t.slots + slot * ne..en * t.slots + (slot + 1) * ne].fill(0);
        }
    }

    /// Empties a slot (its adapter was unloaded or evicted). Buffers are zeroed on next load;
    /// ranks go to 0 at once (on the device too) so nothing can read the old weights through
    /// this slot.
    pub fn free_slot(&mut self, slot: usize) {
        self.owner[slot] = None;
        self.pinned[slot] = false;
        self.clear_ranks(slot);
        self.device.lora_sync_table(&mut self.table);
        self.device.lora_sync_table(&mut self.expert_table);
    }

    /// Copies `adapter` into `slot` (which must have been chosen by [`Self::choose_slot`]),
    /// rewriting the whole slot so the zero-tail invariant holds. On a device that makes LoRA
    /// images (CUDA) the adapter's first activation converts it into its image and every
    /// activation is then copies from that image, queued without the host waiting.
    pub fn load(&mut self, slot: usize, key: AdapterKey, adapter: &LoraAdapter) -> Result<()> {
        adapter.check_compatible(self.max_rank, &self.modules)?;
        self.clear_ranks(slot);
        let device = self.device.clone();
        self.images.prepare(adapter);
        let cell = adapter.image.clone();
        let images = cell.0.lock().unwrap_or_else(|p| p.into_inner());
        match images.iter().find(|i| i.layout == self.images.layout && i.filled) {
            Some(img) => {
                let mut at = 0;
                self.for_each_site(slot, &mut |site, table, entry, s, source| {
                    let shape = site.buffers.shape;
                    device.lora_write_slot_image(&mut site.buffers, s, img, at);
                    at += shape.a_slot_len() + shape.b_slot_len();
                    set_table_row(table, entry, s, &present(adapter, &site.modules, source));
                });
            }
            None => self.for_each_site(slot, &mut |site, table, entry, s, source| {
                let shape = site.buffers.shape;
                let p = present(adapter, &site.modules, source);
                let cut = site.cut;
                device.lora_write_slot(&mut site.buffers, s, &mut |a, b| fill_slot(shape, &p, cut, a, b));
                set_table_row(table, entry, s, &p);
            }),
        }
        self.device.lora_sync_table(&mut self.table);
        self.device.lora_sync_table(&mut self.expert_table);
        self.owner[slot] = Some(key);
        self.pinned[slot] = false;
        self.tracker.inserted(slot);
        Ok(())
    }

    /// Calls `f(site, table, entry, slot index, source)` for every site of the pool, in one
    /// fixed order (the order of an adapter's image; [`LoraImageMaker`] records it): the dense
    /// sites and the shared expert's of each layer, each expert's slot of the expert sites, then
    /// the embedding and the LM head. `source` says which of an adapter's modules fill it.
    fn for_each_site(&mut self, slot: usize, f: &mut dyn FnMut(&mut PoolSite, &mut LoraTable, usize, usize, ImageSource)) {
        let l = self.dims.num_layers;
        let ne = self.num_experts;
        for layer in 0..l {
            for site in LinearSite::ALL {
                let e = layer * 4 + site.index();
                if let Some(buf) = self.sites[e].as_mut() {
                    f(buf, &mut self.table, e, slot, ImageSource::Layer(layer));
                }
            }
            for site in ExpertSite::ALL {
                if let Some(buf) = self.shared[layer][site.index()].as_mut() {
                    f(buf, &mut self.table, shared_entry(l, layer, site), slot, ImageSource::Layer(layer));
                }
                if let Some(buf) = self.experts[layer][site.index()].as_mut() {
                    for x in 0..ne {
                        f(buf, &mut self.expert_table, 2 * layer + site.index(), slot * ne + x, ImageSource::Expert(layer, x));
                    }
                }
            }
        }
        if let Some(buf) = self.embed.as_mut() {
            f(buf, &mut self.table, embed_entry(l), slot, ImageSource::Layer(0));
        }
        if let Some(buf) = self.lm_head.as_mut() {
            f(buf, &mut self.table, lm_head_entry(l), slot, ImageSource::Layer(0));
        }
    }

    /// What makes adapter images for this pool, for another thread (the engine's loader).
    pub fn image_maker(&self) -> LoraImageMaker {
        self.images.clone()
    }

    /// The image maker of a freshly allocated pool: its sites in [`Self::for_each_site`]'s
    /// order, so the two cannot disagree.
    fn make_image_maker(&mut self) -> LoraImageMaker {
        use std::hash::{Hash, Hasher};
        let mut sites = Vec::new();
        self.for_each_site(0, &mut |site, _, _, _, source| sites.push(ImageSite { shape: site.buffers.shape, modules: site.modules, cut: site.cut, source }));
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (Arc::as_ptr(&self.device) as *const () as usize).hash(&mut h);
        let mut elems = 0;
        for s in &sites {
            let sh = s.shape;
            (sh.in_dim, sh.n_slices, sh.offsets, sh.b_ld, sh.max_rank, s.modules, s.cut, s.source).hash(&mut h);
            elems += sh.a_slot_len() + sh.b_slot_len();
        }
        LoraImageMaker { device: self.device.clone(), sites: Arc::new(sites), elems, layout: h.finish().max(1), also: Arc::new(Vec::new()) }
    }
}

/// Which of an adapter's modules fill a pool site: a layer's (dense sites, the shared expert,
/// and layer 0 for the embedding and the LM head) or one expert's of a layer.
#[derive(Clone, Copy, Hash)]
enum ImageSource {
    Layer(usize),
    Expert(usize, usize),
}

/// One site of an adapter's image, in image order.
#[derive(Clone, Copy)]
struct ImageSite {
    shape: LoraSiteShape,
    modules: [Option<LoraModule>; MAX_SLICES],
    cut: Option<SiteCut>,
    source: ImageSource,
}

/// The adapter's weights for each slice of a site.
fn present<'a>(adapter: &'a LoraAdapter, modules: &[Option<LoraModule>; MAX_SLICES], source: ImageSource) -> Present<'a> {
    std::array::from_fn(|j| {
        modules[j].and_then(|m| match source {
            ImageSource::Layer(l) => adapter.module(l, m),
            ImageSource::Expert(l, x) => adapter.expert(l, x, m),
        })
    })
}

/// Makes adapters' images for a pool ([`quiver_kernels::LoraImage`]) without the pool itself:
/// its device and its sites in image order. The engine's loader thread holds a clone, so an
/// adapter's image is made as its files are read, and installing or activating it on the engine
/// thread only finds it made.
#[derive(Clone)]
pub struct LoraImageMaker {
    device: Arc<dyn Device>,
    sites: Arc<Vec<ImageSite>>,
    elems: usize,
    /// Hash of the device and the site list: an image is reused only by a pool of the same.
    layout: u64,
    /// Makers of other pools whose images [`Self::prepare`] makes too ([`Self::join`]).
    also: Arc<Vec<LoraImageMaker>>,
}

impl LoraImageMaker {
    /// Makes `adapter`'s image for this layout unless it has one, on a device that makes images
    /// (a no-op elsewhere), and for the layouts of the makers [`Self::join`]ed to it. Images of
    /// other layouts stay: a tensor-parallel group's ranks each keep their own.
    pub fn prepare(&self, adapter: &LoraAdapter) {
        for maker in std::iter::once(self).chain(self.also.iter()) {
            maker.prepare_own(adapter);
        }
    }

    fn prepare_own(&self, adapter: &LoraAdapter) {
        let cell = adapter.image.clone();
        let mut images = cell.0.lock().unwrap_or_else(|p| p.into_inner());
        if images.iter().any(|i| i.layout == self.layout && i.filled) {
            return;
        }
        images.retain(|i| i.layout != self.layout);
        let Some(mut img) = self.device.lora_image(self.elems) else { return };
        img.layout = self.layout;
        let mut at = 0;
        for s in self.sites.iter() {
            let p = present(adapter, &s.modules, s.source);
            self.device.lora_image_fill(&mut img, at, s.shape, &mut |a, b| fill_slot(s.shape, &p, s.cut, a, b));
            at += s.shape.a_slot_len() + s.shape.b_slot_len();
        }
        img.filled = true;
        images.push(img);
    }

    /// This maker and `others` as one: [`Self::prepare`] makes an adapter's image for each of
    /// their layouts (the pools of a tensor-parallel group's ranks).
    pub fn join(&self, others: impl IntoIterator<Item = LoraImageMaker>) -> LoraImageMaker {
        let mut also: Vec<LoraImageMaker> = self.also.iter().cloned().collect();
        for o in others {
            also.push(LoraImageMaker { also: Arc::new(Vec::new()), ..o });
        }
        LoraImageMaker { also: Arc::new(also), ..self.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::b_row_stride;

    /// Every width gets a line-multiple stride of an odd number of lines, at most two lines
    /// longer than the row, and the 16 rows of a rank-16 block at one column land in 16
    /// different sets of a 64-set L1 (the unpadded 3072-wide gate_up rows all shared one).
    #[test]
    fn b_rows_are_an_odd_number_of_lines_apart() {
        for out in 1..5000 {
            let ld = b_row_stride(out);
            assert!(ld >= out && ld.is_multiple_of(16) && !(ld / 16).is_multiple_of(2) && ld - out < 32, "out {out}: stride {ld}");
        }
        for out in [576, 960, 1536, 3072, 4096, 6144, 28672] {
            let ld = b_row_stride(out);
            let mut sets: Vec<usize> = (0..16).map(|k| (k * ld / 16) % 64).collect();
            sets.sort();
            sets.dedup();
            assert_eq!(sets.len(), 16, "out {out}");
        }
    }
}

type Present<'a> = [Option<&'a crate::adapter::ModuleWeights>; MAX_SLICES];

/// The site rank of a slot: the largest rank among its slices (each slice's A rows start at
/// `j · rank`).
fn site_rank(present: &Present<'_>) -> usize {
    present.iter().flatten().map(|w| w.rank).max().unwrap_or(0)
}

/// Writes the slices `present` into a slot's zeroed f32 A `(n·R, in)` and Bᵀ `(R, b_ld)`;
/// with a tensor-parallel `cut`, only A's columns `a_col0..a_col0 + in` and each slice's B rows
/// from its `b_row0` (the module's weights are the whole model's).
fn fill_slot(shape: LoraSiteShape, present: &Present<'_>, cut: Option<SiteCut>, a: &mut [f32], b: &mut [f32]) {
    let r_site = site_rank(present);
    let in_dim = shape.in_dim;
    for (j, w) in present.iter().enumerate() {
        let Some(w) = w else { continue };
        let rj = w.rank;
        let row0 = j * r_site;
        let (a_col0, b_row0) = cut.map_or((0, 0), |c| (c.a_col0, c.b_row0[j]));
        let full_in = w.a.len() / rj;
        for (dst, src) in a[row0 * in_dim..(row0 + rj) * in_dim].chunks_mut(in_dim).zip(w.a.chunks(full_in)) {
            dst.copy_from_slice(&src[a_col0..a_col0 + in_dim]);
        }
        let (o0, ld) = (shape.offsets[j], shape.b_ld);
        for o in 0..(shape.offsets[j + 1] - o0) {
            for k in 0..rj {
                b[k * ld + o0 + o] = w.b[(b_row0 + o) * rj + k];
            }
        }
    }
}

/// The (entry, slot) row of the rank / scaling table for the slices `present`.
fn set_table_row(table: &mut LoraTable, entry: usize, slot: usize, present: &Present<'_>) {
    let s = table.slots;
    for (j, w) in present.iter().enumerate() {
        table.scalings[(entry * s + slot) * MAX_SLICES + j] = w.map_or(0.0, |w| w.scaling);
    }
    table.ranks[entry * s + slot] = site_rank(present) as u32;
}
