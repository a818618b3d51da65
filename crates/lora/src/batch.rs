//! Per-step LoRA batch metadata in fixed buffers that are reused every step.
//!
//! Two row groupings are built: one over the token rows (for the linears and the embedding)
//! and one over the pruned logits rows (for the LM head). Each holds
//! - `row_slot`: the slot of each row, `-1` for rows without an adapter;
//! - segments: maximal contiguous runs of rows with the same slot (base rows are in none);
//! - `perm`: a stable permutation of the adapter rows sorted by slot (counting sort, so the
//!   order inside a slot is the row order), split into chunks of at most `chunk_size` rows of
//!   one slot. Rows are never moved: chunked kernels read and write through `perm`.
//!
//! Per-(layer, site) ranks and per-slice scalings are not copied here: they vary by layer
//! with `rank_pattern`/`alpha_pattern`, so kernels read them from the pool's slot table; this
//! struct keeps each slot's largest rank (0 = slot unused by this batch).
//!
//! For a device that reads its own copy of the groups (`Device::lora_tile_rows` > 0), both
//! groupings — segments and chunks — are also packed into the device layout
//! (`quiver_kernels::lora::pack_tiles`) every step, whichever a backend will use: a step the
//! device recorded (CUDA graph) with one of them stays right when replayed with the other's data.
//!
//! Buffers only grow (to the largest batch seen); a steady-state step allocates nothing.

use crate::error::{LoraError, Result};
use quiver_kernels::lora::pack_tiles;
use quiver_kernels::{GroupRows, LoraGroups};

pub const DEFAULT_CHUNK_SIZE: usize = 16;

/// Slot assignment and grouping of one set of rows.
#[derive(Default, Debug, Clone)]
pub struct RowGrouping {
    pub row_slot: Vec<i32>,
    pub seg_start: Vec<u32>,
    pub seg_end: Vec<u32>,
    pub seg_slot: Vec<u32>,
    pub perm: Vec<u32>,
    /// Chunk `c` covers `perm[chunk_start[c]..chunk_end[c]]`, all of slot `chunk_slot[c]`.
    pub chunk_start: Vec<u32>,
    pub chunk_end: Vec<u32>,
    pub chunk_slot: Vec<u32>,
    pub max_seg_len: usize,
    /// Rows that have an adapter.
    pub adapter_rows: usize,
    /// Segments and chunks in the device layout (empty when the device reads the host slices).
    pub packed_segments: Vec<u32>,
    pub packed_chunks: Vec<u32>,
    counts: Vec<u32>,
}

impl RowGrouping {
    pub(crate) fn with_capacity(rows: usize, slots: usize) -> Self {
        RowGrouping {
            row_slot: Vec::with_capacity(rows),
            seg_start: Vec::with_capacity(rows),
            seg_end: Vec::with_capacity(rows),
            seg_slot: Vec::with_capacity(rows),
            perm: Vec::with_capacity(rows),
            chunk_start: Vec::with_capacity(rows),
            chunk_end: Vec::with_capacity(rows),
            chunk_slot: Vec::with_capacity(rows),
            counts: vec![0; slots + 1],
            ..Default::default()
        }
    }

    pub fn rows(&self) -> usize {
        self.row_slot.len()
    }
    pub fn num_segments(&self) -> usize {
        self.seg_slot.len()
    }
    pub fn num_chunks(&self) -> usize {
        self.chunk_slot.len()
    }

