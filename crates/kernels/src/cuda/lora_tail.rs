//! LoRA tails (`docs/lora-in-the-gemm.md`; on unless `QUIVER_CUDA_LORA_TAIL=0`): a site's B of
//! its first slots kept beside the base weight's rows, so that `y = [x | t̂]·[W | B̂]ᵀ` adds
//! every row's delta in the base GEMM itself, with `t̂` (each row's shrink, scaled, in its
//! slot's columns; zeros elsewhere) written beside x's bf16 copy. What this removes is the
//! expand's pass over the f32 output: a long prompt's delta GEMMs write y and the base GEMM
//! reads it back (`lora_gemm.rs`), ~22.5 GB a 2048-token 8B step. Long prompts
//! (`lora_gemm_fits`) take it: a 2048-token prompt with one adapter measured +6.8% of the base
//! step against +16.4% without (session 29, H100, 8B, rank 16 on all 7 projections). Steps of
//! rows (decode) keep their kernels by default (`TailRows`): through the tail
//! (`QUIVER_CUDA_LORA_TAIL=rows`) a 16-row step measured +31.7% against +11.0%. cuBLAS over
//! K + T costs what it does over K at 16 rows (session 27's probe), so the loss is the rows'
//! own t̂ kernel (`lora_tail_shrink`: one block a row reading its slot's whole A, 16-64 blocks
//! on 132 SMs, for o and down whose shrink the norm does not compute) against the kernels'
//! path, whose shrinks and expands run beside the GEMM or inside its epilogue.

use super::blas::Mat;
use super::lora::dev_buf;
use super::lora_ahead::LoraAhead;
use super::lora_gemm::for_runs;
use super::*;
use crate::lora::{LoraCall, LoraSiteBuffers, LoraTail, MAX_SLICES};

/// Most columns a weight's tail takes, in whole slots: 512 hold 10 rank-16 slots on qkv (the
/// default 8 of `--max-loras-per-batch`, so recorded steps can take the tail) for 12% more bytes
/// on a 4096-wide weight; at decode sizes the probe (session 27) measured cuBLAS over K + 256 at
/// 1.00-1.05x and K + 1024 at 1.04-1.17x the GEMM over K.
const TAIL_MAX_COLS: usize = 512;
/// Which steps add their deltas through the tails (`QUIVER_CUDA_LORA_TAIL`,
/// `QUIVER_CUDA_LORA_TAIL_ONE_SHRINK`, `QUIVER_CUDA_LORA_TAIL_EAGER`, read once at start-up; a
/// value outside those named below is an error naming the variable).
#[derive(Clone, Copy, Debug)]
pub(super) struct TailConfig {
    /// Tails at all: long prompts' deltas in the base GEMM (on unless `QUIVER_CUDA_LORA_TAIL=0`).
    pub(super) on: bool,
    /// Steps of rows (decode, 2+ rows) through the tail too.
    pub(super) rows: TailRows,
    /// `QUIVER_CUDA_LORA_TAIL_ONE_SHRINK=1` (opt-in, session 29, not yet run on a GPU): a long
    /// prompt's shrink into the tail as one GEMM a run where the slot's adapter has the pool's
    /// rank and one scaling for every slice (qkv's three shrink GEMMs a run become one,
    /// gate_up's two), instead of one a slice: each re-reads the run's x (16 MB at 2048 rows of
    /// 4096), and N = 16 leaves cuBLAS's tiles mostly empty. What is left of a 2048-token
    /// prompt's +7.0% is mostly these GEMMs (7 a layer against the base's 4).
    one_shrink: bool,
    /// `QUIVER_CUDA_LORA_TAIL_EAGER=1` (opt-in, session 29, not yet run on a GPU): eager steps
    /// of more rows than the norms shrink for, whose runs are too short for the prompts' GEMMs
    /// (16 adapters' 128-token prompts in a 2048-token chunk: +44.7% of the base step through
    /// the kernels, whose expand streams y in f32), add their deltas through the tail with the
    /// kernels' grouped shrink (`lora_tail_eager_fits`).
    eager: bool,
}

