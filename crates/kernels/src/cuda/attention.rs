//! Attention on CUDA: the KV write of a step's rows, then tensor-core prefill attention
//! (`prefill_attention_*` in prefill_attention.cu) when some sequence brings several rows, else decode
//! attention: by KV head (`decode_attention.cu`, every query head of a KV head in one block, so
//! a cached K/V row is read once) from `attn_gqa_min_rows` rows, per query head below that
//! (`paged_attention` in kernels.cu, whose blocks split a short batch's long context finer).

use super::*;

/// Threads per block of the decode attention (at most `ATTN_WARPS` × 32 in kernels.cu): 16 warps
/// split a short batch's context finely (batch-1 latency); from 8 rows on, 8 warps, so more of a
/// large batch's many small blocks fit on an SM at once (16-warp blocks cost batch 256 ~6%).
fn attn_threads(rows: usize) -> u32 {
    if rows < 8 {
        512
    } else {
        256
    }
}

/// Default of `CudaDevice::attn_gqa_min_rows`. Measured on the H200 (8B shape, contexts
/// 160..192): at 16 rows the per-head kernel's 512 blocks beat the by-head kernel's 128 (2.73k
/// vs 2.60k tok/s), at 64 rows the by-head kernel wins (7.4k → 8.6k tok/s; 256 rows 13.3k →
/// 18.0k); rows in between are unmeasured, so the switch is at the first measured win.
pub(super) const ATTN_GQA_MIN_ROWS: usize = 64;
/// Most query heads per KV head the attention by KV head serves (`GQA_MAX_G`).
const ATTN_GQA_MAX_GROUP: usize = 8;

/// Threads per block of the attention by KV head (at most `GQA_MAX_WARPS` × 32): a block holds
/// every query head of its KV head, so a batch has `n_kv`× fewer blocks than the per-head
/// kernel's; small batches get more warps to split the context over.
fn gqa_attn_threads(rows: usize) -> u32 {
    match rows {
        0..16 => 512,
        16..64 => 256,
        _ => 128,
    }
}

impl CudaDevice {
    /// This device with the attention by KV head from `rows` rows instead of
    /// `QUIVER_CUDA_ATTN_GQA_MIN_ROWS` or the default (tests put small steps on it).
    pub fn with_attn_gqa_min_rows(mut self, rows: usize) -> Self {
        self.attn_gqa_min_rows = rows;
        self
    }

    /// The attention-by-KV-head kernel for a step of `rows` rows, where it applies: enough rows
    /// (see `attn_gqa_min_rows`), a head dim it is built for, at most `ATTN_GQA_MAX_GROUP` query
    /// heads per KV head.
    fn gqa_attention(&self, rows: usize, n_heads: usize, n_kv: usize, head_dim: usize) -> Option<sys::CUfunction> {
        let group = n_heads / n_kv;
        let i = [64, 128, 256].iter().position(|&d| d == head_dim)?;
        (rows >= self.attn_gqa_min_rows && group <= ATTN_GQA_MAX_GROUP && n_heads % n_kv == 0).then(|| self.k.paged_attention_gqa[(group > 4) as usize][i])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_attention_impl(&self, qkv: &Tensor, b: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        self.bind();
        let rows = b.positions.len();
        if rows == 0 {
            return;
        }
        let l = kv.layout;
        debug_assert!(l.head_dim <= MAX_HEAD_DIM, "refused at load by check_head_dim");
        let mut st = self.state.lock().unwrap();
        let rs = self.row_seq_ptr(&mut st, b);
        let pp = self.meta_ptr(&mut st, b.positions);
        let bt = self.meta_ptr(&mut st, b.block_tables);
        let (kc, vc) = (buf(&kv.k[layer]), buf(&kv.v[layer]));
        let stride = b.block_table_stride as i32;
        launch!(self, self.k.kv_write, (rows as u32, 1, 1), row_threads(l.n_kv_heads * l.head_dim);
            buf(qkv), rs, pp, bt, stride, kc, vc, n_heads as i32, l.n_kv_heads as i32, l.head_dim as i32, l.block_size as i32);
        self.mark("kv_write");
        let (tiles_at, n_tiles) = st.tiles;
        if n_tiles < rows && l.head_dim <= PREFILL_MAX_HEAD_DIM {
            // Some sequence brings several rows (prefill): tensor-core tiles of PREFILL_ROWS rows.
            let hd = l.head_dim;
            let f = self.k.prefill_attention[hd.div_ceil(32) - 1];
            let smem = prefill_smem_bytes(32 * hd.div_ceil(32)) as u32;
            let tp = st.meta.ptr + 4 * tiles_at as u64;
            let ob = self.shadow_for(&mut st, rows, n_heads * hd);
            launch!(self, f, (n_tiles as u32, n_heads as u32, 1), (PREFILL_THREADS, 1, 1), smem = smem;
                buf(qkv), kc, vc, tp, pp, bt, stride, buf(out), ob, n_heads as i32, l.n_kv_heads as i32, hd as i32, l.block_size as i32, scale);
            self.set_shadow(&mut st, ob, buf(out), rows * n_heads * hd);
            self.mark("attention prefill");
        } else if let Some(f) = self.gqa_attention(rows, n_heads, l.n_kv_heads, l.head_dim) {
            launch!(self, f, (rows as u32, l.n_kv_heads as u32, 1), (gqa_attn_threads(rows), 1, 1);
                buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), n_heads as i32, l.n_kv_heads as i32, l.block_size as i32, scale);
            self.mark("attention decode");
        } else {
            launch!(self, self.k.paged_attention, (rows as u32, n_heads as u32, 1), (attn_threads(rows), 1, 1);
                buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), n_heads as i32, l.n_kv_heads as i32, l.head_dim as i32, l.block_size as i32, scale);
            self.mark("attention decode");
        }
    }

}
