//! cuBLAS GEMMs in the kernels' row-major convention.

use anyhow::{Context, Result};
use cudarc::cublas::{result as cublas, sys as cs};
use cudarc::driver::sys;
use std::ffi::c_void;

/// Element type of the weight and input operands (the output is always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    Bf16,
    F32,
}

pub struct Blas {
    handle: cs::cublasHandle_t,
}

impl Blas {
    /// A handle on `stream`, with `workspace` = (device pointer, bytes) when given (owned by the
    /// caller, alive as long as the handle): with its own workspace cuBLAS allocates nothing per
    /// call, which is what lets its GEMMs be recorded into CUDA graphs.
    pub fn new(stream: sys::CUstream, workspace: Option<(u64, usize)>) -> Result<Self> {
        let handle = cublas::create_handle().map_err(|e| anyhow::anyhow!("{e:?}")).context("creating a cuBLAS handle")?;
        // SAFETY: a valid handle and stream of the current context; the workspace is a live
        // device allocation of `bytes`.
        unsafe { cublas::set_stream(handle, stream as cs::cudaStream_t) }.map_err(|e| anyhow::anyhow!("cublasSetStream: {e:?}"))?;
        if let Some((ptr, bytes)) = workspace {
            let st = unsafe { cs::cublasSetWorkspace_v2(handle, ptr as *mut c_void, bytes) };
            if st != cs::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                anyhow::bail!("cublasSetWorkspace: {st:?}");
            }
        }
        Ok(Blas { handle })
    }

    /// `y[m, n] (+)= x[m, k] · W[n, k]ᵀ` with row-major x, W, y (`accumulate` adds into y): in
    /// cuBLAS's column-major terms `yᵀ (n×m) = W (k×n)ᵀ · xᵀ (k×m)`, i.e. op(A) = T on W and
    /// op(B) = N on x.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_xwt(&self, op: Operand, m: usize, n: usize, k: usize, w: u64, x: u64, y: u64, accumulate: bool) -> Result<()> {
        let t = match op {
            Operand::Bf16 => cs::cudaDataType::CUDA_R_16BF,
            Operand::F32 => cs::cudaDataType::CUDA_R_32F,
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: w holds n·k, x m·k elements of type t, y m·n f32; all device pointers are live.
        unsafe {
            cublas::gemm_ex(
                self.handle,
                cs::cublasOperation_t::CUBLAS_OP_T,
                cs::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                t,
                k as i32,
                x as *const c_void,
                t,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                cs::cudaDataType::CUDA_R_32F,
                n as i32,
                cs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow::anyhow!("cublasGemmEx (m={m}, n={n}, k={k}, {op:?}): {e:?}"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.handle) };
    }
}
