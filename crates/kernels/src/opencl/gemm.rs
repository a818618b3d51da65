//! Weight GEMMs on OpenCL: the portable GEMM / GEMV pair of `gemm.cl` (one arithmetic, so any
//! row count gives a row the same result), and for bf16 weights on Intel GPUs the DPAS GEMM of
//! `dpas.cl` (XMX units) at the device's subgroup width.

use super::*;

/// The DPAS program, for a DPAS kernel set.
pub(super) fn dpas_source(set: &KernelSet) -> Option<program::Source> {
    matches!(set, KernelSet::Dpas { .. }).then_some(program::Source { file: "dpas.cl", text: include_str!("dpas.cl") })
}

impl OpenClDevice {
    pub(super) fn matmul_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        if m == 0 {
            return;
        }
        let (k, n) = (w.cols, w.rows);
        let WeightData::OpenCl(wb, dtype) = &w.data else { panic!("OpenCL matmul given a weight of another device (load it with Device::load_weight)") };
        let (bias_mem, has_bias) = match bias {
            Some(b) => (mem(b), 1),
            None => (mem(x), 0), // never read
        };
        let args = [Arg::Mem(mem(x)), Arg::Mem(wb.mem()), Arg::Mem(bias_mem), Arg::I32(has_bias), Arg::Mem(mem(y)), Arg::I32(m as i32), Arg::I32(n as i32), Arg::I32(k as i32)];
        let t = &self.tiles;
        if let (Some(lanes), DType::Bf16) = (self.dpas_lanes(), dtype) {
            if dpas_fits(k) {
                let cols = lanes * t.dpas_nt;
                return self.launch("dpas_gemm_bf16", &[n.div_ceil(cols) * lanes, m.div_ceil(8 * t.dpas_mt)], Some(&[lanes, 1]), &args);
            }
        }
        let bf16 = *dtype == DType::Bf16;
        if m <= t.gemv_max_m {
            self.launch(if bf16 { "gemv_bf16" } else { "gemv_f32" }, &[n], Some(&[t.gemv_wg]), &args);
        } else {
            self.launch(if bf16 { "gemm_bf16" } else { "gemm_f32" }, &[n, m], Some(&[t.gemm_t, t.gemm_t]), &args);
        }
    }
}

/// Whether the DPAS GEMM takes an input width: whole K = 16 steps.
pub(super) fn dpas_fits(k: usize) -> bool {
    k.is_multiple_of(16)
}
