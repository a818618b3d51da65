// The model's small ops and paged attention on OpenCL (host side in mod.rs and attention.rs),
// portable OpenCL C 1.2. Conventions are the CPU device's: activations f32 row-major, the fused
// qkv row [q heads | k heads | v heads], the paged KV cache of a layer
// [num_blocks, block_size, n_kv_heads, head_dim] in f32.
//
// Every output element is computed by one work-item (or one work-group for a row reduction) in
// an order that depends only on its own row, so a row's result is the same in any batch: the
// engine's batched = alone property holds on this device as on the CPU.

__kernel void embedding_f32(__global const float* table, __global const u32* meta, int ids_off, __global float* out, int dim, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= dim || r >= rows) return;
    out[(size_t)r * dim + i] = table[(size_t)meta[ids_off + r] * dim + i];
}

__kernel void embedding_bf16(__global const ushort* table, __global const u32* meta, int ids_off, __global float* out, int dim, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= dim || r >= rows) return;
    out[(size_t)r * dim + i] = bf2f(table[(size_t)meta[ids_off + r] * dim + i]);
}

__kernel void gather_rows(__global const float* x, __global const u32* meta, int rows_off, __global float* out, int dim, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= dim || r >= rows) return;
    out[(size_t)r * dim + i] = x[(size_t)meta[rows_off + r] * dim + i];
}

__kernel void add_inplace(__global float* a, __global const float* b, int n) {
    const int i = get_global_id(0);
    if (i < n) a[i] += b[i];
}

// One work-group of ROW_WG per row; the sum of squares in a fixed order.
__kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void rms_norm(__global const float* x, __global const float* w, __global float* out, int dim, float eps) {
    __local float sh[ROW_WG];
    const size_t base = (size_t)get_group_id(0) * dim;
    row_rms_norm(x + base, w, out + base, dim, eps, sh);
}

// resid += delta; out = rmsnorm(resid) * w. Each work-item rereads only the elements it wrote.
__kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void add_rms_norm(__global float* resid, __global const float* delta, __global const float* w, __global float* out, int dim, float eps) {
    __local float sh[ROW_WG];
    const int lid = get_local_id(0);
    const size_t base = (size_t)get_group_id(0) * dim;
    float s = 0.f;
    for (int i = lid; i < dim; i += ROW_WG) {
        const float v = resid[base + i] + delta[base + i];
        resid[base + i] = v;
        s = fma(v, v, s);
    }
    const float inv = rsqrt(group_sum(s, sh) / dim + eps);
    for (int i = lid; i < dim; i += ROW_WG) out[base + i] = (resid[base + i] * inv) * w[i];
}

// Rotate-half RoPE on the first 2·hr dims of each q and k head of a fused qkv row (hr =
// rotary_dim / 2: partial rotary leaves the rest). Work-item (pair index over heads, row).
__kernel void rope_qk(__global float* qkv, __global const u32* meta, int pos_off, __global const float* cos_t, __global const float* sin_t,
                      int heads_qk, int head_dim, int hr, int width, int max_pos, int rows) {
    const int t = get_global_id(0), r = get_global_id(1);
    if (t >= heads_qk * hr || r >= rows) return;
    const int pos = min((int)meta[pos_off + r], max_pos - 1);
    const int h = t / hr, i = t - h * hr;
    __global float* p = qkv + (size_t)r * width + h * head_dim;
    const float c = cos_t[(size_t)pos * hr + i], s = sin_t[(size_t)pos * hr + i];
    const float x0 = p[i], x1 = p[i + hr];
    p[i] = x0 * c - x1 * s;
    p[i + hr] = x1 * c + x0 * s;
}

__kernel void silu_mul(__global const float* gu, __global float* out, int inter, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= inter || r >= rows) return;
    const float g = gu[(size_t)r * 2 * inter + i], u = gu[(size_t)r * 2 * inter + inter + i];
    out[(size_t)r * inter + i] = g / (1.f + exp(-g)) * u;
}

