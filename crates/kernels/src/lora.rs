//! LoRA as device ops: the slot storage of a LoRA site, the per-step grouping of rows by
//! adapter slot, and the contract of [`crate::Device::lora_apply`], in layouts every device
//! shares.
//!
//! # The op
//! For every grouped row `t` with slot `w` and site rank `r = ranks[w] > 0`, and each slice `j`
//! of the site (qkv has 3 slices of different widths, gate_up 2, the others 1):
//!
//! `y[t, off_j..off_{j+1}] += s_{w,j} · (x[t] · A[w, j·r..j·r + r]ᵀ) · Bᵀ[w, 0..r, off_j..off_{j+1}]`
//!
//! contracting over exactly `r`. For the embedding the shrink `x · Aᵀ` is a gather of A's
//! columns at the token id (A is `(r, vocab)`, PEFT's `lora_embedding_A`). Rows in no group
//! (the base model's) are never read or written.
//!
//! # Slot layout (shared by the pool, every device's kernels and the reference)
//! A is `(S, n·R, in)`: slot `w`'s slice `j` of a rank-`r` site at rows `[j·r, j·r + r_j)`.
//! Bᵀ is `(S, R, b_ld)`: rank step `k` of output column `o` at `k·b_ld + o` (B stored
//! transposed so an expand walks contiguous output columns). Everything else in a slot is zero
//! (the pool zeroes a slot before writing it), so a kernel that contracted over more than `r`
//! would still be right. Ranks and per-slice scalings live in a [`LoraTable`], `[entry][slot]`,
//! one entry per (layer, site) plus the embedding and the LM head.
//!
//! # Grouping
//! A backend (a policy in the LoRA crate) hands the op [`LoraGroups`]: groups of rows that share
//! a slot, either contiguous segments (prefill: one request's rows) or chunks of a stable
//! permutation that sorts rows by slot (decode: adapters interleaved). A device with its own
//! memory reads the same groups from the [`LoraGroups::packed`] copy staged with the batch, cut
//! into tiles of at most [`crate::Device::lora_tile_rows`] rows, at a capacity fixed by the
//! row count so a recorded step (CUDA graph) stays valid whatever adapters the rows use.

use crate::aligned::AlignedVec;

/// Most fused slices of one site (q, k, v).
pub const MAX_SLICES: usize = 3;

/// Geometry of one site's slot buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraSiteShape {
    pub slots: usize,
    /// Pool rank `R`.
    pub max_rank: usize,
    /// Input width (the vocabulary for the embedding).
    pub in_dim: usize,
    pub n_slices: usize,
    /// Slice boundaries in the output, `offsets[..=n_slices]`.
    pub offsets: [usize; MAX_SLICES + 1],
    /// Distance between Bᵀ rows, at least the output width.
    pub b_ld: usize,
}

impl LoraSiteShape {
    pub fn out_dim(&self) -> usize {
        self.offsets[self.n_slices]
    }
    /// Elements of one slot of A: `n·R·in`.
    pub fn a_slot_len(&self) -> usize {
        self.n_slices * self.max_rank * self.in_dim
    }
    /// Elements of one slot of Bᵀ: `R·b_ld`.
    pub fn b_slot_len(&self) -> usize {
        self.max_rank * self.b_ld
    }
    /// Width of one row of the shrink output: `n·R`.
    pub fn shrink_width(&self) -> usize {
        self.n_slices * self.max_rank
    }
}

/// Elements of LoRA storage: f32 in host memory, or in a device's own memory in the device's
/// element type (bf16 on CUDA, f32 on OpenCL).
pub enum LoraStorage {
    Host(AlignedVec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DevBuf),
    OpenCl(crate::opencl::ClBuf),
}

