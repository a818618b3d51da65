// Quiver's CUDA kernels, compiled at start-up by NVRTC for the GPU's architecture (no CUDA
// headers needed: bf16 is handled as raw 16-bit patterns).
//
// Conventions match the CPU device: activations are f32 row-major, linear weights [out, in],
// the fused qkv row is [q heads | k heads | v heads], the paged KV cache of a layer is
// [num_blocks, block_size, n_kv_heads, head_dim] in bf16.

typedef unsigned short bf16_t;
typedef unsigned int u32;

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, NaN stays NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `sh` holds 33 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        float t = lane < nw ? sh[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

// Programmatic dependent launch (sm_90+; see `launch` in mod.rs): a kernel may be scheduled
// while its predecessor on the stream still drains. Every kernel therefore waits for the
// predecessor's completion (griddepcontrol.wait: a no-op when not launched that way) before it
// touches memory another kernel writes, then lets its own successor be scheduled. Only reads of
// weights (never written by a kernel) may come before it.
__device__ __forceinline__ void pdl_entry() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// x's rows of `cols` floats into bf16 rows `ldy` apart (a GEMM input with room after its rows).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long cols, long ldy, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / cols;
        y[r * ldy + (i - r * cols)] = f2bf(x[i]);
    }
}

// x ≈ hi + lo with both in bf16 (hi = bf16(x), lo = bf16(x − hi)): two bf16 GEMMs then carry
// ~16 bits of the f32 activations instead of 8.
extern "C" __global__ void f32_to_bf16_split(const float* __restrict__ x, bf16_t* __restrict__ hi, bf16_t* __restrict__ lo, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        bf16_t h = f2bf(x[i]);
        hi[i] = h;
        lo[i] = f2bf(x[i] - bf2f(h));
    }
}

extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b, int cols, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] += b[i % cols];
}

extern "C" __global__ void add_inplace(float* __restrict__ a, const float* __restrict__ b, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) a[i] += b[i];
}

// One block per row.
// The table holds vocab rows `start..start + rows` (the whole vocabulary, or a tensor-parallel
// rank's shard), `ld` elements apart; a token outside them gets a zero row (the ranks' rows are
// summed next).
extern "C" __global__ void embedding_bf16(const bf16_t* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim, int ld, u32 start, u32 rows) {
    pdl_entry();
    const u32 r = ids[blockIdx.x] - start;
    float* dst = out + (size_t)blockIdx.x * dim;
    if (r >= rows) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0.f;
        return;
    }
    const bf16_t* src = table + (size_t)r * ld;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf2f(src[i]);
}

