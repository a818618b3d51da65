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

    /// `y[m, n] (+)= x[m, k] · W[n, k]ᵀ` with row-major x, y and W (x's rows `x.ld` apart, W's
    /// `w.ld`; `accumulate` adds into y).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_xwt(&self, op: Operand, m: usize, n: usize, k: usize, w: Mat, x: Mat, y: u64, accumulate: bool) -> Result<()> {
        let t = match op {
            Operand::Bf16 => cs::cudaDataType::CUDA_R_16BF,
            Operand::F32 => cs::cudaDataType::CUDA_R_32F,
        };
        self.gemm(t, m, n, k, w, true, x, y, n, cs::cudaDataType::CUDA_R_32F, 1.0, if accumulate { 1.0 } else { 0.0 })
            .map_err(|e| anyhow::anyhow!("cublasGemmEx (m={m}, n={n}, k={k}, {op:?}): {e:?}"))
    }

    /// `y[m, n] = alpha · x[m, k] · Wᵀ + beta · y` over strided row-major views: x (bf16, row
    /// stride `x.ld`), y (f32, row stride `y_ld`), and W as `[n, k]` rows of stride `w.ld` when
    /// `w_rows`, else stored transposed (`Wᵀ` as `[k, n]` rows of stride `w.ld`). Sub-matrices
    /// (a slice's columns, a segment's rows) are pointer offsets.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_strided(&self, m: usize, n: usize, k: usize, w: Mat, w_rows: bool, x: Mat, y: u64, y_ld: usize, alpha: f32, beta: f32) -> Result<()> {
        self.gemm(cs::cudaDataType::CUDA_R_16BF, m, n, k, w, w_rows, x, y, y_ld, cs::cudaDataType::CUDA_R_32F, alpha, beta)
            .map_err(|e| anyhow::anyhow!("cublasGemmEx (m={m}, n={n}, k={k}, strided): {e:?}"))
    }

    /// `y[m, n] = alpha · x[m, k] · Wᵀ` as [`Self::gemm_strided`] with W's rows, but y in bf16
    /// (row stride `y.ld`; f32 accumulation, rounded once on the way out).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16_out(&self, m: usize, n: usize, k: usize, w: Mat, x: Mat, y: Mat, alpha: f32) -> Result<()> {
        self.gemm(cs::cudaDataType::CUDA_R_16BF, m, n, k, w, true, x, y.ptr, y.ld, cs::cudaDataType::CUDA_R_16BF, alpha, 0.0)
            .map_err(|e| anyhow::anyhow!("cublasGemmEx (m={m}, n={n}, k={k}, bf16 out): {e:?}"))
    }

    /// In cuBLAS's column-major terms `yᵀ (n×m) = op(W) · xᵀ (k×m)`: op = T on W's rows, N on
    /// its stored transpose.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, t: cs::cudaDataType, m: usize, n: usize, k: usize, w: Mat, w_rows: bool, x: Mat, y: u64, y_ld: usize, yt: cs::cudaDataType, alpha: f32, beta: f32) -> Result<(), cublas::CublasError> {
        let op = if w_rows { cs::cublasOperation_t::CUBLAS_OP_T } else { cs::cublasOperation_t::CUBLAS_OP_N };
        // SAFETY: the caller's views lie inside live device allocations of elements of type t
        // (W, x) and yt (y).
        unsafe {
            cublas::gemm_ex(
                self.handle,
                op,
                cs::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w.ptr as *const c_void,
                t,
                w.ld as i32,
                x.ptr as *const c_void,
                t,
                x.ld as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                yt,
                y_ld as i32,
                cs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
    }
}

/// One operand of [`Blas::gemm_strided`]: a matrix at `ptr` with leading dimension `ld`.
#[derive(Clone, Copy)]
pub struct Mat {
    pub ptr: u64,
    pub ld: usize,
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.handle) };
    }
}