impl LoraStorage {
    /// Host view; panics on device storage (only host kernels read it this way).
    pub fn host(&self) -> &[f32] {
        match self {
            LoraStorage::Host(v) => v,
            #[cfg(feature = "cuda")]
            LoraStorage::Cuda(_) => panic!("host view of LoRA storage in CUDA memory"),
            LoraStorage::OpenCl(_) => panic!("host view of LoRA storage in OpenCL memory"),
        }
    }
    pub fn host_mut(&mut self) -> &mut [f32] {
        match self {
            LoraStorage::Host(v) => v,
            #[cfg(feature = "cuda")]
            LoraStorage::Cuda(_) => panic!("host view of LoRA storage in CUDA memory"),
            LoraStorage::OpenCl(_) => panic!("host view of LoRA storage in OpenCL memory"),
        }
    }
    pub fn size_bytes(&self) -> usize {
        match self {
            LoraStorage::Host(v) => v.len() * 4,
            #[cfg(feature = "cuda")]
            LoraStorage::Cuda(b) => b.bytes(),
            LoraStorage::OpenCl(b) => b.bytes(),
        }
    }
}

/// An adapter's pool contents laid out as a device's pool holds them, in host memory the device
/// copies from directly (page-locked bf16 on CUDA): built the first time the adapter is
/// activated, so activating it again is copies only, with no conversion and no staging
/// ([`crate::Device::lora_image`]). Sites follow one another in the pool's order, each its
/// slot's A then Bᵀ (`a_slot_len + b_slot_len` elements).
pub struct LoraImage {
    pub elems: usize,
    /// Every site has been written into it.
    pub filled: bool,
    /// The pool's key for the device and site shapes it was made for (0 as the device makes
    /// it): an image is reused only by a pool of the same layout.
    pub layout: u64,
    pub data: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for LoraImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoraImage({} elements{})", self.elems, if self.filled { "" } else { ", unfilled" })
    }
}

/// The slot buffers of one site on a device: A `(S, n·R, in)` and Bᵀ `(S, R, b_ld)`, and where
/// the device also keeps the first slots' B beside the base weight's rows, if it does.
pub struct LoraSiteBuffers {
    pub shape: LoraSiteShape,
    pub a: LoraStorage,
    pub b: LoraStorage,
    /// Set by [`crate::Device::lora_attach_tail`] (through `&self`: the pool hands its sites
    /// out shared); read by the device at each slot write and long prompt step.
    pub tail: std::sync::Mutex<Option<LoraTail>>,
}

/// A site's LoRA tail (`docs/lora-in-the-gemm.md`, [`crate::Device::lora_attach_tail`]): the
/// base weight keeps, beside each output row `o` of slice `j`, the B of slots `0..slots` in
/// columns `in + slot·n·R + j·R + 0..R` (zeros in the other slices' columns), so one GEMM over
/// `in + (highest slot + 1)·n·R` input columns adds every row's delta when each input row
/// carries its scaled shrink in its slot's columns. `at` is the device address of the weight's
/// column `in` in row 0, `ld` its row stride in elements; `memory` keeps the weight's memory
/// alive while the site may still write slots into it, whatever happens to the weight.
pub struct LoraTail {
    pub at: u64,
    pub ld: usize,
    pub slots: usize,
    pub memory: Box<dyn std::any::Any + Send + Sync>,
}

impl LoraSiteBuffers {
    /// Zeroed host buffers (the CPU device's, and the default of [`crate::Device::lora_alloc_site`]).
    pub fn host(shape: LoraSiteShape) -> Self {
        LoraSiteBuffers {
            a: LoraStorage::Host(AlignedVec::zeroed(shape.slots * shape.a_slot_len())),
            b: LoraStorage::Host(AlignedVec::zeroed(shape.slots * shape.b_slot_len())),
            shape,
            tail: Default::default(),
        }
    }
    pub fn size_bytes(&self) -> usize {
        self.a.size_bytes() + self.b.size_bytes()
    }
    /// Host A of slot `w`: `(n·R, in)`.
    pub fn a_slot(&self, w: usize) -> &[f32] {
        let len = self.shape.a_slot_len();
        &self.a.host()[w * len..(w + 1) * len]
    }
    /// Host Bᵀ of slot `w`: `(R, b_ld)`.
    pub fn b_slot(&self, w: usize) -> &[f32] {
        let len = self.shape.b_slot_len();
        &self.b.host()[w * len..(w + 1) * len]
    }
}

