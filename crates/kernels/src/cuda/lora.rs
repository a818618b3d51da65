//! LoRA on CUDA: the pool's slot buffers in device memory (bf16 A and Bᵀ, the rank / scaling
//! table mirrored as u32 + f32), and `Device::lora_apply` as two launches over the tiles staged
//! with the batch (kernels in `lora.cu`):
//!
//! 1. the shrink `t = x · Aᵀ` for each tile's rows, its inputs split into 256-wide pieces over
//!    blocks so that even a one-row step streams the adapter from ~100 SMs (the last block of
//!    each group adds the split partials in a fixed order): for steps of fewer than 64 rows
//!    (decode) `lora_shrink`, a warp per A row, which merges splits when the step has many
//!    tiles (many adapters) so its blocks do more than one load each; from 64 rows
//!    `lora_shrink_mma` on tensor cores, a tile's ≤ 64 rows × 32 A rows per block, tiles of
//!    at most 4 rows dotted by warps instead; `lora_shrink_ids` for the embedding;
//! 2. `lora_expand`: `y += s_j · t · Bᵀ` per slice, the scaling and the add into
//!    the base output in one pass, every warp on its own columns of all the tile's rows.
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
/// Rows of expand coefficients the shared memory must hold for any rank the pool allows (the
/// pool refuses ranks past it; `expand_rows` keeps within `EXPAND_MAX_SMEM`).
pub(super) const SUB_ROWS: usize = 16;
/// A rows per block of the small shrink (a warp each).
const SHRINK_ROWS: usize = 8;
/// Split-k counters per (row, 8 columns) of a step: enough for both shrinks' (tile, column
/// group) pairs.
fn counters_len(rows: usize, width: usize) -> usize {
    rows * width.div_ceil(SHRINK_ROWS)
}
/// Blocks of the small shrink (`LORA_SHRINK_BLOCKS`: two 256-thread blocks per SM of an H200,
/// one wave) and of the tensor-core one (three 128-thread blocks of 148 registers per SM).
const SHRINK_BLOCKS: usize = 264;
const SHRINK_MMA_BLOCKS: usize = 396;
/// A rows per block of the tensor-core shrink (`LSM_BN`).
const SHRINK_MMA_COLS: usize = 32;
/// The expand's columns per block (`LEX_COLS`: 128 threads × 8) and its threads.
const EXPAND_COLS_PER_BLOCK: usize = 1024;
const EXPAND_THREADS: u32 = 128;
/// Rows of a tile per expand work item in steps of fewer than [`EXPAND_LONG_MIN_ROWS`] rows
/// (decode: a 64-row tile spreads over 16 blocks per column range), and at most in longer ones
/// (prefill), whose items share each Bᵀ load and each item's fixed costs (finding its tile,
/// loading its coefficients) over more rows: with 4-row items a 2048-row segment reloaded Bᵀ
/// once per 4 rows, as many bytes as the output it updates.
const EXPAND_ROWS_PER_BLOCK: usize = 4;
const EXPAND_LONG_ROWS: usize = 32;
const EXPAND_LONG_MIN_ROWS: usize = 1024;

/// Rows per expand work item for a step of `cap` rows over a site of shrink width `w` (its
/// coefficients for those rows sit in shared memory).
fn expand_rows(cap: usize, w: usize) -> usize {
    if cap < EXPAND_LONG_MIN_ROWS {
        EXPAND_ROWS_PER_BLOCK
    } else {
        (EXPAND_MAX_SMEM / (4 * w.max(1))).clamp(EXPAND_ROWS_PER_BLOCK, EXPAND_LONG_ROWS)
    }
}
/// Row blocks of a recorded step's LoRA launches, each looping over tiles (shrinks) or work
/// items (the expand) of the step replayed: a grid sized for every possible tile (256 at 256
/// rows, times the other dimensions) spent more on dispatching empty blocks than on the work.
const RECORDED_TILE_BLOCKS: usize = 64;
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
pub(super) fn split_k(in_dim: usize) -> (usize, usize) {
    if in_dim.is_multiple_of(8) {
        (SPLIT_K, in_dim.div_ceil(SPLIT_K))
    } else {
        (in_dim, 1)
    }
}

pub(super) fn dev_buf(s: &LoraStorage) -> &DevBuf {
    match s {
        LoraStorage::Cuda(b) => b,
        _ => panic!("CUDA LoRA op given LoRA storage of another device (allocate it with the CUDA device)"),
    }
}

