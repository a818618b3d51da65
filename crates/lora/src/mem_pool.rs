//! The LoRA memory pool: `S` slots of max rank `R`, allocated once, per layer and site:
//! - qkv: A `(S, 3R, hidden)`, Bᵀ `(S, R, q_out + 2·kv_out)`
//! - o: A `(S, R, q_out)`, Bᵀ `(S, R, hidden)`
//! - gate_up: A `(S, 2R, hidden)`, Bᵀ `(S, R, 2·inter)`
//! - down: A `(S, R, inter)`, Bᵀ `(S, R, hidden)`
//! - embedding (one, not per layer): A `(S, R, vocab)`, Bᵀ `(S, R, hidden)`
//! - lm_head: A `(S, R, hidden)`, Bᵀ `(S, R, vocab)`
//!
//! B is stored transposed (PEFT's `lora_B` is `(out, r)`) so the expand walks contiguous output
//! columns: each rank step is a vector multiply-add over a run of `y`, instead of one short
//! rank-long dot product per output element. A Bᵀ row is `b_ld ≥ out` floats apart
//! ([`b_row_stride`]): an odd number of cache lines, so the `r` rows that one expand block reads
//! at the same column fall in `r` different cache sets. At the unpadded stride a 3072-wide
//! gate_up row is 192 lines, a multiple of the L1's 64 sets, and all 16 rows of a rank-16 block
//! (and the next block, prefetched) fell in one 8-way set. Buffers are 64-byte aligned, so every row starts on a line.
//!
//! A site's buffers exist only if one of its projections is a configured target (vocab-sized
//! buffers are large). Slot layout and its zero-tail invariant: see the crate docs. Slot
//! metadata (site rank, per-slice scaling) is stored `[entry][slot]` so a kernel gets one
//! contiguous per-slot slice for its (layer, site).

use crate::adapter::LoraAdapter;
use crate::config::LoraModule;
use crate::error::{LoraError, Result};
use crate::eviction_policy::{EvictionPolicy, EvictionTracker};
use crate::registry::AdapterKey;
use crate::{LinearSite, LoraModelDims};
use quiver_kernels::aligned::AlignedVec;

/// Max fused slices per site.
pub const MAX_SLICES: usize = 3;

/// Preallocated A/B buffers of one site (all slots).
pub struct SiteBuffers {
    pub a: AlignedVec<f32>,
    pub b: AlignedVec<f32>,
    /// Input width (vocab for the embedding).
    pub in_dim: usize,
    /// Total output width (sum of slices).
    pub out_dim: usize,
    /// Distance between Bᵀ rows, [`b_row_stride`]`(out_dim)`.
    pub b_ld: usize,
    pub n_slices: usize,
    /// Slice boundaries in the output, `offsets[..=n_slices]`.
    pub offsets: [usize; MAX_SLICES + 1],
    /// Which adapter module fills each slice.
    pub modules: [Option<LoraModule>; MAX_SLICES],
}

impl SiteBuffers {
    fn new(slots: usize, max_rank: usize, in_dim: usize, widths: &[usize], modules: &[LoraModule]) -> Self {
        let n = widths.len();
        let mut offsets = [0; MAX_SLICES + 1];
        for j in 0..n {
            offsets[j + 1] = offsets[j] + widths[j];
        }
        let out_dim = offsets[n];
        let mut ms = [None; MAX_SLICES];
        for (j, m) in modules.iter().enumerate() {
            ms[j] = Some(*m);
        }
        let b_ld = b_row_stride(out_dim);
        SiteBuffers {
            a: AlignedVec::zeroed(slots * n * max_rank * in_dim),
            b: AlignedVec::zeroed(slots * b_ld * max_rank),
            in_dim,
            out_dim,
            b_ld,
            n_slices: n,
            offsets,
            modules: ms,
        }
    }
}

/// Floats between two Bᵀ rows of output width `out`: `out` rounded up to whole 64-byte lines,
/// plus one line when that count is even. An odd line count is coprime with any power-of-two
/// number of cache sets, so rows `k = 0..r` at one column map to `r` distinct sets (up to the
/// cache's set count) whatever `out` is. Costs at most 2 lines a row.
pub fn b_row_stride(out: usize) -> usize {
    let lines = out.div_ceil(16);
    16 * (lines | 1)
}

/// What a kernel needs to apply one site: the buffers plus this (layer, site)'s per-slot
/// rank and per-slice scaling.
#[derive(Clone, Copy)]
pub struct SiteView<'a> {
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub in_dim: usize,
    pub out_dim: usize,
    /// Distance between Bᵀ rows (≥ `out_dim`, see [`b_row_stride`]).
    pub b_ld: usize,
    pub max_rank: usize,
    pub n_slices: usize,
    pub offsets: [usize; MAX_SLICES + 1],
    /// Site rank per slot (0 = skip).
    pub ranks: &'a [u32],
    /// `scalings[slot * MAX_SLICES + j]`.
    pub scalings: &'a [f32],
}

