//! LoRA of long prefill segments as cuBLAS GEMMs. A prompt's rows are contiguous and share one
//! adapter, so its delta is two small dense GEMMs per slice: the shrink `t = x·Aᵀ` (rows × n·r)
//! and the expand `s_j · t_j · B_jᵀ`, either written first with the base GEMM accumulating onto
//! it or accumulated into the base output by cuBLAS (beta = 1), on tensor cores. The kernels of `lora.cu` stream y through an f32 read-modify-write and run
//! at a fraction of the copy rate on 2048-row segments; cuBLAS reads y once per slice at its own
//! GEMM rate. Only eager steps with long runs take it: decode steps (recorded, one row per
//! sequence) keep the kernels, whose launches do not depend on how rows map to adapters.

use super::blas::Mat;
use super::lora::dev_buf;
use super::*;
use crate::lora::{LoraCall, MAX_SLICES};


/// Shortest run of contiguous rows of one adapter that the GEMMs take; a step takes them only
/// when every run of its adapter rows is at least this long (the engine's prefill chunks of
/// long prompts), since each run costs 1 + slices cuBLAS calls. The same with the site's LoRA
/// tail (`lora_tail.rs`): runs of 64 through the tail (16 adapters' 128-row prompts in a
/// 2048-token step) measured slower than the kernels (session 29, H100, 8B: +59.0% against
/// +44.7% of the base step).
const GEMM_MIN_RUN: usize = 256;

pub(super) fn for_runs(call: &LoraCall<'_>, f: impl FnMut(usize, usize, usize)) -> bool {
    crate::lora::for_contiguous_runs(call.groups.packed, call.groups.rows, GEMM_MIN_RUN, f)
}

impl CudaDevice {
    /// Whether `matmul_lora` over `m` rows of bf16 weight `w` takes the GEMM path for `call`.
    pub(super) fn lora_gemm_fits(&self, call: &LoraCall<'_>, m: usize, w: &Weight) -> bool {
        m > GEMV_MAX_M
            && !self.recording.load(std::sync::atomic::Ordering::Relaxed)
            && matches!(w.data, WeightData::Cuda(_, DType::Bf16, _))
            && call.groups.adapter_rows >= GEMM_MIN_RUN
            && for_runs(call, |_, _, _| {})
    }