/// A LoRA call's device addresses (see [`CudaDevice::lora_site`]).
#[derive(Clone, Copy)]
pub(super) struct LoraSite {
    pub(super) shape: LoraSiteShape,
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) ranks: u64,
    pub(super) scal: u64,
    pub(super) gp: u64,
    pub(super) cap: usize,
    pub(super) recording: bool,
}

/// Inputs per piece of the single-row GEMV's own shrink before it is widened to fit the grid:
/// one 256-input sweep of a warp's 16-byte vectors, so a piece is one load latency.
const GEMV_LORA_SPLIT: usize = 256;

/// The LoRA half of a fused single-row GEMV launch (gemv.cu `GemvLora`).
pub(super) struct GemvLoraArgs {
    pub(super) t: u64,
    pub(super) ctr: u64,
    pub(super) site: LoraSite,
    pub(super) gy: usize,
    pub(super) splits: usize,
    pub(super) kc: usize,
    /// t is already in place (computed in the RMSNorm before, `lora_ahead.rs`): the GEMV
    /// computes no pieces and waits for nothing.
    pub(super) ahead: bool,
}

/// A launched shrink, for the consumer of its delta (the expand, or a GEMV that adds it):
/// device addresses of the packed groups, the shrink's sums, the slot buffers' Bᵀ and this
/// site's rank / scaling rows.
pub(super) struct LoraLaunch {
    pub(super) shape: LoraSiteShape,
    pub(super) gp: u64,
    pub(super) cap: usize,
    /// The expand's item blocks.
    pub(super) items: usize,
    pub(super) t: u64,
    pub(super) b: u64,
    pub(super) ranks: u64,
    pub(super) scal: u64,
}

/// Start of slice `j`'s columns (the output width for slices the site does not have).
fn slice_start(shape: &LoraSiteShape, j: usize) -> usize {
    if j < shape.n_slices {
        shape.offsets[j]
    } else {
        shape.out_dim()
    }
}

impl LoraLaunch {
    pub(super) fn off(&self, j: usize) -> usize {
        slice_start(&self.shape, j)
    }
}

impl LoraSite {
    pub(super) fn off(&self, j: usize) -> usize {
        slice_start(&self.shape, j)
    }
}

/// The device addresses of a site's slot buffers and of its `entry` row of `table`, over the
/// packed groups at `gp` (`cap` rows).
pub(super) fn lora_site_at(buffers: &LoraSiteBuffers, table: &LoraTable, entry: usize, gp: u64, cap: usize, recording: bool) -> LoraSite {
    let t = dev_buf(table.device.as_ref().expect("a CUDA LoRA table has a device mirror")).ptr;
    let s = table.slots;
    LoraSite {
        shape: buffers.shape,
        a: dev_buf(&buffers.a).ptr,
        b: dev_buf(&buffers.b).ptr,
        ranks: t + (4 * entry * s) as u64,
        scal: t + (4 * (table.entries * s + entry * s * MAX_SLICES)) as u64,
        gp,
        cap,
        recording,
    }
}

/// Tile (or work-item) blocks of a launch over groups of `cap` rows whose count the host does
/// not read: each block loops over the tiles the device's groups hold.
pub(super) fn fixed_blocks(cap: usize) -> usize {
    cap.min(RECORDED_TILE_BLOCKS)
}

/// A second stream for LoRA shrinks: the shrink of a site needs only the site's input, like
/// the site's base GEMM, so it runs beside the GEMM (forked after the work queued so far, which
/// also orders it after the previous site's expand, the last reader of the shrink scratch) and
/// the expand waits for both; a recorded step captures the fork and the join. Its latency comes
/// off the step's critical path. Off with `QUIVER_CUDA_LORA_SIDE_STREAM=0` and while profiling
/// (the profiler times one stream).
pub(super) struct SideStream {
    pub(super) stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
}

impl SideStream {
    pub(super) fn new(profiling: bool) -> anyhow::Result<Option<SideStream>> {
        if profiling || std::env::var_os("QUIVER_CUDA_LORA_SIDE_STREAM").is_some_and(|v| v == "0") {
            return Ok(None);
        }
        let ev = || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).context("creating a CUDA event");
        Ok(Some(SideStream { stream: result::stream::create(result::stream::StreamKind::NonBlocking).context("creating the LoRA side stream")?, fork: ev()?, join: ev()? }))
    }
}

/// Largest shrink row width and split count of any site allocated so far: the scratch a step's
/// LoRA calls need (sized in `stage_batch`, before a step may be recorded): the final sums plus
/// one region per split, `[1 + splits][rows][width]`.
#[derive(Clone, Copy, Default)]
pub(super) struct LoraGeometry {
    pub(super) width: usize,
    pub(super) splits: usize,
    /// Widest site output: the delta buffer of steps whose expand runs beside the GEMM.
    pub(super) out: usize,
    /// Routed positions per token row of the MoE layers (their top-k; 0 without experts): an
    /// expert site's LoRA runs over `rows × pairs_per_row` positions (`lora_experts.rs`).
    pub(super) pairs_per_row: usize,
}

