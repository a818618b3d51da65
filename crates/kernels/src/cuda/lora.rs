//! LoRA on CUDA: the pool's slot buffers in device memory (bf16 A and Bᵀ, the rank / scaling
//! table mirrored as u32 + f32), and `Device::lora_apply` as two launches over the tiles staged
//! with the batch (kernels in `lora.cu`):
//!
//! 1. the shrink `t = x · Aᵀ` for each tile's rows, its inputs split into 256-wide pieces over
//!    blocks so that even a one-row step streams the adapter from ~100 SMs (the last block of
//!    each group adds the split partials in a fixed order): for steps of fewer than 64 rows
//!    (decode) `lora_shrink`, a warp per A row; from 64 rows `lora_shrink_mma` on tensor cores,
//!    a tile's ≤ 64 rows × 32 A rows per block; `lora_shrink_ids` for the embedding;
//! 2. `lora_expand`: `y += s_j · t · Bᵀ` per slice, the scaling and the add into
//!    the base output in one pass.
//!
//! Which kernels run and their grids depend on the row count and the site only, never on the
//! adapters, and a step being recorded launches every possible tile (the unused ones exit at
//! once), so a CUDA graph stays valid whatever adapters occupy the slots and however rows map to
//! them; an eager step launches just the tiles it has.

use super::*;
use crate::lora::{packed_len, LoraCall, LoraSiteBuffers, LoraSiteShape, LoraStorage, LoraTable, LoraX, MAX_SLICES};

/// Most rows per tile (`LORA_TILE` in lora.cu): a prefill segment's tiles feed the tensor-core
/// shrink 64 rows at a time; decode chunks are shorter (the chunk size).
pub(super) const TILE_ROWS: usize = 64;
/// Rows whose expand coefficients sit in shared memory at a time (`LORA_SUB`).
const SUB_ROWS: usize = 16;
/// A rows per block of the small shrink (`LORA_AR`), of the tensor-core one (`LSM_BN`), and the
/// expand's columns per block.
const SHRINK_ROWS: usize = 8;
/// Split-k counters per (row, 8 columns) of a step: enough for both shrinks' (tile, column
/// group) pairs.
fn counters_len(rows: usize, width: usize) -> usize {
    rows * width.div_ceil(SHRINK_ROWS)
}
const SHRINK_MMA_COLS: usize = 32;
const EXPAND_COLS_PER_BLOCK: usize = 256;
/// Steps of at least this many rows take the tensor-core shrink (a grouping's row count, so the
/// choice is the same for every step of one shape).
const MMA_MIN_ROWS: usize = 64;
/// Inputs per split of both shrinks: a 256-wide sweep of a warp's 16-byte vectors, four stages
/// of the tensor-core one. One row's 4096-input A row is then 16 blocks of work.
const SPLIT_K: usize = 256;
/// Dynamic shared memory the expand may use (`SUB_ROWS × n·R` floats): enough for a 3-slice
/// site of rank 512.
pub(super) const EXPAND_MAX_SMEM: usize = SUB_ROWS * 3 * 512 * 4;

/// How a shrink splits `in_dim` inputs: (inputs per split, splits). Widths that are not a
/// multiple of 8 (the scalar path) are not split.
fn split_k(in_dim: usize) -> (usize, usize) {
    if in_dim.is_multiple_of(8) {
        (SPLIT_K, in_dim.div_ceil(SPLIT_K))
    } else {
        (in_dim, 1)
    }
}

fn dev_buf(s: &LoraStorage) -> &DevBuf {
    match s {
        LoraStorage::Cuda(b) => b,
        _ => panic!("CUDA LoRA op given LoRA storage of another device (allocate it with the CUDA device)"),
    }
}

/// Largest shrink row width and split count of any site allocated so far: the scratch a step's
/// LoRA calls need (sized in `stage_batch`, before a step may be recorded): the final sums plus
/// one region per split, `[1 + splits][rows][width]`.
#[derive(Clone, Copy, Default)]
pub(super) struct LoraGeometry {
    pub(super) width: usize,
    pub(super) splits: usize,
}

impl CudaDevice {
    pub(super) fn lora_alloc_site_impl(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        let mk = |elems: usize| LoraStorage::Cuda(DevBuf::zeroed(&self.ctx, elems * 2).unwrap_or_else(|e| panic!("LoRA pool on {}: {e:#}", self.name)));
        let smem = SUB_ROWS * shape.shrink_width() * 4;
        assert!(smem <= EXPAND_MAX_SMEM, "LoRA pool rank {} is too large for the CUDA expand (at most {} for a 3-slice site)", shape.max_rank, EXPAND_MAX_SMEM / (SUB_ROWS * 3 * 4));
        let mut g = self.lora_geom.lock().unwrap();
        g.width = g.width.max(shape.shrink_width());
        g.splits = g.splits.max(split_k(shape.in_dim).1);
        LoraSiteBuffers { a: mk(shape.slots * shape.a_slot_len()), b: mk(shape.slots * shape.b_slot_len()), shape }
    }

    pub(super) fn lora_alloc_table_impl(&self, entries: usize, slots: usize) -> LoraTable {
        let mut t = LoraTable::host(entries, slots);
        let words = entries * slots * (1 + MAX_SLICES);
        t.device = Some(LoraStorage::Cuda(DevBuf::zeroed(&self.ctx, words * 4).unwrap_or_else(|e| panic!("LoRA table on {}: {e:#}", self.name))));
        t
    }

