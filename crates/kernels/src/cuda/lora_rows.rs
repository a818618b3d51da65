//! A LoRA site's whole delta in one launch for decode-sized steps (kernel `lora_rows_*` in
//! `lora_rows.cu`): each row is a cluster of blocks that computes its shrink `t = x·Aᵀ`
//! (partial sums swapped through distributed shared memory, added in block order) and then its
//! expand `s_j·t·Bᵀ`, into the residual or into a delta buffer the projection's epilogue adds.
//!
//! Why: at 1–128 rows a site's LoRA is a few hundred kilobytes of adapter and a few megabytes of
//! activations, so the separate shrink (split over the inputs, a fix-up pass for the partials)
//! and expand were two launches of mostly latency, ~9 µs a site at one row and ~16 µs at 16
//! rows on an H100 against ~1–5 µs of bytes; this launch takes ~7 / ~8 µs there (session 21).
//! Rows are read in place (the row-indexed slot table of `pack_tiles`), so the grid is
//! `rows × cluster` whatever the adapters, and a recorded step replays under any mix. Each row
//! reads its slot's A and Bᵀ (from L2 when rows share an adapter): by 64 rows that is ~40 MB a
//! site of the 8B shape, and at 128 rows the tiled kernels win, so the kernel runs in steps of
//! up to [`DEFAULT_MAX_ROWS`] (`QUIVER_CUDA_LORA_ROWS_MAX`). Sharing each load between a
//! cluster's rows of one adapter was tried twice and dropped: up to four rows a cluster with x
//! staged in shared memory measured 2–3× slower per site at 16–128 rows (session 21); with the
//! rows' inputs in registers (a sub-tile of the grouping per cluster, session 22, H100) one
//! adapter at 64 rows went 20.8 → 19.7 µs a site but 16 rows 8.0 → 9.4, 16 adapters at 16 rows
//! 11.0 → 17.8 and 64 adapters at 64 rows 29.9 → 48.2 (four rows' registers cost occupancy),
//! and the step cost was no better anywhere (64 rows, one adapter: +20.9% → +20.3%). Re-reading
//! the adapter from L2 is not what bounds this kernel.

use super::lora::LoraSite;
use super::*;
use crate::lora::LoraCall;

/// Steps of up to this many rows take the kernel by default: 16 and 64 rows measured 3.9 and
/// 4.1 points of step time cheaper than the tiled shrink and expand, 128 rows 8.4 points dearer
/// (8B shape, one rank-16 adapter, H100, session 21).
pub(super) const DEFAULT_MAX_ROWS: usize = 64;
/// Blocks per row, one cluster (`LRW_CL`).
const CLUSTER: u32 = 8;
/// Threads per block (`LRW_THREADS`).
const THREADS: u32 = 256;
/// Widest shrink the kernel holds (`LRW_MAX_W`: three slices of rank 64).
const MAX_WIDTH: usize = 192;
/// Widest output: every row reads its slot's whole Bᵀ, so an LM head (a vocabulary of columns,
/// megabytes of Bᵀ a row) keeps the tiled expand, which reads it once per tile.
const MAX_OUT: usize = 65536;

impl CudaDevice {
    /// The `lora_rows` kernel for `call` over `rows` rows, or `None` when the site does not fit
    /// it (the caller takes the shrink and the expand).
    pub(super) fn lora_rows_kernel(&self, call: &LoraCall<'_>, rows: usize) -> Option<sys::CUfunction> {
        let sh = call.shape();
        let cl = CLUSTER as usize;
        if rows == 0 || rows > self.lora_rows_max || call.groups.rows != rows || !sh.in_dim.is_multiple_of(8 * cl) || sh.shrink_width() > MAX_WIDTH || sh.out_dim() > MAX_OUT {
            return None;
        }
        // 16-byte chunks per lane of a block's slice of the inputs.
        match (sh.in_dim / cl / 8).div_ceil(32) {
            1 => Some(self.k.lora_rows[0]),
            2 => Some(self.k.lora_rows[1]),
            3 | 4 => Some(self.k.lora_rows[2]),
            5..=8 => Some(self.k.lora_rows[3]),
            _ => None,
        }
    }

    /// `call`'s delta for the `rows` rows of `x`, added into `y` (`add`) or written over it
    /// (`rows × out` floats; base rows get zeros). `f` from [`Self::lora_rows_kernel`].
    pub(super) fn lora_rows_launch(&self, f: sys::CUfunction, call: &LoraCall<'_>, x: &Tensor, rows: usize, y: u64, add: bool) {
        self.bind();
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, call) else {
            if !add {
                let stream = self.current_stream();
                // SAFETY: `y` is a live buffer of this context of at least rows × out floats.
                unsafe { result::memset_d8_async(y, 0, rows * call.shape().out_dim() * 4, stream) }.unwrap_or_else(|e| panic!("LoRA delta on {}: {e:?}", self.name));
            }
            return;
        };
        drop(st);
        self.lora_rows_launch_at(f, &site, buf(x), rows, y, add);
    }

    /// [`Self::lora_rows_launch`] for a site already resolved, its input rows at `x`.
    pub(super) fn lora_rows_launch_at(&self, f: sys::CUfunction, site: &LoraSite, x: u64, rows: usize, y: u64, add: bool) {
        let sh = site.shape;
        launch!(self, f, (rows as u32 * CLUSTER, 1, 1), (THREADS, 1, 1), smem = 0, cluster = CLUSTER;
            x, site.a, site.b, site.gp, site.cap as i32, site.ranks, site.scal, sh.n_slices as i32, sh.max_rank as i32, sh.in_dim as i32, sh.b_ld as i32,
            site.off(1) as i32, site.off(2) as i32, sh.out_dim() as i32, add as i32, y);
        self.mark("lora rows");
    }
}