/// Where a one-row step computes a site's LoRA delta.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Row1Lora {
    /// In the single-row GEMV (`fold`, the default).
    Fold,
    /// o_proj's and down_proj's beside the GEMV, into the residual (`beside`); the others folded.
    BesideResidual,
    /// Every site's beside the GEMV (`rows`), its epilogue after it.
    Beside,
}

/// Steps of at most this many rows compute a site's whole delta beside its GEMM (on the side
/// stream, into the residual or a delta buffer the epilogue adds); longer ones expand into the
/// output after the GEMM (a `rows × out` delta buffer would be 235 MB at a 2048-row prefill).
pub(super) const DELTA_BESIDE_MAX_ROWS: usize = 128;

impl CudaDevice {
    /// Sizes the shrink scratch (and the expert sites' groups) for a step of `rows` token rows
    /// that runs LoRA kernels.
    pub(super) fn lora_reserve(&self, st: &mut State, rows: usize) {
        let g = *self.lora_geom.lock().unwrap();
        // Expert sites run over a row per routed position.
        let cap = rows * g.pairs_per_row.max(1);
        self.grow(&mut st.lora_t, (1 + g.splits) * cap * g.width.max(1) * 4);
        self.grow(&mut st.lora_counters, counters_len(cap, g.width.max(1)) * 4);
        if g.pairs_per_row > 0 {
            self.grow(&mut st.lora_expert_groups, super::lora_experts::expert_groups_words(cap) * 4);
        }
        if rows <= DELTA_BESIDE_MAX_ROWS {
            self.grow(&mut st.lora_delta, rows * g.out.max(1) * 4);
        }
        self.lora_ahead_reserve(st, rows, g.width);
    }

    /// A zeroed `rows × out` delta buffer, zeroed on the side stream (call inside
    /// [`Self::beside`]); sized by `lora_reserve` before a step may be recorded.
    pub(super) fn lora_delta_zeroed(&self, rows: usize, out: usize) -> u64 {
        let d = self.lora_delta(rows, out);
        // SAFETY: a live buffer of this context, at least that long; a stream of this context.
        unsafe { result::memset_d8_async(d, 0, rows * out * 4, self.current_stream()) }.unwrap_or_else(|e| panic!("LoRA delta on {}: {e:?}", self.name));
        d
    }

    /// The `rows × out` delta buffer as it is (for a kernel that writes all of it).
    pub(super) fn lora_delta(&self, rows: usize, out: usize) -> u64 {
        let st = self.state.lock().unwrap();
        assert!(st.lora_delta.bytes >= rows * out * 4, "LoRA delta buffer too small: stage_batch sizes it");
        st.lora_delta.ptr
    }

    /// The stream launches go to now: the side stream inside [`Self::beside`], else the
    /// compute stream.
    pub(super) fn current_stream(&self) -> sys::CUstream {
        self.lora_side.as_ref().filter(|_| self.on_side.load(std::sync::atomic::Ordering::Relaxed)).map_or(self.stream, |s| s.stream)
    }