impl TailConfig {
    pub(super) fn from_env() -> Result<Self> {
        let flag = |var: &str| match std::env::var(var).as_deref() {
            Err(_) | Ok("0") => Ok(false),
            Ok("1") => Ok(true),
            Ok(v) => Err(anyhow::anyhow!("{var}={v:?}: 0 or 1")),
        };
        let (on, rows) = match std::env::var("QUIVER_CUDA_LORA_TAIL").as_deref() {
            Err(_) | Ok("1") => (true, TailRows::Off),
            Ok("0") => (false, TailRows::Off),
            Ok("ahead") => (true, TailRows::Ahead),
            Ok("rows") => (true, TailRows::All),
            Ok(v) => anyhow::bail!("QUIVER_CUDA_LORA_TAIL={v:?}: 0, 1, ahead or rows"),
        };
        Ok(TailConfig { on, rows, one_shrink: flag("QUIVER_CUDA_LORA_TAIL_ONE_SHRINK")?, eager: flag("QUIVER_CUDA_LORA_TAIL_EAGER")? })
    }
}

/// Which steps of rows (decode, 2+ rows) add their deltas through the tail: `Off` by default;
/// `All` (`QUIVER_CUDA_LORA_TAIL=rows`) every site whose tail holds the rows' slots, measured
/// slower (session 29: +31.7% against +11.0% at 16 rows, +28.3% against +23.6% at 64); `Ahead`
/// (`=ahead`, opt-in, not yet run on a GPU) only qkv and gate_up, whose shrink the norm before
/// them computed: the t̂ kernel then only places it (no A read), the GEMM over K + T costs
/// what it does over K (session 27's probe), and the RoPE / SiLU·mul epilogues lose their
/// expand (9-17 µs a layer at 64 rows, session 25's ncu); o and down keep their delta beside
/// the GEMM on the side stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum TailRows {
    Off,
    Ahead,
    All,
}

/// The tail a step of rows adds its delta through: the site tail's slot count, and the
/// columns of it the step's GEMM reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct TailStep {
    slots: usize,
    pub(super) cols: usize,
}

/// Widest shrink (`n·R`) the rows' tail kernel holds (`lora_tail.cu` `TAIL_MAX_W`).
const TAIL_MAX_W: usize = 192;

/// `call`'s site tail: its row stride and slot count.
fn site_tail(call: &LoraCall<'_>) -> Option<(usize, usize)> {
    call.buffers.tail.lock().unwrap().as_ref().map(|t| (t.ld, t.slots))
}

/// The slot count of `call`'s site tail when `w` is the weight it lives in.
fn tail_of(call: &LoraCall<'_>, w: &Weight) -> Option<usize> {
    let (at, ld, slots) = call.buffers.tail.lock().unwrap().as_ref().map(|t| (t.at, t.ld, t.slots))?;
    let WeightData::Cuda(wb, DType::Bf16, wld) = &w.data else { return None };
    (*wld == ld && wb.ptr + (w.cols * 2) as u64 == at).then_some(slots)
}

