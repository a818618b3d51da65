//! Attention on CUDA: the KV write of a step's rows, then tensor-core prefill attention
//! (`prefill_attention_*` in prefill_attention.cu) for the sequences that bring several rows,
//! the step's one-row sequences going to the attention by KV head where it is built for the
//! shape (else to the prefill kernel too); in a step without such sequences, decode attention:
//! by KV head (`decode_attention.cu`, every query head of a KV head in one block, so
//! a cached K/V row is read once) from `attn_gqa_min_rows` rows, per query head below that
//! (`paged_attention` in kernels.cu, whose blocks split a short batch's long context finer).
//! The attention by KV head has two kernels: `decode_attention_kv_*` (the default: K/V streamed
//! through per-warp cp.async rings, coalesced; session 23, H100, 8B shape: decode 16,885 →
//! 21,160 tok/s at 256 rows, 7,205 → 8,281 at 64) and the first, `paged_attention_gqa_*`
//! (`QUIVER_CUDA_ATTN_DECODE=v1`, kept for A/B runs).

use super::gemm::Shadow;
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

/// Head dims the attention by KV head is built for (the index of its kernels).
const ATTN_GQA_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The index of the attention-by-KV-head kernels for this shape, if they are built for it.
fn gqa_head_dim(n_heads: usize, n_kv: usize, head_dim: usize) -> Option<usize> {
    let i = ATTN_GQA_HEAD_DIMS.iter().position(|&d| d == head_dim)?;
    (n_heads / n_kv <= ATTN_GQA_MAX_GROUP && n_heads.is_multiple_of(n_kv)).then_some(i)
}

/// Warps per block of `decode_attention_kv_*` (`KVD_WARPS`), each streaming its own tiles of
/// the context.
const KV_WARPS: usize = 4;

/// Shared-memory bytes of one warp's ring in `decode_attention_kv_*` (`KVD_RING` × 2): two tiles
/// of 2048 / head_dim keys, a K row padded by 16 bytes and a V row each, bf16 (~17 KB, so the
/// block's ≤ 68 KB plus ≤ 10 KB static fit every sm_80+ GPU's per-block limit, 99 KB on sm_86 /
/// sm_89, and three blocks fit an H100 SM).
fn kv_ring_bytes(head_dim: usize) -> usize {
    2 * (2048 / head_dim) * (2 * head_dim + 8) * 2
}

/// The attention-by-KV-head kernels `decode_attention_kv_{64,128,256}_{1,2,4,8}` (built for up to
/// 1, 2, 4, 8 query heads per KV head: the loops run over all of a build's heads) and which of
/// the two kernels runs (`QUIVER_CUDA_ATTN_DECODE`, read in init.rs).
pub(super) struct DecodeAttn {
    kv: [[sys::CUfunction; 3]; 4],
    /// Run the first kernel (`paged_attention_gqa_*`) instead.
    pub(super) v1: bool,
}