/// Rank and per-slice scaling of every (entry, slot): the host copy the pool edits, and the
/// device's mirror of it (ranks as u32, then scalings as f32, 4 bytes each), refreshed by
/// [`crate::Device::lora_sync_table`] after every slot load or free.
pub struct LoraTable {
    pub entries: usize,
    pub slots: usize,
    /// `[entry][slot]`; 0 = the slot has nothing at this entry.
    pub ranks: Vec<u32>,
    /// `[entry][slot][MAX_SLICES]`.
    pub scalings: Vec<f32>,
    /// Device copy, for devices with their own memory.
    pub device: Option<LoraStorage>,
}

impl LoraTable {
    pub fn host(entries: usize, slots: usize) -> Self {
        LoraTable { entries, slots, ranks: vec![0; entries * slots], scalings: vec![0.0; entries * slots * MAX_SLICES], device: None }
    }
    /// Ranks of every slot at `entry`.
    pub fn ranks_at(&self, entry: usize) -> &[u32] {
        &self.ranks[entry * self.slots..(entry + 1) * self.slots]
    }
    /// `scalings[slot * MAX_SLICES + j]` at `entry`.
    pub fn scalings_at(&self, entry: usize) -> &[f32] {
        &self.scalings[entry * self.slots * MAX_SLICES..(entry + 1) * self.slots * MAX_SLICES]
    }
}

/// The rows of each group, host side.
#[derive(Clone, Copy, Debug)]
pub enum GroupRows<'a> {
    /// Group `g` is rows `start[g]..end[g]` (segments).
    Contiguous,
    /// Group `g` is rows `perm[start[g]..end[g]]` (chunks of the permutation).
    Permuted(&'a [u32]),
}

/// Groups of rows sharing a slot, as a backend chose them.
#[derive(Clone, Copy, Debug)]
pub struct LoraGroups<'a> {
    /// Rows of `x` and `y` (the grouping covers a subset).
    pub rows: usize,
    /// Rows in some group.
    pub adapter_rows: usize,
    pub group_rows: GroupRows<'a>,
    pub start: &'a [u32],
    pub end: &'a [u32],
    pub slot: &'a [u32],
    /// The same groups for a device, in the packed layout of [`pack_tiles`], or empty when the
    /// device reads the host slices above.
    pub packed: &'a [u32],
}

impl LoraGroups<'_> {
    pub fn num_groups(&self) -> usize {
        self.slot.len()
    }
    /// Longest group.
    pub fn max_len(&self) -> usize {
        self.start.iter().zip(self.end).map(|(s, e)| (e - s) as usize).max().unwrap_or(0)
    }
}

/// One site's LoRA delta over one batch: what [`crate::Device::lora_apply`] runs.
#[derive(Clone, Copy)]
pub struct LoraCall<'a> {
    pub buffers: &'a LoraSiteBuffers,
    pub table: &'a LoraTable,
    /// This site's row of the table.
    pub entry: usize,
    pub groups: LoraGroups<'a>,
}

impl LoraCall<'_> {
    pub fn shape(&self) -> &LoraSiteShape {
        &self.buffers.shape
    }
    /// Site rank of slot `w`.
    pub fn rank(&self, w: usize) -> usize {
        self.table.ranks[self.entry * self.table.slots + w] as usize
    }
    pub fn scaling(&self, w: usize, j: usize) -> f32 {
        self.table.scalings[(self.entry * self.table.slots + w) * MAX_SLICES + j]
    }
}

