//! Paged attention on OpenCL: the new rows' k/v into the cache, then one work-group per
//! (row, head) over the row's context (`kv_write`, `paged_attention` in kernels.cl). Prefill
//! and decode rows take the same kernel, so a row's output is the same in either.

use super::*;

impl OpenClDevice {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_impl(&self, qkv: &Tensor, b: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        let rows = b.positions.len();
        if rows == 0 {
            return;
        }
        let l = kv.layout;
        debug_assert!(l.head_dim <= MAX_HEAD_DIM, "refused at load by check_head_dim");
        let mut st = self.state.lock().unwrap();
        let (rs, rs_off) = self.row_seq_ref(&mut st, b);
        let (pm, pos_off) = self.meta_ref(&mut st, b.positions);
        let (bm, bt_off) = self.meta_ref(&mut st, b.block_tables);
        // The positions, block tables and row map are one staged buffer in a forward step; an op
        // called on its own may get side copies, which the kernels cannot mix with the staged one.
        assert!(rs == pm && pm == bm, "paged_attention: positions and block tables must be staged with the batch");
        let (kc, vc) = (mem(&kv.k[layer]), mem(&kv.v[layer]));
        let stride = b.block_table_stride as i32;
        let (nh, nkv, hd, bs) = (Arg::I32(n_heads as i32), Arg::I32(l.n_kv_heads as i32), Arg::I32(l.head_dim as i32), Arg::I32(l.block_size as i32));
        let (q, o) = (Arg::Mem(mem(qkv)), Arg::Mem(mem(out)));
        self.launch("kv_write", &[l.n_kv_heads * l.head_dim, rows], None,
            &[q, Arg::Mem(rs), Arg::I32(rs_off), Arg::I32(pos_off), Arg::I32(bt_off), Arg::I32(stride), Arg::Mem(kc), Arg::Mem(vc), nh, nkv, hd, bs, Arg::I32(rows as i32)]);
        self.launch("paged_attention", &[rows * ATTN_WG, n_heads], Some(&[ATTN_WG, 1]),
            &[q, Arg::Mem(kc), Arg::Mem(vc), Arg::Mem(rs), Arg::I32(rs_off), Arg::I32(pos_off), Arg::I32(bt_off), Arg::I32(stride), o, nh, nkv, hd, bs, Arg::F32(scale)]);
    }
}