extern "C" __global__ void embedding_f32(const float* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim, int ld, u32 start, u32 rows) {
    pdl_entry();
    const u32 r = ids[blockIdx.x] - start;
    float* dst = out + (size_t)blockIdx.x * dim;
    if (r >= rows) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0.f;
        return;
    }
    const float* src = table + (size_t)r * ld;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows, float* __restrict__ out, int dim) {
    pdl_entry();
    const float* src = x + (size_t)rows[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

// Ops whose output feeds a cuBLAS GEMM take `outb` (or null): a bf16 copy of `out` written in the
// same pass, so the GEMM needs no separate f32 → bf16 conversion of its input (mod.rs: `shadow`).
// Its rows are `ldb` elements apart (`ldb` ≥ the row's width: room after each row for columns the
// GEMM reads beside it, e.g. LoRA's shrink; docs/lora-in-the-gemm.md).

// Four floats as bf16 into 8 bytes.
__device__ __forceinline__ void store_bf16x4(bf16_t* p, float4 v) {
    *reinterpret_cast<uint2*>(p) = make_uint2((u32)f2bf(v.x) | ((u32)f2bf(v.y) << 16), (u32)f2bf(v.z) | ((u32)f2bf(v.w) << 16));
}

__device__ __forceinline__ float4 norm4(float4 v, float inv, float4 w) {
    return make_float4((v.x * inv) * w.x, (v.y * inv) * w.y, (v.z * inv) * w.z, (v.w * inv) * w.w);
}

// Second pass of both norms: given this thread's partial sum of squares of row `x` (already
// offset to the row), out = x / sqrt(mean(x²) + eps) * w, and its bf16 copy when `outb`.
__device__ __forceinline__ void rms_finish(const float* x, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, int dim,
                                           float eps, float s, float* sh) {
    s = block_sum(s, sh);
    const float inv = rsqrtf(s / dim + eps);
    if ((dim & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = norm4(x4[i], inv, w4[i]);
            reinterpret_cast<float4*>(out)[i] = v;
            if (outb) store_bf16x4(outb + 4 * i, v);
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = (x[i] * inv) * w[i];
        out[i] = v;
        if (outb) outb[i] = f2bf(v);
    }
}

// out = x / sqrt(mean(x²) + eps) * w, one block per row; 16-byte accesses when dim % 4 == 0
// (the host gives a block up to one thread per 4 elements, so a decode row is one load each).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, int dim, int ldb, float eps) {
    pdl_entry();
    __shared__ float sh[33];
    const size_t base = (size_t)blockIdx.x * dim;
    float s = 0.f;
    if ((dim & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x + base);
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            const float4 v = x4[i];
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = x[base + i]; s += v * v; }
    }
    rms_finish(x + base, w, out + base, outb ? outb + (size_t)blockIdx.x * ldb : nullptr, dim, eps, s, sh);
}

// resid += delta; out = rmsnorm(resid) * w. Each thread rereads only the elements it wrote.
extern "C" __global__ void add_rms_norm(float* __restrict__ resid, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out,
                                        bf16_t* __restrict__ outb, int dim, int ldb, float eps) {
    pdl_entry();
    __shared__ float sh[33];
    const size_t base = (size_t)blockIdx.x * dim;
    float s = 0.f;
    if ((dim & 3) == 0) {
        float4* r4 = reinterpret_cast<float4*>(resid + base);
        const float4* d4 = reinterpret_cast<const float4*>(delta + base);
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            float4 v = r4[i];
            const float4 d = d4[i];
            v.x += d.x, v.y += d.y, v.z += d.z, v.w += d.w;
            r4[i] = v;
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = resid[base + i] + delta[base + i]; resid[base + i] = v; s += v * v; }
    }
    rms_finish(resid + base, w, out + base, outb ? outb + (size_t)blockIdx.x * ldb : nullptr, dim, eps, s, sh);
}

// Rotate-half RoPE on the q and k heads of each fused qkv row. One block per row; threads
// walk (head, pair) indices. With `delta` (a LoRA delta computed beside the projection, same
// layout, or null) every column first gets its delta, v columns included.
extern "C" __global__ void rope_qk(float* __restrict__ qkv, const float* __restrict__ delta, const u32* __restrict__ positions, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, int heads_qk, int head_dim, int half, int width, int max_pos) {
    pdl_entry();
    int r = blockIdx.x;
    int pos = min((int)positions[r], max_pos - 1);
    const float* c = cos_t + (size_t)pos * half;
    const float* s = sin_t + (size_t)pos * half;
    float* row = qkv + (size_t)r * width;
    const float* dr = delta ? delta + (size_t)r * width : nullptr;
    for (int t = threadIdx.x; t < heads_qk * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float* p = row + h * head_dim;
        float x0 = p[i], x1 = p[i + half];
        if (dr) x0 += dr[h * head_dim + i], x1 += dr[h * head_dim + i + half];
        // Explicit fma (as rope_qk_lora): a row's RoPE is then bit-identical in both kernels,
        // whatever contraction the compiler would choose for each.
        p[i] = fmaf(x0, c[i], -(x1 * s[i]));
        p[i + half] = fmaf(x1, c[i], x0 * s[i]);
    }
    if (dr) {
        for (int j = heads_qk * head_dim + threadIdx.x; j < width; j += blockDim.x) row[j] += dr[j];
    }
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }

// out[r, i] = silu(gu[r, i]) · gu[r, inter + i]; 16-byte accesses when inter % 4 == 0. With
// `delta` (a LoRA delta of gu computed beside the projection, or null) gate and up get theirs
// first.
__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
extern "C" __global__ void silu_mul(const float* __restrict__ gu, const float* __restrict__ delta, float* __restrict__ out, bf16_t* __restrict__ outb, int inter, int ldb, long n) {
    pdl_entry();
    if ((inter & 3) == 0) {
        const int q = inter / 4;
        const float4* gu4 = reinterpret_cast<const float4*>(gu);
        const float4* d4 = reinterpret_cast<const float4*>(delta);
        float4* o4 = reinterpret_cast<float4*>(out);
        for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n / 4; idx += (long)gridDim.x * blockDim.x) {
            const long r = idx / q;
            const int i = (int)(idx - r * q);
            float4 g = gu4[r * 2 * q + i], u = gu4[r * 2 * q + q + i];
            if (d4) g = add4(g, d4[r * 2 * q + i]), u = add4(u, d4[r * 2 * q + q + i]);
            const float4 v = make_float4(silu_times(g.x, u.x), silu_times(g.y, u.y), silu_times(g.z, u.z), silu_times(g.w, u.w));
            o4[idx] = v;
            if (outb) store_bf16x4(outb + r * ldb + 4 * i, v);
        }
        return;
    }
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x) {
        long r = idx / inter;
        int i = (int)(idx - r * inter);
        const size_t gi = r * 2 * inter + i, ui = gi + inter;
        const float v = silu_times(gu[gi] + (delta ? delta[gi] : 0.f), gu[ui] + (delta ? delta[ui] : 0.f));
        out[idx] = v;
        if (outb) outb[r * ldb + i] = f2bf(v);
    }
}