/// One expert site's LoRA delta over an MoE layer's routed positions: what
/// [`crate::Device::lora_experts`] runs. Its rows are the routing's `m·k` grouped positions (the
/// rows of the experts' grouped GEMM input and output); position p of expert e, whose token row
/// has adapter slot w, takes slot `w·E + e` of the site (`E` slots per adapter slot), base rows
/// none. The delta lands in the expert's output before the router-weighted combine, so the
/// combine scales it by the router weight exactly as it scales the base expert's output.
#[derive(Clone, Copy)]
pub struct LoraExpertCall<'a> {
    pub buffers: &'a LoraSiteBuffers,
    /// The expert sites' table: `S·E` slots per entry.
    pub table: &'a LoraTable,
    /// This site's row of the table.
    pub entry: usize,
    /// Adapter slots `S` of the batch.
    pub slots: usize,
    /// The token rows' groups in the layout of [`pack_tiles`], staged with the batch: its
    /// row-slot table is each token row's adapter slot where the device reads it (empty on a
    /// device that reads host slices).
    pub token_groups: &'a [u32],
    /// The host path, for a device whose routing is in host memory: groups the positions of the
    /// host routing by (slot, expert) and adds their deltas through `lora_apply`, as the LoRA
    /// crate's backend policy chooses.
    pub host: &'a dyn Fn(&crate::moe::HostRouting, &crate::Tensor, &mut crate::Tensor),
}

impl LoraExpertCall<'_> {
    pub fn shape(&self) -> &LoraSiteShape {
        &self.buffers.shape
    }
    /// Token rows of the staged groups (`token_groups` is [`packed_len`] of them).
    pub fn token_rows(&self) -> usize {
        packed_capacity(self.token_groups.len())
    }
    /// The staged row-slot table: word offset of token row 0's slot in `token_groups`.
    pub fn row_slot_offset(&self) -> usize {
        1 + 5 * self.token_rows()
    }
}