impl<'a> SiteView<'a> {
    /// A of slot `w`: `(n·R, in)`; slice `j` of a rank-`r` site at rows `[j·r, (j+1)·r)`.
    #[inline]
    pub fn a_slot(&self, w: usize) -> &'a [f32] {
        let len = self.n_slices * self.max_rank * self.in_dim;
        &self.a[w * len..(w + 1) * len]
    }
    /// Bᵀ of slot `w`: `(R, b_ld)`; rank step `k` of output column `o` at `k·b_ld + o`
    /// (columns `out_dim..b_ld` are zero padding).
    #[inline]
    pub fn b_slot(&self, w: usize) -> &'a [f32] {
        let len = self.b_ld * self.max_rank;
        &self.b[w * len..(w + 1) * len]
    }
    #[inline]
    pub fn scaling(&self, w: usize, j: usize) -> f32 {
        self.scalings[w * MAX_SLICES + j]
    }
}

/// Index of the metadata entry for the embedding and the LM head, after the `4·L` sites.
fn embed_entry(l: usize) -> usize {
    4 * l
}
fn lm_head_entry(l: usize) -> usize {
    4 * l + 1
}

pub struct LoraMemoryPool {
    pub dims: LoraModelDims,
    num_slots: usize,
    max_rank: usize,
    modules: Vec<LoraModule>,
    /// `layer * 4 + site`.
    sites: Vec<Option<SiteBuffers>>,
    embed: Option<SiteBuffers>,
    lm_head: Option<SiteBuffers>,
    /// `[entry][slot]`.
    ranks: Vec<u32>,
    /// `[entry][slot][slice]`.
    scalings: Vec<f32>,
    owner: Vec<Option<AdapterKey>>,
    pinned: Vec<bool>,
    tracker: EvictionTracker,
}

