//! The one-pass row ops: the embedding gather, RMSNorm and its fused residual add (their bf16
//! copy for the GEMM that follows written in the same pass), the residual add, the row gather.
//! The trait methods in mod.rs call these.

use super::*;

impl CudaDevice {
    /// The embedding of `ids` from a table of vocab rows `start..start + table.rows`; ids
    /// outside it get zero rows (a tensor-parallel rank's shard).
    pub(super) fn embedding_rows(&self, table: &Weight, ids: &[u32], start: usize, out: &mut Tensor) {
        self.bind();
        if ids.is_empty() {
            return;
        }
        let WeightData::Cuda(tb, dtype, ld) = &table.data else { panic!("CUDA embedding given a host table") };
        let f = if *dtype == DType::Bf16 { self.k.embedding_bf16 } else { self.k.embedding_f32 };
        let mut st = self.state.lock().unwrap();
        let idp = self.meta_ptr(&mut st, ids);
        launch!(self, f, (ids.len() as u32, 1, 1), (256, 1, 1); tb.ptr, idp, buf(out), table.cols as i32, *ld as i32, start as u32, table.rows as u32);
        self.mark("embedding");
    }

    pub(super) fn rms_norm_impl(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, dim);
        let per_row = if dim.is_multiple_of(4) { dim / 4 } else { dim };
        launch!(self, self.k.rms_norm, (rows as u32, 1, 1), row_threads(per_row); buf(x), buf(w), buf(out), ob.ptr, dim as i32, ob.ld as i32, eps);
        self.set_shadow(&mut st, ob, buf(out), rows * dim);
        self.mark("rms_norm");
    }

    pub(super) fn add_rms_norm_impl(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        self.flush_lora_deferred();
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, dim);
        let per_row = if dim.is_multiple_of(4) { dim / 4 } else { dim };
        launch!(self, self.k.add_rms_norm, (rows as u32, 1, 1), row_threads(per_row); buf(resid), buf(delta), buf(w), buf(out), ob.ptr, dim as i32, ob.ld as i32, eps);
        self.set_shadow(&mut st, ob, buf(out), rows * dim);
        self.mark("add_rms_norm");
    }

    pub(super) fn add_inplace_impl(&self, resid: &mut Tensor, delta: &Tensor, len: usize) {
        self.bind();
        if len == 0 {
            return;
        }
        self.flush_lora_deferred();
        launch!(self, self.k.add_inplace, grid1(len, 256), (256, 1, 1); buf(resid), buf(delta), len as i64);
        self.mark("add_inplace");
    }

    pub(super) fn gather_rows_impl(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor) {
        self.bind();
        if rows.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let rp = self.meta_ptr(&mut st, rows);
        launch!(self, self.k.gather_rows, (rows.len() as u32, 1, 1), (256, 1, 1); buf(x), rp, buf(out), dim as i32);
        self.mark("gather_rows");
    }
}