/// The input of a LoRA site.
#[derive(Clone, Copy)]
pub enum LoraX<'a> {
    /// Row-major `[rows, in]` activations.
    Dense(&'a crate::Tensor),
    /// Token ids (the embedding's shrink is a gather of A's columns).
    TokenIds(&'a [u32]),
}

/// u32 words of [`pack_tiles`]'s layout for `capacity` rows (a header word, then tables of
/// `capacity` words each; [`LoraExpertCall::token_rows`] reads the capacity back from the length).
pub fn packed_len(capacity: usize) -> usize {
    1 + 6 * capacity
}

/// The row capacity of [`pack_tiles`]' layout of `len` words (the inverse of [`packed_len`]).
pub fn packed_capacity(len: usize) -> usize {
    len.saturating_sub(1) / (packed_len(1) - 1)
}

/// [`pack_tiles`]' marker for a row in no group (a base row) in its row-indexed tables.
pub const NO_POSITION: u32 = u32::MAX;

/// The tiles of packed groups (`capacity` rows) as maximal runs `(first row, rows, slot)` of
/// contiguous rows of one slot, in tile order, to `f`: a prefill segment per run, for devices
/// that run a segment's delta as dense GEMMs. False, and nothing passed, unless every tile's
/// rows are contiguous and every run has at least `min_run` rows.
pub fn for_contiguous_runs(packed: &[u32], capacity: usize, min_run: usize, mut f: impl FnMut(usize, usize, usize)) -> bool {
    let cap = capacity;
    let tiles = packed[0] as usize;
    let (perm, starts, lens, slots) = (&packed[1..1 + cap], &packed[1 + cap..1 + 2 * cap], &packed[1 + 2 * cap..1 + 3 * cap], &packed[1 + 3 * cap..1 + 4 * cap]);
    let walk = |f: &mut dyn FnMut(usize, usize, usize)| -> bool {
        let mut run: Option<(usize, usize, usize)> = None;
        for i in 0..tiles {
            let (p0, n, slot) = (starts[i] as usize, lens[i] as usize, slots[i] as usize);
            let r0 = perm[p0] as usize;
            if (0..n).any(|j| perm[p0 + j] as usize != r0 + j) {
                return false;
            }
            run = match run {
                Some((a, len, s)) if s == slot && a + len == r0 => Some((a, len + n, s)),
                Some(done) if done.1 < min_run => return false,
                Some(done) => {
                    f(done.0, done.1, done.2);
                    Some((r0, n, slot))
                }
                None => Some((r0, n, slot)),
            };
        }
        match run {
            Some(done) if done.1 < min_run => false,
            Some(done) => {
                f(done.0, done.1, done.2);
                true
            }
            None => true,
        }
    };
    // Checked first, so `f` sees the runs only when all of them qualify.
    walk(&mut |_, _, _| {}) && walk(&mut f)
}

/// Writes `groups` (host slices) into `out` in the device layout, cut into tiles of at most
/// `tile_rows` rows, for a grouping of `capacity` rows (`capacity ≥ rows`; every tile has at
/// least one row, so there are at most `capacity` tiles):
///
/// ```text
/// [0]                      number of tiles T
/// [1 .. 1+C]               perm: perm[p] is the row at position p (positions < adapter_rows)
/// [1+C .. 1+2C]            tile_start[i]: first position of tile i
/// [1+2C .. 1+3C]           tile_len[i] (≤ tile_rows; 0 for i ≥ T)
/// [1+3C .. 1+4C]           tile_slot[i]
/// [1+4C .. 1+5C]           row_pos[r]: the position of row r, NO_POSITION for base rows
/// [1+5C .. 1+6C]           row_slot[r]: the slot of row r, NO_POSITION for base rows
/// ```
/// Positions index the permutation for chunks; for segments the permutation lists the grouped
/// rows in order. Unused tile entries are zero, so a kernel launched over all `C` tiles skips
/// them. The row-indexed tables serve kernels that walk rows rather than tiles (CUDA computes a
/// site's shrink in the RMSNorm that makes its input, one row at a time).
pub fn pack_tiles(groups: &LoraGroups<'_>, tile_rows: usize, capacity: usize, out: &mut Vec<u32>) {
    let c = capacity.max(groups.rows);
    out.clear();
    out.resize(packed_len(c), 0);
    let tile_rows = tile_rows.max(1) as u32;
    let (perm, rest) = out[1..].split_at_mut(c);
    let (tstart, rest) = rest.split_at_mut(c);
    let (tlen, rest) = rest.split_at_mut(c);
    let (tslot, rest) = rest.split_at_mut(c);
    let (row_pos, row_slot) = rest.split_at_mut(c);
    row_pos.fill(NO_POSITION);
    row_slot.fill(NO_POSITION);
    let mut pos = 0u32;
    let mut tiles = 0usize;
    for g in 0..groups.num_groups() {
        let (s, e) = (groups.start[g], groups.end[g]);
        let p0 = match groups.group_rows {
            GroupRows::Contiguous => {
                for (i, row) in (s..e).enumerate() {
                    perm[pos as usize + i] = row;
                }
                let p0 = pos;
                pos += e - s;
                p0
            }
            GroupRows::Permuted(p) => {
                for i in s..e {
                    perm[i as usize] = p[i as usize];
                }
                s
            }
        };
        for q in p0..p0 + (e - s) {
            let row = perm[q as usize] as usize;
            row_pos[row] = q;
            row_slot[row] = groups.slot[g];
        }
        let mut off = 0;
        while off < e - s {
            let n = tile_rows.min(e - s - off);
            tstart[tiles] = p0 + off;
            tlen[tiles] = n;
            tslot[tiles] = groups.slot[g];
            tiles += 1;
            off += n;
        }
    }
    out[0] = tiles as u32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_tiles_cut_groups_and_pad_to_capacity() {
        // Chunks over a permutation: rows [0,1,3,4,5] of slot 0 then [2] of slot 1.
        let perm = [0u32, 1, 3, 4, 5, 2];
        let g = LoraGroups { rows: 6, adapter_rows: 6, group_rows: GroupRows::Permuted(&perm), start: &[0, 5], end: &[5, 6], slot: &[0, 1], packed: &[] };
        let mut out = Vec::new();
        pack_tiles(&g, 2, 8, &mut out);
        assert_eq!(out.len(), packed_len(8));
        assert_eq!(out[0], 4);
        assert_eq!(&out[1..7], &perm);
        assert_eq!(&out[9..13], &[0, 2, 4, 5]);
        assert_eq!(&out[17..21], &[2, 2, 1, 1]);
        assert_eq!(&out[25..29], &[0, 0, 0, 1]);
        assert!(out[13..17].iter().chain(&out[21..25]).chain(&out[29..33]).all(|&v| v == 0));
        // Row-indexed: row r's position in the permutation and its slot; rows 6, 7 unused.
        assert_eq!(&out[33..41], &[0, 1, 5, 2, 3, 4, NO_POSITION, NO_POSITION]);
        assert_eq!(&out[41..49], &[0, 0, 1, 0, 0, 0, NO_POSITION, NO_POSITION]);
        // Segments: rows 2..5 (slot 1) and 7..8 (slot 0); the packed permutation lists them.
        let g = LoraGroups { rows: 9, adapter_rows: 4, group_rows: GroupRows::Contiguous, start: &[2, 7], end: &[5, 8], slot: &[1, 0], packed: &[] };
        pack_tiles(&g, 16, 9, &mut out);
        assert_eq!(out[0], 2);
        assert_eq!(&out[1..5], &[2, 3, 4, 7]);
        assert_eq!(&out[10..12], &[0, 3]);
        assert_eq!(&out[19..21], &[3, 1]);
        assert_eq!(&out[28..30], &[1, 0]);
        // Base rows 0, 1, 5, 6, 8 have no position.
        let n = NO_POSITION;
        assert_eq!(&out[37..46], &[n, n, 0, 1, 2, n, n, 3, n]);
        assert_eq!(&out[46..55], &[n, n, 1, 1, 1, n, n, 0, n]);
    }

    #[test]
    fn packed_groups_give_their_capacity_back() {
        // What the expert LoRA op reads its token rows from: it divided by the tables' count, a
        // second copy of the layout that a new table would silently break.
        let mut out = Vec::new();
        for (rows, cap) in [(1usize, 1usize), (5, 5), (6, 6), (6, 9), (64, 64), (300, 320)] {
            let perm: Vec<u32> = (0..rows as u32).collect();
            let g = LoraGroups { rows, adapter_rows: rows, group_rows: GroupRows::Permuted(&perm), start: &[0], end: &[rows as u32], slot: &[0], packed: &[] };
            pack_tiles(&g, 64, cap, &mut out);
            assert_eq!(packed_capacity(out.len()), cap, "{rows} rows packed for {cap}");
        }
    }

    #[test]
    fn contiguous_runs_merge_a_segments_tiles_and_refuse_short_or_permuted_rows() {
        let runs = |g: &LoraGroups<'_>, min_run: usize| {
            let mut packed = Vec::new();
            pack_tiles(g, 64, g.rows, &mut packed);
            let mut v = Vec::new();
            for_contiguous_runs(&packed, g.rows, min_run, |a, n, s| v.push((a, n, s))).then_some(v)
        };
        // Two prompts of 320 rows (five 64-row tiles each) around 10 base rows.
        let g = LoraGroups { rows: 650, adapter_rows: 640, group_rows: GroupRows::Contiguous, start: &[0, 330], end: &[320, 650], slot: &[0, 1], packed: &[] };
        assert_eq!(runs(&g, 256), Some(vec![(0, 320, 0), (330, 320, 1)]));
        assert_eq!(runs(&g, 321), None);
        // Adjacent prompts of one adapter are one run.
        let g = LoraGroups { rows: 600, adapter_rows: 600, group_rows: GroupRows::Contiguous, start: &[0, 300], end: &[300, 600], slot: &[1, 1], packed: &[] };
        assert_eq!(runs(&g, 256), Some(vec![(0, 600, 1)]));
        // Decode rows grouped by adapter through a permutation are not contiguous.
        let perm: Vec<u32> = (0..300).map(|i| (i * 7) % 300).collect();
        let g = LoraGroups { rows: 300, adapter_rows: 300, group_rows: GroupRows::Permuted(&perm), start: &[0], end: &[300], slot: &[0], packed: &[] };
        assert_eq!(runs(&g, 1), None);
    }
}