// Writes each new row's k and v into its cache slot (bf16). One block per row.
extern "C" __global__ void kv_write(const float* __restrict__ qkv, const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                    const u32* __restrict__ block_tables, int bt_stride, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                    int n_heads, int n_kv, int head_dim, int block_size) {
    pdl_entry();
    int r = blockIdx.x;
    int width = (n_heads + 2 * n_kv) * head_dim;
    int kvw = n_kv * head_dim;
    u32 pos = positions[r];
    u32 blk = block_tables[(size_t)row_seq[r] * bt_stride + pos / block_size];
    size_t slot = (size_t)blk * block_size + pos % block_size;
    const float* k = qkv + (size_t)r * width + n_heads * head_dim;
    const float* v = k + kvw;
    for (int j = threadIdx.x; j < kvw; j += blockDim.x) {
        kc[slot * kvw + j] = f2bf(k[j]);
        vc[slot * kvw + j] = f2bf(v[j]);
    }
}

#define ATTN_WARPS 16 // most warps per block (mod.rs: attn_threads)
#define MAX_DPL 8 // dims per lane: head_dim <= 256

// Causal attention of each new row against its sequence's cache, up to and including its own
// position. Grid (rows, n_heads), ATTN_WARPS warps per block. Each warp walks a strided share of
// the context with an online softmax; lane l owns dims l, l+32, ...; the warps' partial states
// are merged through shared memory at the end.
// The block may have 1..ATTN_WARPS warps (the host gives small batches all of them: fewer keys
// per warp, less latency; large batches fewer, so more blocks fit on an SM).
extern "C" __global__ void paged_attention(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                           const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                           const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                           int n_heads, int n_kv, int head_dim, int block_size, float scale) {
    pdl_entry();
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    __shared__ float sm_acc[ATTN_WARPS][MAX_DPL * 32];
    int r = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int width = (n_heads + 2 * n_kv) * head_dim;
    int kvw = n_kv * head_dim;
    int kvh = h / (n_heads / n_kv);
    int ctx = (int)positions[r] + 1;
    const u32* table = block_tables + (size_t)row_seq[r] * bt_stride;
    const float* q = qkv + (size_t)r * width + h * head_dim;
    const int nw = blockDim.x >> 5;

    float qv[MAX_DPL], acc[MAX_DPL];
#pragma unroll
    for (int j = 0; j < MAX_DPL; j++) {
        int d = lane + 32 * j;
        qv[j] = d < head_dim ? q[d] * scale : 0.f;
        acc[j] = 0.f;
    }
    float m = -__int_as_float(0x7f800000), l = 0.f;
#pragma unroll 2
    for (int t = warp; t < ctx; t += nw) {
        size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        const bf16_t* k = kc + slot * kvw + kvh * head_dim;
        const bf16_t* v = vc + slot * kvw + kvh * head_dim;
        float part = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_DPL; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) part += qv[j] * bf2f(k[d]);
        }
        float sc = warp_sum(part);
        float mn = fmaxf(m, sc);
        float corr = __expf(m - mn);
        float p = __expf(sc - mn);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < MAX_DPL; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) acc[j] = acc[j] * corr + p * bf2f(v[d]);
        }
        m = mn;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int j = 0; j < MAX_DPL; j++) {
        int d = lane + 32 * j;
        if (d < head_dim) sm_acc[warp][d] = acc[j];
    }
    __syncthreads();
    float M = -__int_as_float(0x7f800000);
    for (int w = 0; w < nw; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.f;
    for (int w = 0; w < nw; w++) L += sm_l[w] * __expf(sm_m[w] - M);
    float* o = out + (size_t)r * n_heads * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < nw; w++) s += sm_acc[w][d] * __expf(sm_m[w] - M);
        o[d] = s / L;
    }
}