    /// Runs `f`'s launches on the side stream (if there is one), forked after the work queued
    /// so far; [`Self::join_side`] makes the compute stream wait for them. True when it was
    /// beside. A bf16 shadow of a GEMM input made before stays valid: side work never writes a
    /// GEMM input.
    pub(super) fn beside<R>(&self, f: impl FnOnce() -> R) -> (R, bool) {
        let before = self.touches.load(std::sync::atomic::Ordering::Relaxed);
        let Some(sd) = &self.lora_side else {
            // Inline on the compute stream (no side stream: profiling): the shadow stays valid
            // all the same.
            let r = f();
            self.keep_shadow_from(before);
            return (r, false);
        };
        let fail = |e: cudarc::driver::DriverError| -> ! { panic!("LoRA side stream on {}: {e:?}", self.name) };
        // SAFETY: events and streams of this context.
        unsafe {
            result::event::record(sd.fork, self.stream).unwrap_or_else(|e| fail(e));
            result::stream::wait_event(sd.stream, sd.fork, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail(e));
        }
        self.on_side.store(true, std::sync::atomic::Ordering::Relaxed);
        let r = f();
        self.on_side.store(false, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: an event of this context on its side stream.
        unsafe { result::event::record(sd.join, sd.stream) }.unwrap_or_else(|e| fail(e));
        self.keep_shadow_from(before);
        (r, true)
    }

    /// A bf16 shadow current at launch count `before` stays current: what ran since was LoRA
    /// work, which never writes a GEMM input.
    fn keep_shadow_from(&self, before: u64) {
        let mut st = self.state.lock().unwrap();
        if let Some((p, len, n, ld)) = st.shadow {
            if n == before {
                st.shadow = Some((p, len, self.touches.load(std::sync::atomic::Ordering::Relaxed), ld));
            }
        }
    }

    /// Makes the compute stream wait for the work of the last [`Self::beside`].
    pub(super) fn join_side(&self) {
        if let Some(sd) = &self.lora_side {
            // SAFETY: events and streams of this context.
            unsafe { result::stream::wait_event(self.stream, sd.join, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }.unwrap_or_else(|e| panic!("LoRA side stream on {}: {e:?}", self.name));
        }
    }

    pub(super) fn lora_apply_impl(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        if let LoraX::Dense(xd) = x {
            let rows = call.groups.rows;
            if let Some(f) = self.lora_rows_kernel(call, rows) {
                return self.lora_rows_launch(f, call, xd, rows, buf(y), true);
            }
        }
        if let Some(l) = self.lora_shrink_launch(call, x) {
            self.lora_expand_launch(&l, buf(y));
        }
    }

    /// What every LoRA launch of `call` needs: the packed groups on the device, the slot
    /// buffers and this site's table rows; `None` when the call has nothing to add.
    pub(super) fn lora_site(&self, st: &mut State, call: &LoraCall<'_>) -> Option<LoraSite> {
        let g = &call.groups;
        let cap = g.rows;
        let recording = self.recording.load(std::sync::atomic::Ordering::Relaxed);
        if cap == 0 || (!recording && g.adapter_rows == 0) {
            return None;
        }
        assert!(g.packed.len() == packed_len(cap), "CUDA lora_apply needs the groups packed for {cap} rows (LoraGroups::packed)");
        let gp = self.meta_ptr(st, g.packed);
        Some(lora_site_at(call.buffers, call.table, call.entry, gp, cap, recording))
    }

    /// The LoRA arguments of a single-row GEMV over `blocks` blocks that computes the shrink of
    /// `call` itself (gemv.cu: `GemvLora`): its pieces, 8 A rows × `kc` inputs each, as few
    /// splits of the inputs as keep the pieces ≤ `blocks` (every piece needs a block) and each
    /// piece a couple of 16-byte loads a lane. `None`: nothing to add, or more A row groups than
    /// blocks (the caller takes the separate kernels).
    pub(super) fn lora_gemv_args(&self, call: &LoraCall<'_>, blocks: usize) -> Option<Option<GemvLoraArgs>> {
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, call) else { return Some(None) };
        debug_assert_eq!(site.cap, 1);
        let w = site.shape.shrink_width();
        let (k, gy) = (site.shape.in_dim, w.div_ceil(SHRINK_ROWS));
        if gy > blocks {
            return None;
        }
        let mut kc = GEMV_LORA_SPLIT;
        while gy * k.div_ceil(kc) > blocks {
            kc *= 2;
        }
        let splits = k.div_ceil(kc);
        self.lora_scratch(&mut st, (1 + splits) * w, 0, site.recording);
        Some(Some(GemvLoraArgs { t: st.lora_t.ptr, ctr: st.gemv_lora_ctr.ptr, site, gy, splits, kc, ahead: false }))
    }

    /// [`Self::lora_gemv_args`] for a shrink computed ahead into `t`.
    pub(super) fn lora_gemv_args_ahead(&self, call: &LoraCall<'_>, t: u64) -> Option<GemvLoraArgs> {
        let mut st = self.state.lock().unwrap();
        let site = self.lora_site(&mut st, call)?;
        Some(GemvLoraArgs { t, ctr: st.gemv_lora_ctr.ptr, site, gy: 0, splits: 0, kc: 0, ahead: true })
    }

    /// Work-item blocks of the expand over `call`'s groups of `cap` rows: a fixed number when
    /// recording (they loop over the items there are), else one per item.
    pub(super) fn lora_expand_items(&self, call: &LoraCall<'_>, cap: usize, recording: bool) -> usize {
        let g = &call.groups;
        let zrows = expand_rows(cap, call.shape().shrink_width());
        if recording {
            fixed_blocks(cap)
        } else {
            let n = g.packed[0] as usize;
            g.packed[1 + 2 * cap..1 + 2 * cap + n].iter().map(|&r| (r as usize).div_ceil(zrows)).sum()
        }
    }

    /// Launches the shrink of `call` (`t = x·Aᵀ` into the scratch, region 0 once the split
    /// partials are added); what the delta's consumer needs, or `None` when the call has
    /// nothing to add.
    pub(super) fn lora_shrink_launch(&self, call: &LoraCall<'_>, x: LoraX<'_>) -> Option<LoraLaunch> {
        self.bind();
        let mut st = self.state.lock().unwrap();
        let site = self.lora_site(&mut st, call)?;
        let g = &call.groups;
        // Eager: a block per tile there is. Recording: blocks for up to RECORDED_TILE_BLOCKS
        // tiles, each looping over the tiles of the step replayed (the data decides how many).
        let tiles = if site.recording { fixed_blocks(site.cap) } else { g.packed[0] as usize };
        if tiles == 0 {
            return None;
        }
        // The expand's work items: `expand_rows` rows of a tile each.
        let items = self.lora_expand_items(call, site.cap, site.recording);
        match x {
            LoraX::Dense(x) => self.lora_shrink_dense(&mut st, &site, x, tiles),
            LoraX::TokenIds(ids) => {
                let (sh, cap) = (site.shape, site.cap);
                self.lora_scratch(&mut st, cap * sh.shrink_width(), 0, site.recording);
                let idp = self.meta_ptr(&mut st, ids);
                launch!(self, self.k.lora_shrink_ids, (tiles as u32, 1, 1), (256, 1, 1);
                    idp, site.a, site.gp, cap as i32, site.ranks, sh.max_rank as i32, sh.in_dim as i32, st.lora_t.ptr);
                self.mark("lora shrink");
            }
        }
        Some(LoraLaunch { shape: site.shape, gp: site.gp, cap: site.cap, items, t: st.lora_t.ptr, b: site.b, ranks: site.ranks, scal: site.scal })
    }

    /// The shrink `t = x·Aᵀ` of a dense input over `site`'s packed groups, on a grid for `tiles`
    /// tiles (its blocks loop over the pieces of the tiles the groups hold).
    pub(super) fn lora_shrink_dense(&self, st: &mut State, site: &LoraSite, x: &Tensor, tiles: usize) {
        let LoraSite { shape: sh, a, gp, cap, ranks, .. } = *site;
        let w = sh.shrink_width();
        let (klen, splits) = split_k(sh.in_dim);
        self.lora_scratch(st, (1 + splits) * cap * w, counters_len(cap, w), site.recording);
        let (t, counters) = (st.lora_t.ptr, st.lora_counters.ptr);
        // One-dimensional grids of at most a wave, looping over the pieces (kernel docs).
        if cap >= MMA_MIN_ROWS && sh.in_dim.is_multiple_of(64) {
            let gy = w.div_ceil(SHRINK_MMA_COLS);
            let grid = (tiles * gy * splits).min(SHRINK_MMA_BLOCKS) as u32;
            launch!(self, self.k.lora_shrink_mma, (grid, 1, 1), (128, 1, 1);
                buf(x), a, gp, cap as i32, ranks, sh.n_slices as i32, sh.max_rank as i32, sh.in_dim as i32, klen as i32, gy as i32, splits as i32, t, counters);
        } else {
            let gy = w.div_ceil(SHRINK_ROWS);
            let grid = (tiles * gy * splits).min(SHRINK_BLOCKS) as u32;
            launch!(self, self.k.lora_shrink, (grid, 1, 1), (256, 1, 1);
                buf(x), a, gp, cap as i32, ranks, sh.n_slices as i32, sh.max_rank as i32, sh.in_dim as i32, klen as i32, gy as i32, splits as i32, t, counters);
        }
        self.mark("lora shrink");
    }

    /// `y += s_j · t · Bᵀ` for the shrink `l` launched (`y` a device address of `rows × out`
    /// floats).
    pub(super) fn lora_expand_launch(&self, l: &LoraLaunch, y: u64) {
        let sh = l.shape;
        let out = sh.out_dim();
        let zrows = expand_rows(l.cap, sh.shrink_width());
        let smem = (zrows * sh.shrink_width() * 4) as u32;
        launch!(self, self.k.lora_expand, (l.items as u32, out.div_ceil(EXPAND_COLS_PER_BLOCK) as u32, 1), (EXPAND_THREADS, 1, 1), smem = smem;
            l.t, l.b, l.gp, l.cap as i32, l.ranks, l.scal, sh.n_slices as i32, sh.max_rank as i32, sh.b_ld as i32, l.off(1) as i32, l.off(2) as i32, out as i32,
            zrows as i32, y);
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