    /// The segments (contiguous runs of one slot) as the device op's groups.
    pub fn segments(&self) -> LoraGroups<'_> {
        LoraGroups {
            rows: self.rows(),
            adapter_rows: self.adapter_rows,
            group_rows: GroupRows::Contiguous,
            start: &self.seg_start,
            end: &self.seg_end,
            slot: &self.seg_slot,
            packed: &self.packed_segments,
        }
    }

    /// The chunks of the slot-sorted permutation as the device op's groups.
    pub fn chunks(&self) -> LoraGroups<'_> {
        LoraGroups {
            rows: self.rows(),
            adapter_rows: self.adapter_rows,
            group_rows: GroupRows::Permuted(&self.perm),
            start: &self.chunk_start,
            end: &self.chunk_end,
            slot: &self.chunk_slot,
            packed: &self.packed_chunks,
        }
    }

    /// Packs both groupings for a device reading tiles of `tile_rows` (0: nothing to pack).
    fn pack(&mut self, tile_rows: usize) {
        if tile_rows == 0 {
            return;
        }
        let rows = self.rows();
        let mut segs = std::mem::take(&mut self.packed_segments);
        let mut chunks = std::mem::take(&mut self.packed_chunks);
        pack_tiles(&self.segments(), tile_rows, rows, &mut segs);
        pack_tiles(&self.chunks(), tile_rows, rows, &mut chunks);
        self.packed_segments = segs;
        self.packed_chunks = chunks;
    }

    /// The grouped positions of an MoE layer's routing as this grouping's rows: expert e's
    /// positions `offsets[e]..offsets[e+1]` come from token rows `row_of[p]`, and position p
    /// gets slot `row_slot[row_of[p]]·E + e` of the expert sites (none for base rows). So a
    /// group never mixes experts, and within an expert rows of one adapter share its shrink and
    /// expand (segments in prefill, where a request's rows stay together; chunks in decode).
    pub(crate) fn group_experts(&mut self, row_slot: &[i32], offsets: &[u32], row_of: &[u32], num_slots: usize, chunk: usize, tile_rows: usize) {
        let e = offsets.len() - 1;
        self.row_slot.clear();
        for x in 0..e {
            for &r in &row_of[offsets[x] as usize..offsets[x + 1] as usize] {
                let s = row_slot[r as usize];
                self.row_slot.push(if s >= 0 { s * e as i32 + x as i32 } else { -1 });
            }
        }
        self.group(num_slots * e, chunk);
        self.pack(tile_rows);
    }

    /// Derives segments, permutation and chunks from `row_slot`.
    fn group(&mut self, num_slots: usize, chunk: usize) {
        self.seg_start.clear();
        self.seg_end.clear();
        self.seg_slot.clear();
        self.perm.clear();
        self.chunk_start.clear();
        self.chunk_end.clear();
        self.chunk_slot.clear();
        self.max_seg_len = 0;
        let n = self.row_slot.len();
        let mut i = 0;
        while i < n {
            let s = self.row_slot[i];
            let mut j = i + 1;
            while j < n && self.row_slot[j] == s {
                j += 1;
            }
            if s >= 0 {
                self.seg_start.push(i as u32);
                self.seg_end.push(j as u32);
                self.seg_slot.push(s as u32);
                self.max_seg_len = self.max_seg_len.max(j - i);
            }
            i = j;
        }
        // Stable counting sort of adapter rows by slot.
        self.counts.clear();
        self.counts.resize(num_slots + 1, 0);
        for &s in &self.row_slot {
            if s >= 0 {
                self.counts[s as usize + 1] += 1;
            }
        }
        for s in 0..num_slots {
            self.counts[s + 1] += self.counts[s];
        }
        self.adapter_rows = self.counts[num_slots] as usize;
        self.perm.resize(self.adapter_rows, 0);
        for (r, &s) in self.row_slot.iter().enumerate() {
            if s >= 0 {
                let p = &mut self.counts[s as usize];
                self.perm[*p as usize] = r as u32;
                *p += 1;
            }
        }
        // counts[s] is now the end of slot s's group; its start is the previous end.
        let mut start = 0u32;
        for s in 0..num_slots {
            let end = self.counts[s];
            let mut c = start;
            while c < end {
                let e = (c + chunk as u32).min(end);
                self.chunk_start.push(c);
                self.chunk_end.push(e);
                self.chunk_slot.push(s as u32);
                c = e;
            }
            start = end;
        }
    }
}

/// Everything a backend needs about the current batch.
#[derive(Debug, Clone)]
pub struct LoraBatchInfo {
    pub num_slots: usize,
    pub chunk_size: usize,
    pub tokens: RowGrouping,
    pub logits: RowGrouping,
    /// The logits rows the LM head will be called with (token-row indices).
    pub logits_rows: Vec<u32>,
    /// Largest rank of each slot used by this batch; 0 for slots the batch does not use.
    pub slot_rank: Vec<u32>,
    /// Rows per tile of the device's packed groups (0: the device reads the host slices).
    pub tile_rows: usize,
}

impl LoraBatchInfo {
    /// Buffers sized for `max_tokens` rows; larger batches grow them once.
    pub fn with_capacity(num_slots: usize, max_tokens: usize, chunk_size: usize, tile_rows: usize) -> Self {
        LoraBatchInfo {
            tile_rows,
            num_slots,
            chunk_size: chunk_size.max(1),
            tokens: RowGrouping::with_capacity(max_tokens, num_slots),
            logits: RowGrouping::with_capacity(max_tokens, num_slots),
            logits_rows: Vec::with_capacity(max_tokens),
            slot_rank: vec![0; num_slots],
        }
    }