    /// The projection and its delta by GEMMs (`lora_gemm_fits`). When the adapter rows are
    /// every row (a step of long prompts, all with adapters) the delta goes first, written into
    /// `y` (beta = 0), and the base GEMM accumulates onto it (beta = 1): cuBLAS reads y in the
    /// epilogue of a compute-bound GEMM instead of a separate read-modify-write pass over y per
    /// slice (22.5 GB a 2048-row 8B step). Otherwise (base rows among them, or the split input
    /// mode) the base GEMM first, then the expands accumulating. `QUIVER_CUDA_LORA_GEMM_FIRST=0`
    /// always takes the second order. With the site's LoRA tail holding every run's slot
    /// (`lora_tail.rs`) neither: the shrinks write beside x and one GEMM adds the delta.
    pub(super) fn lora_gemm_project(&self, call: &LoraCall<'_>, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        let (n, k) = (w.rows, w.cols);
        let splits = self.splits(n, k);
        let covered = call.groups.adapter_rows == m && !splits && self.lora_gemm_first;
        let tail = !splits && self.lora_tail.on && call.buffers.tail.lock().unwrap().is_some();
        if !covered && !tail {
            let xb = self.matmul_input(x, m, w, bias, y).expect("lora_gemm_fits takes bf16 weights past the GEMV's rows");
            let tb = self.lora_gemm_shrink(call, m, xb);
            return self.lora_gemm_expand(call, m, tb, buf(y), 1.0);
        }
        let WeightData::Cuda(wb, DType::Bf16, ldw) = &w.data else { unreachable!("lora_gemm_fits takes bf16 weights") };
        let wm = Mat { ptr: wb.ptr, ld: *ldw };
        self.bind();
        // x in bf16 for the shrink and the base GEMM.
        let xb = self.bf16_input(x, m, k);
        // With the site's tail: the delta inside the base GEMM (`lora_tail.rs`).
        if let Some(cols) = self.lora_tail_cols(call, w, xb) {
            return self.lora_tail_project(call, m, w, bias, y, xb, cols);
        }
        let add_bias = |y: &Tensor| {
            if let Some(b) = bias {
                launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
                self.mark("bias");
            }
        };
        let gemm = |y: &Tensor, accumulate: bool| {
            self.touch();
            self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wm, xb, buf(y), accumulate).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        };
        let tb = self.lora_gemm_shrink(call, m, xb);
        if !covered {
            // A tail this step cannot use (a slot past it): the base GEMM, then the expands.
            gemm(y, false);
            self.mark("matmul cublas");
            add_bias(y);
            return self.lora_gemm_expand(call, m, tb, buf(y), 1.0);
        }
        self.lora_gemm_expand(call, m, tb, buf(y), 0.0);
        gemm(y, true);
        self.mark("matmul cublas onto the lora delta");
        add_bias(y);
    }

    /// The shrink GEMMs of `call`'s runs from `xb`, the bf16 copy of x the base GEMM read:
    /// `t` (f32, `m × n·R`), and its bf16 copy (the expand GEMMs' operand), whose address it
    /// returns.
    fn lora_gemm_shrink(&self, call: &LoraCall<'_>, m: usize, xb: Mat) -> u64 {
        let sh = *call.shape();
        let (w, k) = (sh.shrink_width(), sh.in_dim);
        let a = dev_buf(&call.buffers.a).ptr;
        let ranks = call.table.ranks_at(call.entry);
        let mut st = self.state.lock().unwrap();
        self.grow(&mut st.lora_t, m * w * 6);
        let t = st.lora_t.ptr;
        let tb = t + (m * w * 4) as u64;
        drop(st);
        self.touch();
        for_runs(call, |r0, len, slot| {
            let r = ranks[slot] as usize;
            if r > 0 {
                let aw = Mat { ptr: a + ((slot * w * k) * 2) as u64, ld: k };
                let xr = Mat { ptr: xb.ptr + (r0 * xb.ld * 2) as u64, ld: xb.ld };
                self.blas.gemm_strided(len, sh.n_slices * r, k, aw, true, xr, t + (r0 * w * 4) as u64, w, 1.0, 0.0).unwrap_or_else(|e| self.gemm_failed(e));
            }
        });
        self.mark("lora shrink gemm");
        launch!(self, self.k.f32_to_bf16, grid1(m * w, 256), (256, 1, 1); t, tb, w as i64, w as i64, (m * w) as i64);
        tb
    }

    /// `y = beta·y + s_j · t_j · B_jᵀ` per slice over `call`'s runs (`y` a device address of
    /// `m × out` floats).
    fn lora_gemm_expand(&self, call: &LoraCall<'_>, m: usize, tb: u64, yp: u64, beta: f32) {
        let sh = *call.shape();
        let (w, out) = (sh.shrink_width(), sh.out_dim());
        debug_assert!(m > 0);
        let b = dev_buf(&call.buffers.b).ptr;
        let (ranks, scal) = (call.table.ranks_at(call.entry), call.table.scalings_at(call.entry));
        self.touch();
        for_runs(call, |r0, len, slot| {
            let r = ranks[slot] as usize;
            for j in 0..sh.n_slices {
                let (off, end) = (sh.offsets[j], if j + 1 < sh.n_slices { sh.offsets[j + 1] } else { out });
                let yj = yp + ((r0 * out + off) * 4) as u64;
                if r == 0 {
                    // Nothing to add; a delta written first must still be written (zeros).
                    if beta == 0.0 {
                        self.zero_rows(yj, len, end - off, out);
                    }
                    continue;
                }
                let bt = Mat { ptr: b + ((slot * sh.max_rank * sh.b_ld + off) * 2) as u64, ld: sh.b_ld };
                let tj = Mat { ptr: tb + ((r0 * w + j * r) * 2) as u64, ld: w };
                let s = scal[slot * MAX_SLICES + j];
                self.blas.gemm_strided(len, end - off, r, bt, false, tj, yj, out, s, beta).unwrap_or_else(|e| self.gemm_failed(e));
            }
        });
        self.mark("lora expand gemm");
    }

    /// Zeroes `rows` rows of `cols` floats at `y` (row stride `ld` floats).
    fn zero_rows(&self, y: u64, rows: usize, cols: usize, ld: usize) {
        self.touch();
        // SAFETY: rows within the output buffer the caller addresses; the compute stream.
        unsafe { sys::cuMemsetD2D32Async(y, ld * 4, 0, cols, rows, self.stream) }.result().unwrap_or_else(|e| panic!("zeroing LoRA output rows on {}: {e:?}", self.name));
    }

    fn gemm_failed(&self, e: anyhow::Error) -> ! {
        panic!("{}: LoRA GEMM: {e:#}", self.name)
    }
}
