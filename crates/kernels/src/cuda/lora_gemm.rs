//! LoRA of long prefill segments as cuBLAS GEMMs. A prompt's rows are contiguous and share one
//! adapter, so its delta is two small dense GEMMs per slice: the shrink `t = x·Aᵀ` (rows × n·r)
//! and the expand `y += s_j · t_j · B_jᵀ` accumulated into the base output by cuBLAS (beta = 1)
//! on tensor cores. The kernels of `lora.cu` stream y through an f32 read-modify-write and run
//! at a fraction of the copy rate on 2048-row segments; cuBLAS reads y once per slice at its own
//! GEMM rate. Only eager steps with long runs take it: decode steps (recorded, one row per
//! sequence) keep the kernels, whose launches do not depend on how rows map to adapters.

use super::blas::Mat;
use super::lora::dev_buf;
use super::*;
use crate::lora::{LoraCall, MAX_SLICES};


/// Shortest run of contiguous rows of one adapter that the GEMMs take; a step takes them only
/// when every run of its adapter rows is at least this long (the engine's prefill chunks of
/// long prompts), since each run costs 1 + slices cuBLAS calls.
const GEMM_MIN_RUN: usize = 256;

fn for_runs(call: &LoraCall<'_>, f: impl FnMut(usize, usize, usize)) -> bool {
    crate::lora::for_contiguous_runs(call.groups.packed, call.groups.rows, GEMM_MIN_RUN, f)
}

impl CudaDevice {
    /// Whether `matmul_lora` over `m` rows of bf16 weight `w` takes the GEMM path for `call`.
    pub(super) fn lora_gemm_fits(&self, call: &LoraCall<'_>, m: usize, w: &Weight) -> bool {
        m > GEMV_MAX_M
            && !self.recording.load(std::sync::atomic::Ordering::Relaxed)
            && matches!(w.data, WeightData::Cuda(_, DType::Bf16))
            && call.groups.adapter_rows >= GEMM_MIN_RUN
            && for_runs(call, |_, _, _| {})
    }

    /// Adds the delta of `call` into `y` (`m × out`) by GEMMs, right after the base GEMM of the
    /// same x (`matmul_impl` on a bf16 weight over more than one row), which left x in bf16 in
    /// the input shadow buffer (the split mode's hi half is the same rounding).
    pub(super) fn lora_gemm_delta(&self, call: &LoraCall<'_>, m: usize, y: &mut Tensor) {
        let sh = *call.shape();
        let (w, out, k) = (sh.shrink_width(), sh.out_dim(), sh.in_dim);
        let (a, b) = (dev_buf(&call.buffers.a).ptr, dev_buf(&call.buffers.b).ptr);
        let (ranks, scal) = (call.table.ranks_at(call.entry), call.table.scalings_at(call.entry));
        let mut st = self.state.lock().unwrap();
        // t in f32 (m × W), then its bf16 copy after it (the expand GEMM's operand).
        self.grow(&mut st.lora_t, m * w * 6);
        assert!(st.xbf.bytes >= m * k * 2, "LoRA GEMMs without the base GEMM's bf16 input");
        let (xb, t) = (st.xbf.ptr, st.lora_t.ptr);
        let tb = t + (m * w * 4) as u64;
        drop(st);
        let fail = |e: anyhow::Error| -> ! { panic!("{}: LoRA GEMM: {e:#}", self.name) };
        self.touch();
        for_runs(call, |r0, len, slot| {
            let r = ranks[slot] as usize;
            if r > 0 {
                let aw = Mat { ptr: a + ((slot * w * k) * 2) as u64, ld: k };
                let xr = Mat { ptr: xb + (r0 * k * 2) as u64, ld: k };
                self.blas.gemm_strided(len, sh.n_slices * r, k, aw, true, xr, t + (r0 * w * 4) as u64, w, 1.0, 0.0).unwrap_or_else(|e| fail(e));
            }
        });
        self.mark("lora shrink gemm");
        launch!(self, self.k.f32_to_bf16, grid1(m * w, 256), (256, 1, 1); t, tb, (m * w) as i64);
        self.touch();
        let yp = buf(y);
        for_runs(call, |r0, len, slot| {
            let r = ranks[slot] as usize;
            for j in 0..if r > 0 { sh.n_slices } else { 0 } {
                let (off, end) = (sh.offsets[j], if j + 1 < sh.n_slices { sh.offsets[j + 1] } else { out });
                let bt = Mat { ptr: b + ((slot * sh.max_rank * sh.b_ld + off) * 2) as u64, ld: sh.b_ld };
                let tj = Mat { ptr: tb + ((r0 * w + j * r) * 2) as u64, ld: w };
                let s = scal[slot * MAX_SLICES + j];
                self.blas.gemm_strided(len, end - off, r, bt, false, tj, yp + ((r0 * out + off) * 4) as u64, out, s, 1.0).unwrap_or_else(|e| fail(e));
            }
        });
        self.mark("lora expand gemm");
    }
}