    /// Fills the metadata. `seq_slots[s]` is sequence `s`'s slot (None = base model), its token
    /// rows are `seq_starts[s]..seq_starts[s+1]`; `logits_rows` are the token rows whose
    /// logits are computed; `rank_of(slot)` the slot's largest rank.
    pub fn build(&mut self, seq_slots: &[Option<u32>], seq_starts: &[u32], logits_rows: &[u32], rank_of: impl Fn(usize) -> u32) -> Result<()> {
        if seq_starts.len() != seq_slots.len() + 1 {
            return Err(LoraError::Invalid(format!(
                "seq_starts has {} entries for {} sequences (expected one more than the sequences)",
                seq_starts.len(),
                seq_slots.len()
            )));
        }
        if seq_starts.windows(2).any(|w| w[0] > w[1]) || seq_starts.first().is_some_and(|&s| s != 0) {
            return Err(LoraError::Invalid("seq_starts must start at 0 and be non-decreasing".into()));
        }
        let rows = *seq_starts.last().unwrap_or(&0) as usize;
        self.slot_rank.iter_mut().for_each(|r| *r = 0);
        self.tokens.row_slot.clear();
        for (s, slot) in seq_slots.iter().enumerate() {
            let n = (seq_starts[s + 1] - seq_starts[s]) as usize;
            let v = match slot {
                Some(w) if (*w as usize) < self.num_slots => {
                    self.slot_rank[*w as usize] = rank_of(*w as usize);
                    *w as i32
                }
                Some(w) => return Err(LoraError::Invalid(format!("slot {w} out of range ({} slots)", self.num_slots))),
                None => -1,
            };
            for _ in 0..n {
                self.tokens.row_slot.push(v);
            }
        }
        self.logits_rows.clear();
        self.logits.row_slot.clear();
        for &r in logits_rows {
            if r as usize >= rows {
                return Err(LoraError::Invalid(format!("logits row {r} is outside the batch's {rows} token rows")));
            }
            self.logits_rows.push(r);
            self.logits.row_slot.push(self.tokens.row_slot[r as usize]);
        }
        self.tokens.group(self.num_slots, self.chunk_size);
        self.logits.group(self.num_slots, self.chunk_size);
        self.tokens.pack(self.tile_rows);
        self.logits.pack(self.tile_rows);
        Ok(())
    }

    /// Whether any row has an adapter.
    pub fn is_active(&self) -> bool {
        self.tokens.adapter_rows > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_example_permutation_and_chunks() {
        // REFERENCE §1.4: request slots [0,1,0], lengths [2,1,3], chunk 3.
        let mut b = LoraBatchInfo::with_capacity(2, 8, 3, 0);
        b.build(&[Some(0), Some(1), Some(0)], &[0, 2, 3, 6], &[1, 2, 5], |_| 4).unwrap();
        assert_eq!(b.tokens.perm, vec![0, 1, 3, 4, 5, 2]);
        assert_eq!(b.tokens.chunk_start, vec![0, 3, 5]);
        assert_eq!(b.tokens.chunk_end, vec![3, 5, 6]);
        assert_eq!(b.tokens.chunk_slot, vec![0, 0, 1]);
        assert_eq!(b.tokens.seg_start, vec![0, 2, 3]);
        assert_eq!(b.tokens.seg_slot, vec![0, 1, 0]);
        assert_eq!(b.tokens.max_seg_len, 3);
        assert_eq!(b.logits.row_slot, vec![0, 1, 0]);
    }

    #[test]
    fn base_rows_are_in_no_segment() {
        let mut b = LoraBatchInfo::with_capacity(2, 8, 16, 0);
        b.build(&[None, Some(1), None], &[0, 2, 3, 5], &[4], |_| 2).unwrap();
        assert_eq!(b.tokens.seg_start, vec![2]);
        assert_eq!(b.tokens.perm, vec![2]);
        assert_eq!(b.logits.adapter_rows, 0);
        assert!(b.is_active());
        b.build(&[None], &[0, 3], &[2], |_| 2).unwrap();
        assert!(!b.is_active());
    }

    #[test]
    fn bad_seq_starts_are_errors() {
        let mut b = LoraBatchInfo::with_capacity(2, 8, 16, 0);
        assert!(b.build(&[None], &[0], &[], |_| 0).is_err());
        assert!(b.build(&[None, None], &[0, 3, 2], &[], |_| 0).is_err());
        assert!(b.build(&[None], &[0, 3], &[3], |_| 0).is_err());
    }
}