    /// Converts the slot to bf16 on the host and copies it over on the compute stream, so work
    /// queued before (a step still reading the old adapter) finishes first.
    pub(super) fn lora_write_slot_impl(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        self.bind();
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        let mut a = vec![0.0f32; al];
        let mut b = vec![0.0f32; bl];
        fill(&mut a, &mut b);
        let to_bf16 = |v: &[f32]| v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<half::bf16>>();
        self.htod(dev_buf(&buf.a).ptr + (slot * al * 2) as u64, &to_bf16(&a));
        self.htod(dev_buf(&buf.b).ptr + (slot * bl * 2) as u64, &to_bf16(&b));
    }

    pub(super) fn lora_sync_table_impl(&self, table: &mut LoraTable) {
        self.bind();
        let Some(d) = &table.device else { return };
        let d = dev_buf(d).ptr;
        self.htod(d, &table.ranks);
        self.htod(d + (table.ranks.len() * 4) as u64, &table.scalings);
    }

    /// Sizes the shrink scratch for a step of `rows` token rows that runs LoRA kernels.
    pub(super) fn lora_reserve(&self, st: &mut State, rows: usize) {
        let g = *self.lora_geom.lock().unwrap();
        self.grow(&mut st.lora_t, (1 + g.splits) * rows * g.width.max(1) * 4);
        self.grow(&mut st.lora_counters, counters_len(rows, g.width.max(1)) * 4);
    }

    pub(super) fn lora_apply_impl(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        self.bind();
        let g = &call.groups;
        let cap = g.rows;
        let recording = self.recording.load(std::sync::atomic::Ordering::Relaxed);
        if cap == 0 || (!recording && g.adapter_rows == 0) {
            return;
        }
        assert!(g.packed.len() == packed_len(cap), "CUDA lora_apply needs the groups packed for {cap} rows (LoraGroups::packed)");
        let sh = call.shape();
        let (a, b) = (dev_buf(&call.buffers.a).ptr, dev_buf(&call.buffers.b).ptr);
        let table = dev_buf(call.table.device.as_ref().expect("a CUDA LoRA table has a device mirror")).ptr;
        let s = call.table.slots;
        let ranks = table + (4 * call.entry * s) as u64;
        let scal = table + (4 * (call.table.entries * s + call.entry * s * MAX_SLICES)) as u64;
        let w = sh.shrink_width();
        let mut st = self.state.lock().unwrap();
        let gp = self.meta_ptr(&mut st, g.packed);
        // Recording: every possible tile (the data decides which are empty); eager: those there are.
        let tiles = if recording { cap } else { g.packed[0] as usize };
        if tiles == 0 {
            return;
        }
        match x {
            LoraX::Dense(x) => {
                let (klen, splits) = split_k(sh.in_dim);
                self.lora_scratch(&mut st, (1 + splits) * cap * w, counters_len(cap, w), recording);
                let (t, counters) = (st.lora_t.ptr, st.lora_counters.ptr);
                if cap >= MMA_MIN_ROWS && sh.in_dim.is_multiple_of(64) {
                    launch!(self, self.k.lora_shrink_mma, (tiles as u32, w.div_ceil(SHRINK_MMA_COLS) as u32, splits as u32), (128, 1, 1);
                        buf(x), a, gp, cap as i32, ranks, sh.n_slices as i32, sh.max_rank as i32, sh.in_dim as i32, klen as i32, t, counters);
                } else {
                    launch!(self, self.k.lora_shrink, (tiles as u32, w.div_ceil(SHRINK_ROWS) as u32, splits as u32), (256, 1, 1);
                        buf(x), a, gp, cap as i32, ranks, sh.n_slices as i32, sh.max_rank as i32, sh.in_dim as i32, klen as i32, t, counters);
                }
            }
            LoraX::TokenIds(ids) => {
                self.lora_scratch(&mut st, cap * w, 0, recording);
                let idp = self.meta_ptr(&mut st, ids);
                launch!(self, self.k.lora_shrink_ids, (tiles as u32, 1, 1), (256, 1, 1);
                    idp, a, gp, cap as i32, ranks, sh.max_rank as i32, sh.in_dim as i32, st.lora_t.ptr);
            }
        }
        self.mark("lora shrink");
        let out = sh.out_dim();
        let off = |j: usize| if j < sh.n_slices { sh.offsets[j] } else { out };
        let smem = (SUB_ROWS * w * 4) as u32;
        launch!(self, self.k.lora_expand, (tiles as u32, out.div_ceil(EXPAND_COLS_PER_BLOCK) as u32, 1), (256, 1, 1), smem = smem;
            st.lora_t.ptr, b, gp, cap as i32, ranks, scal, sh.n_slices as i32, sh.max_rank as i32, sh.b_ld as i32, off(1) as i32, off(2) as i32, out as i32, buf(y));
        self.mark("lora expand");
    }

    /// Makes sure the shrink scratch holds `floats` and the split counters `counters` words; while
    /// recording they must already (growing frees the old buffer, which synchronizes: not allowed
    /// inside a capture).
    fn lora_scratch(&self, st: &mut State, floats: usize, counters: usize, recording: bool) {
        if st.lora_t.bytes < floats * 4 || st.lora_counters.bytes < counters * 4 {
            assert!(!recording, "LoRA scratch too small while recording a step: stage_batch sizes it");
            self.grow(&mut st.lora_t, floats * 4);
            self.grow(&mut st.lora_counters, counters * 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::split_k;

    #[test]
    fn splits_cover_the_inputs_in_whole_sweeps() {
        for in_dim in [8usize, 64, 576, 1000, 1024, 1536, 2048, 4096, 14336] {
            let (klen, splits) = split_k(in_dim);
            assert!(splits * klen >= in_dim && (splits - 1) * klen < in_dim, "{in_dim}: {klen} x {splits}");
            assert!(klen.is_multiple_of(256), "{in_dim}: {klen} x {splits}");
        }
        assert_eq!(split_k(20), (20, 1));
    }
}