impl CudaDevice {
    /// `Device::lora_attach_tail`: copies `w` into rows `in + T` wide (T = the tail's columns,
    /// a multiple of 8), the tail zeroed, then writes the B of every slot the tail holds (zeros
    /// until an adapter fills one). x's bf16 copies get at least that much room after each row.
    pub(super) fn lora_attach_tail_impl(&self, w: &mut Weight, site: &LoraSiteBuffers) {
        let sh = site.shape;
        let nr = sh.shrink_width();
        let slots = sh.slots.min(TAIL_MAX_COLS / nr.max(1));
        if !self.lora_tail.on || slots == 0 || w.cols != sh.in_dim || w.rows != sh.out_dim() {
            return;
        }
        let WeightData::Cuda(old, DType::Bf16, old_ld) = &w.data else { return };
        let (rows, k) = (w.rows, w.cols);
        let ld = (k + slots * nr).next_multiple_of(8);
        self.bind();
        let b = DevBuf::zeroed(&self.ctx, rows * ld * 2).unwrap_or_else(|e| panic!("LoRA tail of a {rows}x{k} weight on {}: {e:#}", self.name));
        // Every field spelled out: `mem::zeroed` is not a valid descriptor (CUmemorytype has no
        // zero variant, and Rust aborts on it).
        let c = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: old.ptr,
            srcArray: std::ptr::null_mut(),
            srcPitch: old_ld * 2,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: b.ptr,
            dstArray: std::ptr::null_mut(),
            dstPitch: ld * 2,
            WidthInBytes: k * 2,
            Height: rows,
        };
        // SAFETY: both pitched regions lie inside their allocations (rows × pitch bytes), device
        // to device on the compute stream.
        unsafe {
            self.touch();
            sys::cuMemcpy2DAsync_v2(&c, self.stream).result().unwrap_or_else(|e| panic!("copying a weight beside its LoRA tail on {}: {e:?}", self.name));
        }
        // The old buffer is freed when `w.data` is replaced: the copy must be done by then.
        self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
        let (at, b) = (b.ptr + (k * 2) as u64, Arc::new(b));
        w.data = WeightData::Cuda(b.clone(), DType::Bf16, ld);
        *site.tail.lock().unwrap() = Some(LoraTail { at, ld, slots, memory: Box::new(b) });
        self.input_room.fetch_max(ld - k, std::sync::atomic::Ordering::Relaxed);
        for slot in 0..slots {
            self.lora_tail_scatter(site, slot);
        }
    }

    /// Writes slot `slot`'s B from the pool into `site`'s tail (after the slot's write, on the
    /// same stream): nothing when the site has no tail or the slot is past it.
    pub(super) fn lora_tail_scatter(&self, site: &LoraSiteBuffers, slot: usize) {
        let Some((at, ld, slots)) = site.tail.lock().unwrap().as_ref().map(|t| (t.at, t.ld, t.slots)) else { return };
        if slot >= slots {
            return;
        }
        let sh = site.shape;
        let nr = sh.shrink_width();
        let off = |j: usize| if j < sh.n_slices { sh.offsets[j] as i32 } else { 0 };
        let grid = (nr.div_ceil(64) as u32, sh.out_dim().min(8192) as u32, 1);
        launch!(self, self.k.lora_tail_scatter, grid, (64, 1, 1);
            dev_buf(&site.b).ptr, sh.b_ld as i32, sh.max_rank as i32, sh.n_slices as i32, off(1), off(2), sh.out_dim() as i32, at, ld as i64, slot as i32);
        self.mark("lora tail scatter");
    }

    /// The tail's columns a step over `call`'s runs reads (through the highest slot a run
    /// uses, rounded up to 8), when `w` has the site's tail, every run's slot is in it, and
    /// x's bf16 copy `xb` has room for them; None otherwise.
    pub(super) fn lora_tail_cols(&self, call: &LoraCall<'_>, w: &Weight, xb: Mat) -> Option<usize> {
        let slots = tail_of(call, w)?;
        let mut hi = 0;
        for_runs(call, |_, _, slot| hi = hi.max(slot + 1));
        let cols = (hi * call.shape().shrink_width()).next_multiple_of(8);
        // hi ≤ slots keeps cols within the weight's tail (its width is slots·n·R rounded to 8).
        (hi <= slots && xb.ld >= w.cols + cols).then_some(cols)
    }

    /// `y = [x | t̂]·[W | B̂]ᵀ (+ bias)` over `tail_cols` tail columns: zeroes those columns of
    /// x's bf16 copy `xb`, writes each run's `s_j · x·A_jᵀ` (bf16) into its slot's columns, then
    /// one GEMM over `in + tail_cols`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_tail_project(&self, call: &LoraCall<'_>, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor, xb: Mat, tail_cols: usize) {
        let WeightData::Cuda(wb, DType::Bf16, ldw) = &w.data else { unreachable!("lora_tail_cols takes bf16 weights") };
        let sh = *call.shape();
        let (n, k, nr) = (w.rows, w.cols, sh.shrink_width());
        let a = dev_buf(&call.buffers.a).ptr;
        let (ranks, scal) = (call.table.ranks_at(call.entry), call.table.scalings_at(call.entry));
        self.touch();
        // SAFETY: m rows of tail_cols bf16 past column k of x's copy, inside its room (checked by
        // lora_tail_cols); the compute stream.
        unsafe { sys::cuMemsetD2D16Async(xb.ptr + (k * 2) as u64, xb.ld * 2, 0, tail_cols, m, self.stream) }.result().unwrap_or_else(|e| panic!("zeroing LoRA tail columns on {}: {e:?}", self.name));
        let fail = |e: anyhow::Error| -> ! { panic!("{}: LoRA tail shrink: {e:#}", self.name) };
        let one_shrink = self.lora_tail.one_shrink;
        for_runs(call, |r0, len, slot| {
            let r = ranks[slot] as usize;
            let s = &scal[slot * MAX_SLICES..slot * MAX_SLICES + sh.n_slices];
            let xr = Mat { ptr: xb.ptr + (r0 * xb.ld * 2) as u64, ld: xb.ld };
            if one_shrink && r == sh.max_rank && s.iter().all(|&v| v == s[0]) {
                // At the pool's rank A's slices (at j·r) sit where t̂'s (at j·R) go, and one
                // scaling serves all: one GEMM for the whole slot.
                let t = Mat { ptr: xb.ptr + ((r0 * xb.ld + k + slot * nr) * 2) as u64, ld: xb.ld };
                let aw = Mat { ptr: a + (slot * nr * k * 2) as u64, ld: k };
                return self.blas.gemm_bf16_out(len, nr, k, aw, xr, t, s[0]).unwrap_or_else(|e| fail(e));
            }
            for j in 0..sh.n_slices {
                if r == 0 {
                    break;
                }
                // A's slot holds slice j's rows at j·r (packed by the adapter's rank); t̂'s
                // columns of slice j start at j·R (the tail's layout, by the pool's rank).
                let aj = Mat { ptr: a + ((slot * nr + j * r) * k * 2) as u64, ld: k };
                let tj = Mat { ptr: xb.ptr + ((r0 * xb.ld + k + slot * nr + j * sh.max_rank) * 2) as u64, ld: xb.ld };
                self.blas.gemm_bf16_out(len, r, k, aj, xr, tj, scal[slot * MAX_SLICES + j]).unwrap_or_else(|e| fail(e));
            }
        });
        self.mark("lora tail shrink gemm");
        self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k + tail_cols, Mat { ptr: wb.ptr, ld: *ldw }, xb, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        self.mark("matmul cublas over the lora tail");
        if let Some(b) = bias {
            launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
            self.mark("bias");
        }
    }

    /// The slots of `call`'s site tail, when a step of `m ≥ 2` rows over `w` (`ahead`: whose
    /// shrink the norm computed) can add its delta through it (`lora_tail_rows`): the mode
    /// (`TailRows`) takes such steps, and the tail lives in `w` and holds every slot a row may
    /// use: every slot of the pool for a recorded step (it replays under any adapter mix), the
    /// step's own slots for an eager one.
    pub(super) fn lora_tail_rows_fits(&self, call: &LoraCall<'_>, m: usize, w: &Weight, ahead: bool) -> Option<TailStep> {
        let mode_takes = match self.lora_tail.rows {
            TailRows::Off => false,
            TailRows::Ahead => ahead,
            TailRows::All => true,
        };
        if !mode_takes {
            return None;
        }
        self.lora_tail_step(call, m, w)
    }

    /// [`Self::lora_tail_rows_fits`] for an eager step of more rows than the norms compute the
    /// shrink for (a prefill chunk whose prompts are shorter than the prompts' GEMMs take, or
    /// prompts beside decode rows) under `QUIVER_CUDA_LORA_TAIL_EAGER=1`: its shrink then comes
    /// from the kernels' grouped shrink (`lora_shrink_launch`), not from `lora_tail_shrink`'s
    /// block a row.
    pub(super) fn lora_tail_eager_fits(&self, call: &LoraCall<'_>, m: usize, w: &Weight) -> Option<TailStep> {
        if !self.lora_tail.eager || m <= lora_ahead::AHEAD_MAX_ROWS || self.recording.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.lora_tail_step(call, m, w)
    }

    /// The tail a step of `m ≥ 2` rows over `w` adds its delta through, when the tail lives in
    /// `w` and holds every slot a row may use: every slot of the pool for a recorded step (it
    /// replays under any adapter mix: the whole tail), the step's own slots for an eager one
    /// (the tail's columns through its highest slot).
    fn lora_tail_step(&self, call: &LoraCall<'_>, m: usize, w: &Weight) -> Option<TailStep> {
        let WeightData::Cuda(_, _, ld) = &w.data else { return None };
        self.lora_tail_step_of(call, m, (*ld, tail_of(call, w)?))
    }

    /// What the norm before a site places t̂ for (`rms_norm_shrink`'s tail columns, so the
    /// projection launches no `lora_tail_shrink`): the step [`Self::lora_tail_rows_fits`] takes
    /// for the site's shrink computed ahead, when the norm's bf16 copy (rows `ldb` apart) has
    /// room for its columns. The projection checks that it takes the same step over the same
    /// copy before it skips its own placing, so a mismatch costs a launch, never correctness.
    pub(super) fn lora_tail_ahead_step(&self, call: &LoraCall<'_>, m: usize, ldb: usize) -> Option<TailStep> {
        if self.lora_tail.rows == TailRows::Off {
            return None;
        }
        self.lora_tail_step_of(call, m, site_tail(call)?).filter(|t| ldb >= call.shape().in_dim + t.cols)
    }

    /// [`Self::lora_tail_step`] given the site's tail `(ld, slots)` (attached only to a weight
    /// of the site's shape, so its columns are `ld - in_dim` wide), whoever read it.
    fn lora_tail_step_of(&self, call: &LoraCall<'_>, m: usize, (ld, slots): (usize, usize)) -> Option<TailStep> {
        let sh = call.shape();
        if m <= GEMV_MAX_M || self.splits(sh.out_dim(), sh.in_dim) || sh.shrink_width() > TAIL_MAX_W {
            return None;
        }
        if self.recording.load(std::sync::atomic::Ordering::Relaxed) {
            return (slots >= sh.slots).then_some(TailStep { slots, cols: ld - sh.in_dim });
        }
        // The packed groups' tile slots (`kernels::lora::pack_tiles`).
        let (g, cap) = (call.groups.packed, call.groups.rows);
        let tiles = g[0] as usize;
        let hi = g[1 + 3 * cap..1 + 3 * cap + tiles].iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        // hi ≤ slots keeps the columns within the tail (slots·n·R rounded up to 8).
        (hi <= slots).then_some(TailStep { slots, cols: (hi * sh.shrink_width()).next_multiple_of(8) })
    }

    /// `y = [x | t̂]·[W | B̂]ᵀ (+ bias)` over a step's rows and the tail's columns `tail.cols`
    /// (a recorded step: the whole tail, so its launches do not depend on the step's adapters
    /// and it replays under any mix), then `epilogue`: one kernel writes
    /// each row's scaled shrink (from `t_ahead`, the norm's, or its own from x) beside x's bf16
    /// copy and zeros in the other slots' columns (`lora_tail_shrink`; none when the norm that
    /// computed `t_ahead` already placed it there for this step), one GEMM adds every row's
    /// delta. Replaces the shrink, the expand and the LoRA epilogue of the kernels' path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_tail_rows(&self, call: &LoraCall<'_>, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, epilogue: Epilogue<'_>, y: &mut Tensor, tail: TailStep, t_ahead: Option<LoraAhead>) {
        let WeightData::Cuda(wb, DType::Bf16, ldw) = &w.data else { unreachable!("lora_tail_rows_fits takes bf16 weights") };
        let (n, k, TailStep { slots, cols }) = (w.rows, w.cols, tail);
        let xb = self.bf16_input(x, m, k);
        assert!(xb.ld >= k + cols, "a GEMM input without room for its LoRA tail ({} < {})", xb.ld, k + cols);
        let sh = *call.shape();
        let mut st = self.state.lock().unwrap();
        let site = self.lora_site(&mut st, call).expect("a LoRA step with rows");
        drop(st);
        // The norm before placed t̂ in this very copy for this step (`rms_norm_shrink`).
        let placed = t_ahead.is_some_and(|a| a.placed == Some((tail, xb.ptr)));
        if !placed {
            let xp = if t_ahead.is_some() { 0 } else { buf(x) };
            launch!(self, self.k.lora_tail_shrink, (m as u32, 1, 1), (256, 1, 1);
                xp, k as i32, t_ahead.map_or(0, |a| a.t), sh.shrink_width() as i32, site.a, site.gp, site.cap as i32, site.ranks, site.scal,
                sh.n_slices as i32, sh.max_rank as i32, slots as i32, xb.ptr, xb.ld as i64, cols as i32);
            self.mark("lora tail shrink");
        }
        self.touch();
        self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k + cols, Mat { ptr: wb.ptr, ld: *ldw }, xb, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        self.mark("matmul cublas over the lora tail");
        if let Some(b) = bias {
            launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
            self.mark("bias");
        }
        epilogue.run(self, y, m, w);
    }
}