// Writes each new row's k and v (from the fused qkv buffer) into its cache slot. Work-item
// (element of the row's k/v, row). row_seq maps a row to its sequence (staged with the batch).
__kernel void kv_write(__global const float* qkv, __global const u32* meta, int rowseq_off, int pos_off, int bt_off, int bt_stride,
                       __global float* kc, __global float* vc, int n_heads, int n_kv, int head_dim, int block_size, int rows) {
    const int j = get_global_id(0), r = get_global_id(1);
    const int kvw = n_kv * head_dim;
    if (j >= kvw || r >= rows) return;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const u32 pos = meta[pos_off + r];
    const u32 blk = meta[bt_off + meta[rowseq_off + r] * bt_stride + pos / block_size];
    const size_t slot = (size_t)blk * block_size + pos % block_size;
    __global const float* k = qkv + (size_t)r * width + n_heads * head_dim;
    kc[slot * kvw + j] = k[j];
    vc[slot * kvw + j] = k[kvw + j];
}

// Causal attention of each new row (prefill and decode alike) against its sequence's cache up
// to and including its own position; GQA through kv head = head / (n_heads / n_kv). One
// work-group of ATTN_WG per (row, head). The context goes by in chunks of ATTN_WG keys: each
// work-item scores one key of the chunk (a dot product over the head in order), then every
// work-item folds the chunk into the online softmax in key order and adds p·v for its own dims
// (d = lid + e·ATTN_WG). No reduction tree: a row's output depends only on its q and context.
#ifndef ATTN_WG
#define ATTN_WG 64
#endif
#define ATTN_DPW 4 // dims per work-item: head_dim <= ATTN_WG * ATTN_DPW (checked at model load)
__kernel __attribute__((reqd_work_group_size(ATTN_WG, 1, 1)))
void paged_attention(__global const float* qkv, __global const float* kc, __global const float* vc, __global const u32* meta,
                     int rowseq_off, int pos_off, int bt_off, int bt_stride, __global float* out,
                     int n_heads, int n_kv, int head_dim, int block_size, float scale) {
    __local float q[ATTN_WG * ATTN_DPW];
    __local float s[ATTN_WG];
    __local u32 slots[ATTN_WG];
    const int r = get_group_id(0), h = get_group_id(1), lid = get_local_id(0);
    const int width = (n_heads + 2 * n_kv) * head_dim, kvw = n_kv * head_dim;
    const int kvh = h / (n_heads / n_kv);
    const int ctx = (int)meta[pos_off + r] + 1;
    __global const u32* table = meta + bt_off + meta[rowseq_off + r] * bt_stride;
    __global const float* qp = qkv + (size_t)r * width + h * head_dim;
    for (int d = lid; d < head_dim; d += ATTN_WG) q[d] = qp[d];
    barrier(CLK_LOCAL_MEM_FENCE);
    float acc[ATTN_DPW];
    for (int e = 0; e < ATTN_DPW; e++) acc[e] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int t0 = 0; t0 < ctx; t0 += ATTN_WG) {
        const int t = t0 + lid;
        float sc = -INFINITY;
        if (t < ctx) {
            const u32 slot = table[t / block_size] * block_size + t % block_size;
            slots[lid] = slot;
            __global const float* k = kc + (size_t)slot * kvw + kvh * head_dim;
            float dot = 0.f;
            for (int d = 0; d < head_dim; d++) dot = fma(q[d], k[d], dot);
            sc = dot * scale;
        }
        s[lid] = sc;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int n = min(ATTN_WG, ctx - t0);
        float mx = m;
        for (int j = 0; j < n; j++) mx = fmax(mx, s[j]);
        const float corr = exp(m - mx);
        l *= corr;
        for (int e = 0; e < ATTN_DPW; e++) acc[e] *= corr;
        for (int j = 0; j < n; j++) {
            const float p = exp(s[j] - mx);
            l += p;
            __global const float* v = vc + (size_t)slots[j] * kvw + kvh * head_dim;
            for (int e = 0; e < ATTN_DPW; e++) {
                const int d = lid + e * ATTN_WG;
                if (d < head_dim) acc[e] = fma(p, v[d], acc[e]);
            }
        }
        m = mx;
        barrier(CLK_LOCAL_MEM_FENCE); // s and slots are rewritten by the next chunk
    }
    __global float* o = out + (size_t)r * n_heads * head_dim + h * head_dim;
    for (int e = 0; e < ATTN_DPW; e++) {
        const int d = lid + e * ATTN_WG;
        if (d < head_dim) o[d] = acc[e] / l;
    }
}