impl DecodeAttn {
    /// The kernels from the module (`f` loads one by name), with their dynamic shared-memory
    /// limit raised to what `paged_attention_impl` launches them with.
    pub(super) fn load(f: &dyn Fn(&str) -> Result<sys::CUfunction>, v1: bool) -> Result<Self> {
        let kv = [
            [f("decode_attention_kv_64_1")?, f("decode_attention_kv_128_1")?, f("decode_attention_kv_256_1")?],
            [f("decode_attention_kv_64_2")?, f("decode_attention_kv_128_2")?, f("decode_attention_kv_256_2")?],
            [f("decode_attention_kv_64_4")?, f("decode_attention_kv_128_4")?, f("decode_attention_kv_256_4")?],
            [f("decode_attention_kv_64_8")?, f("decode_attention_kv_128_8")?, f("decode_attention_kv_256_8")?],
        ];
        for fs in &kv {
            for (&kf, hd) in fs.iter().zip(ATTN_GQA_HEAD_DIMS) {
                let bytes = (KV_WARPS * kv_ring_bytes(hd)) as i32;
                // SAFETY: a function of the loaded module; at most 68 KB, within every sm_80+
                // GPU's per-block limit. The carveout is a hint: all the shared memory an SM has
                // (three blocks' worth on an H100), the kernel's K/V bypass L1 anyway.
                unsafe {
                    result::function::set_function_attribute(kf, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
                        .context("raising the decode attention's shared-memory limit")?;
                    result::function::set_function_attribute(kf, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                        .context("setting the decode attention's shared-memory carveout")?;
                }
            }
        }
        Ok(DecodeAttn { kv, v1 })
    }
}

impl CudaDevice {
    /// This device with the first attention-by-KV-head kernel (`v1`, as
    /// `QUIVER_CUDA_ATTN_DECODE=v1`) or the streamed one, so tests check each whatever the
    /// default.
    pub fn with_attn_decode(mut self, v1: bool) -> Self {
        self.attn_decode.v1 = v1;
        self
    }

    /// This device with the attention by KV head from `rows` rows instead of
    /// `QUIVER_CUDA_ATTN_GQA_MIN_ROWS` or the default (tests put small steps on it).
    pub fn with_attn_gqa_min_rows(mut self, rows: usize) -> Self {
        self.attn_gqa_min_rows = rows;
        self
    }

    /// Whether the attention by KV head serves a step of `rows` rows: enough rows (see
    /// `attn_gqa_min_rows`), a head dim it is built for (`Some(its index in
    /// ATTN_GQA_HEAD_DIMS)`), at most `ATTN_GQA_MAX_GROUP` query heads per KV head.
    fn gqa_attention(&self, rows: usize, n_heads: usize, n_kv: usize, head_dim: usize) -> Option<usize> {
        (rows >= self.attn_gqa_min_rows).then(|| gqa_head_dim(n_heads, n_kv, head_dim)).flatten()
    }

    /// `decode_attention_kv_*` over `count` rows: rows 0.. in order (`row_tiles` 0) or the first
    /// rows of the `count` prefill tiles at `row_tiles`; `i` indexes the head dim.
    #[allow(clippy::too_many_arguments)]
    fn attention_kv(&self, i: usize, count: usize, row_tiles: u64, qkv: &Tensor, kc: u64, vc: u64, rs: u64, pp: u64, bt: u64, stride: i32, out: &Tensor, ob: Shadow, n_heads: usize, l: KvLayout, scale: f32) {
        // One block per (row, KV head), KV heads fastest, from the build for the fewest heads
        // that holds the group (1, 2, 4 or 8); the bf16 copy of the output for the o-projection
        // GEMM is written in the same pass.
        let (hd, build) = (l.head_dim, (n_heads / l.n_kv_heads).next_power_of_two().trailing_zeros() as usize);
        launch!(self, self.attn_decode.kv[build][i], ((count * l.n_kv_heads) as u32, 1, 1), ((KV_WARPS * 32) as u32, 1, 1), smem = (KV_WARPS * kv_ring_bytes(hd)) as u32;
            buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), ob.ptr, ob.ld as i32, row_tiles, n_heads as i32, l.n_kv_heads as i32, l.block_size as i32, scale);
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
            // A mixed step's one-row sequences (its decode rows, the last `single_tiles` tiles)
            // go to the attention by KV head where it is built for the shape: in the prefill
            // kernel each would take a 64-row tile per query head and read its K/V once per
            // query head (with 256 decode rows in an 8B step, ~4× the bytes of the decode kernel).
            let hd = l.head_dim;
            let by_kv = if self.attn_decode.v1 { None } else { gqa_head_dim(n_heads, l.n_kv_heads, hd) };
            let singles = if by_kv.is_some() { st.single_tiles } else { 0 };
            let f = self.k.prefill_attention[hd.div_ceil(32) - 1];
            let smem = prefill_smem_bytes(32 * hd.div_ceil(32)) as u32;
            let tp = st.meta.ptr + 4 * tiles_at as u64;
            let ob = self.shadow_for(&mut st, rows, n_heads * hd);
            launch!(self, f, ((n_tiles - singles) as u32, n_heads as u32, 1), (PREFILL_THREADS, 1, 1), smem = smem;
                buf(qkv), kc, vc, tp, pp, bt, stride, buf(out), ob.ptr, ob.ld as i32, n_heads as i32, l.n_kv_heads as i32, hd as i32, l.block_size as i32, scale);
            if let (Some(i), true) = (by_kv, singles > 0) {
                let singles_at = tp + 4 * 3 * (n_tiles - singles) as u64;
                self.attention_kv(i, singles, singles_at, qkv, kc, vc, rs, pp, bt, stride, out, ob, n_heads, l, scale);
            }
            self.set_shadow(&mut st, ob, buf(out), rows * n_heads * hd);
            self.mark("attention prefill");
        } else if let Some(i) = self.gqa_attention(rows, n_heads, l.n_kv_heads, l.head_dim) {
            let group = n_heads / l.n_kv_heads;
            if self.attn_decode.v1 {
                launch!(self, self.k.paged_attention_gqa[(group > 4) as usize][i], (rows as u32, l.n_kv_heads as u32, 1), (gqa_attn_threads(rows), 1, 1);
                    buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), n_heads as i32, l.n_kv_heads as i32, l.block_size as i32, scale);
            } else {
                let ob = self.shadow_for(&mut st, rows, n_heads * l.head_dim);
                self.attention_kv(i, rows, 0, qkv, kc, vc, rs, pp, bt, stride, out, ob, n_heads, l, scale);
                self.set_shadow(&mut st, ob, buf(out), rows * n_heads * l.head_dim);
            }
            self.mark("attention decode");
        } else {
            launch!(self, self.k.paged_attention, (rows as u32, n_heads as u32, 1), (attn_threads(rows), 1, 1);
                buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), n_heads as i32, l.n_kv_heads as i32, l.head_dim as i32, l.block_size as i32, scale);
            self.mark("attention decode");
        }
    }

}