impl LoraMemoryPool {
    /// Allocates every buffer once. `modules` are the targets the pool accepts.
    pub fn new(dims: LoraModelDims, num_slots: usize, max_rank: usize, modules: &[LoraModule], policy: EvictionPolicy) -> Result<Self> {
        if num_slots == 0 {
            return Err(LoraError::Invalid("max_loras_per_batch must be at least 1".into()));
        }
        if max_rank == 0 {
            return Err(LoraError::Invalid("max_lora_rank must be at least 1".into()));
        }
        let mut mods = modules.to_vec();
        mods.sort();
        mods.dedup();
        let mut sites = Vec::with_capacity(dims.num_layers * 4);
        for _ in 0..dims.num_layers {
            for site in LinearSite::ALL {
                let ms = site.modules();
                if ms.iter().any(|m| mods.contains(m)) {
                    let (in_dim, w, n) = dims.site_dims(site);
                    sites.push(Some(SiteBuffers::new(num_slots, max_rank, in_dim, &w[..n], ms)));
                } else {
                    sites.push(None);
                }
            }
        }
        let embed = mods
            .contains(&LoraModule::EmbedTokens)
            .then(|| SiteBuffers::new(num_slots, max_rank, dims.vocab, &[dims.hidden], &[LoraModule::EmbedTokens]));
        let lm_head = mods
            .contains(&LoraModule::LmHead)
            .then(|| SiteBuffers::new(num_slots, max_rank, dims.hidden, &[dims.vocab], &[LoraModule::LmHead]));
        let entries = 4 * dims.num_layers + 2;
        Ok(LoraMemoryPool {
            dims,
            num_slots,
            max_rank,
            modules: mods,
            sites,
            embed,
            lm_head,
            ranks: vec![0; entries * num_slots],
            scalings: vec![0.0; entries * num_slots * MAX_SLICES],
            owner: vec![None; num_slots],
            pinned: vec![false; num_slots],
            tracker: EvictionTracker::new(policy, num_slots),
        })
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
    /// Bytes held by all A/B buffers.
    pub fn size_bytes(&self) -> usize {
        let sb = |s: &SiteBuffers| (s.a.len() + s.b.len()) * 4;
        self.sites.iter().flatten().map(sb).sum::<usize>() + self.embed.iter().map(sb).sum::<usize>() + self.lm_head.iter().map(sb).sum::<usize>()
    }

    fn view_of<'a>(&'a self, buf: &'a SiteBuffers, entry: usize) -> SiteView<'a> {
        let s = self.num_slots;
        SiteView {
            a: &buf.a,
            b: &buf.b,
            in_dim: buf.in_dim,
            out_dim: buf.out_dim,
            b_ld: buf.b_ld,
            max_rank: self.max_rank,
            n_slices: buf.n_slices,
            offsets: buf.offsets,
            ranks: &self.ranks[entry * s..(entry + 1) * s],
            scalings: &self.scalings[entry * s * MAX_SLICES..(entry + 1) * s * MAX_SLICES],
        }
    }

    /// Kernel view of a linear site, `None` if the pool has no buffers for it.
    pub fn site_view(&self, layer: usize, site: LinearSite) -> Option<SiteView<'_>> {
        let e = layer * 4 + site.index();
        self.sites.get(e)?.as_ref().map(|b| self.view_of(b, e))
    }
    pub fn embedding_view(&self) -> Option<SiteView<'_>> {
        self.embed.as_ref().map(|b| self.view_of(b, embed_entry(self.dims.num_layers)))
    }
    pub fn lm_head_view(&self) -> Option<SiteView<'_>> {
        self.lm_head.as_ref().map(|b| self.view_of(b, lm_head_entry(self.dims.num_layers)))
    }

    /// Largest site rank of a slot (0 = empty).
    pub fn slot_max_rank(&self, slot: usize) -> u32 {
        let s = self.num_slots;
        (0..4 * self.dims.num_layers + 2).map(|e| self.ranks[e * s + slot]).max().unwrap_or(0)
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

    /// Empties a slot (its adapter was unloaded or evicted). Buffers are zeroed on next load;
    /// ranks go to 0 at once so nothing can read the old weights through this slot.
    pub fn free_slot(&mut self, slot: usize) {
        self.owner[slot] = None;
        self.pinned[slot] = false;
        let s = self.num_slots;
        for e in 0..4 * self.dims.num_layers + 2 {
            self.ranks[e * s + slot] = 0;
        }
    }

    /// Copies `adapter` into `slot` (which must have been chosen by [`Self::choose_slot`]),
    /// zeroing the whole slot first so the zero-tail invariant holds.
    pub fn load(&mut self, slot: usize, key: AdapterKey, adapter: &LoraAdapter) -> Result<()> {
        adapter.check_compatible(self.max_rank, &self.modules)?;
        let s = self.num_slots;
        let rmax = self.max_rank;
        let fill = |buf: &mut SiteBuffers, entry: usize, layer: usize, ranks: &mut [u32], scalings: &mut [f32]| {
            let n = buf.n_slices;
            let a_len = n * rmax * buf.in_dim;
            let b_len = buf.b_ld * rmax;
            let a = &mut buf.a[slot * a_len..(slot + 1) * a_len];
            let b = &mut buf.b[slot * b_len..(slot + 1) * b_len];
            a.fill(0.0);
            b.fill(0.0);
            let present: [Option<&crate::adapter::ModuleWeights>; MAX_SLICES] =
                std::array::from_fn(|j| buf.modules[j].and_then(|m| adapter.module(layer, m)));
            let r_site = present.iter().flatten().map(|w| w.rank).max().unwrap_or(0);
            for j in 0..MAX_SLICES {
                scalings[(entry * s + slot) * MAX_SLICES + j] = 0.0;
            }
            for (j, w) in present.iter().enumerate() {
                let Some(w) = w else { continue };
                let rj = w.rank;
                let row0 = j * r_site;
                a[row0 * buf.in_dim..(row0 + rj) * buf.in_dim].copy_from_slice(&w.a);
                let (o0, ld) = (buf.offsets[j], buf.b_ld);
                for o in 0..(buf.offsets[j + 1] - o0) {
                    for k in 0..rj {
                        b[k * ld + o0 + o] = w.b[o * rj + k];
                    }
                }
                scalings[(entry * s + slot) * MAX_SLICES + j] = w.scaling;
            }
            ranks[entry * s + slot] = r_site as u32;
        };
        for e in 0..4 * self.dims.num_layers + 2 {
            self.ranks[e * s + slot] = 0;
        }
        for layer in 0..self.dims.num_layers {
            for site in LinearSite::ALL {
                let e = layer * 4 + site.index();
                if let Some(buf) = self.sites[e].as_mut() {
                    fill(buf, e, layer, &mut self.ranks, &mut self.scalings);
                }
            }
        }
        let l = self.dims.num_layers;
        if let Some(buf) = self.embed.as_mut() {
            fill(buf, embed_entry(l), 0, &mut self.ranks, &mut self.scalings);
        }
        if let Some(buf) = self.lm_head.as_mut() {
            fill(buf, lm_head_entry(l), 0, &mut self.ranks, &mut self.scalings);
        }
        self.owner[slot] = Some(key);
        self.pinned[slot] = false;
        self.tracker.inserted(slot);
        Ok(())
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
