//! Weight GEMMs on OpenCL: the portable GEMM / GEMV pair of `gemm.cl` (one arithmetic, so any
//! row count gives a row the same result), and for bf16 weights on Intel GPUs the DPAS GEMM of
//! `dpas.cl` (XMX units) at the device's subgroup width.

use super::*;

/// Output tile edge of the portable GEMM (`GEMM_T`), GEMV work-group and input chunk
/// (`GEMV_WG`, `GEMV_KC`), most rows of the GEMV (`GEMV_ROWS`).
const GEMM_T: usize = 16;
const GEMV_WG: usize = 64;
const GEMV_KC: usize = 256;
const GEMV_ROWS: usize = 4;

/// The `-D` tile sizes every program of the set is compiled with.
pub(super) fn defines(set: &KernelSet) -> String {
    let mut d = format!("-DGEMM_T={GEMM_T} -DGEMV_WG={GEMV_WG} -DGEMV_KC={GEMV_KC}");
    if let KernelSet::Dpas { .. } = set {
        d.push_str(&format!(" -DDPAS_MT={DPAS_MT} -DDPAS_NT={DPAS_NT}"));
    }
    d
}

/// Row tiles of 8 and column tiles of one subgroup width per DPAS subgroup (`DPAS_MT`, `DPAS_NT`).
const DPAS_MT: usize = 2;
const DPAS_NT: usize = 2;

/// Local memory the GEMM kernels use at most.
pub(super) fn local_mem_bytes(_set: &KernelSet) -> usize {
    (2 * GEMM_T * (GEMM_T + 1) * 4).max(GEMV_ROWS * GEMV_KC * 4)
}

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
        if let (KernelSet::Dpas { lanes, .. }, DType::Bf16) = (self.set, dtype) {
            if dpas_fits(k) {
                let cols = lanes * DPAS_NT;
                return self.launch("dpas_gemm_bf16", &[n.div_ceil(cols) * lanes, m.div_ceil(8 * DPAS_MT)], Some(&[lanes, 1]), &args);
            }
        }
        let suffix = if *dtype == DType::Bf16 { "bf16" } else { "f32" };
        if m <= GEMV_ROWS {
            self.launch(if suffix == "bf16" { "gemv_bf16" } else { "gemv_f32" }, &[n.div_ceil(GEMV_WG) * GEMV_WG], Some(&[GEMV_WG]), &args);
        } else {
            self.launch(if suffix == "bf16" { "gemm_bf16" } else { "gemm_f32" }, &[n.div_ceil(GEMM_T) * GEMM_T, m.div_ceil(GEMM_T) * GEMM_T], Some(&[GEMM_T, GEMM_T]), &args);
        }
    }
}

/// Whether the DPAS GEMM takes an input width: whole K = 16 steps.
pub(super) fn dpas_fits(k: usize) -> bool {
    k.is_multiple_of(16)
}
