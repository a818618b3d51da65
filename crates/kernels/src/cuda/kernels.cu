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

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] = f2bf(x[i]);
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
extern "C" __global__ void embedding_bf16(const bf16_t* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim) {
    pdl_entry();
    const bf16_t* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf2f(src[i]);
}

extern "C" __global__ void embedding_f32(const float* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim) {
    pdl_entry();
    const float* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
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
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, int dim, float eps) {
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
    rms_finish(x + base, w, out + base, outb ? outb + base : nullptr, dim, eps, s, sh);
}

// resid += delta; out = rmsnorm(resid) * w. Each thread rereads only the elements it wrote.
extern "C" __global__ void add_rms_norm(float* __restrict__ resid, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out,
                                        bf16_t* __restrict__ outb, int dim, float eps) {
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
    rms_finish(resid + base, w, out + base, outb ? outb + base : nullptr, dim, eps, s, sh);
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
        p[i] = x0 * c[i] - x1 * s[i];
        p[i + half] = x1 * c[i] + x0 * s[i];
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
extern "C" __global__ void silu_mul(const float* __restrict__ gu, const float* __restrict__ delta, float* __restrict__ out, bf16_t* __restrict__ outb, int inter, long n) {
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
            if (outb) store_bf16x4(outb + 4 * idx, v);
        }
        return;
    }
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x) {
        long r = idx / inter;
        int i = (int)(idx - r * inter);
        const size_t gi = r * 2 * inter + i, ui = gi + inter;
        const float v = silu_times(gu[gi] + (delta ? delta[gi] : 0.f), gu[ui] + (delta ? delta[ui] : 0.f));
        out[idx] = v;
        if (outb) outb[idx] = f2bf(v);
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

// ---- small-M GEMV: y[m, n] = x[m, :] · W[n, :] (+ bias[n]) for M ≤ 8 rows, bf16 W, any k ---------
// Decode is bandwidth-bound on W: one warp per output column streams its W row once with 16-byte
// loads and applies it to all M input rows (f32, read through the cache), so W is read once per
// step whatever M is. Each (m, n) accumulates in the same order for every M, so a row's result
// does not depend on which other rows share the step.
template <int M>
__device__ __forceinline__ void gemv_bf16_impl(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,
                                               float* __restrict__ y, int n, int k) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= n) return;
    const bf16_t* wr = w + (size_t)row * k;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    if ((k & 7) == 0) {
        const uint4* w4 = reinterpret_cast<const uint4*>(wr);
        int k8 = k >> 3;
#pragma unroll 4
        for (int i = lane; i < k8; i += 32) {
            uint4 p = __ldg(w4 + i);
            float wv[8] = {__uint_as_float(p.x << 16), __uint_as_float(p.x & 0xffff0000u), __uint_as_float(p.y << 16), __uint_as_float(p.y & 0xffff0000u),
                           __uint_as_float(p.z << 16), __uint_as_float(p.z & 0xffff0000u), __uint_as_float(p.w << 16), __uint_as_float(p.w & 0xffff0000u)};
#pragma unroll
            for (int m = 0; m < M; m++) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)m * k) + 2 * i;
                float4 a = xr[0], b = xr[1];
                acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
            }
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            float wv = bf2f(wr[i]);
#pragma unroll
            for (int m = 0; m < M; m++) acc[m] += wv * x[(size_t)m * k + i];
        }
    }
    float b = bias ? bias[row] : 0.f;
#pragma unroll
    for (int m = 0; m < M; m++) {
        float s = warp_sum(acc[m]);
        if (lane == m) y[(size_t)m * n + row] = s + b;
    }
}

#define GEMV(M) \
    extern "C" __global__ void gemv_bf16_##M(const float* x, const bf16_t* w, const float* bias, float* y, int n, int k) { pdl_entry(); gemv_bf16_impl<M>(x, w, bias, y, n, k); }
GEMV(1) // the fallback for k % 8 != 0 (gemv1_bf16 below handles the rest)


// ---- single-row GEMV for decode -----------------------------------------------------------------
// y[n] = x · W[n, :]ᵀ (+ bias[n]) for one f32 row x and bf16 W, k % 8 == 0. Batch-1 decode streams
// every weight once per step, so this kernel is the step's bound. Each warp owns GV_ROWS rows and
// streams them through its own GV_STAGES-deep ring in shared memory with cp.async (16 bytes per
// lane, L1 bypassed): GV_STAGES - 1 stages stay in flight while one is consumed. (Loads into
// registers let ptxas sink them next to their FMAs, leaving only ~3 in flight per lane.) Each lane
// reads back only the slots it copied itself, so the ring needs no barrier. x (f32) is read
// through L1, shared by all warps of the SM.
#define GV_ROWS 2
#define GV_U 2
#define GV_STAGES 4
#define GV_WARPS 4

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float dot8(uint4 p, float4 a, float4 b, float acc) {
    acc = fmaf(__uint_as_float(p.x << 16), a.x, acc);
    acc = fmaf(__uint_as_float(p.x & 0xffff0000u), a.y, acc);
    acc = fmaf(__uint_as_float(p.y << 16), a.z, acc);
    acc = fmaf(__uint_as_float(p.y & 0xffff0000u), a.w, acc);
    acc = fmaf(__uint_as_float(p.z << 16), b.x, acc);
    acc = fmaf(__uint_as_float(p.z & 0xffff0000u), b.y, acc);
    acc = fmaf(__uint_as_float(p.w << 16), b.z, acc);
    acc = fmaf(__uint_as_float(p.w & 0xffff0000u), b.w, acc);
    return acc;
}

// What a warp does with its two dot products. Each saves a whole kernel (and the round trip of
// its input through memory) on the latency-bound chain of a batch-1 decode step:
// - GV_PLAIN: rows 2p and 2p + 1 of y.
// - GV_SILU: rows p and inter + p of a fused [gate; up] weight; y[p] = silu(gate) · up, as silu_mul.
// - GV_ROPE: over a fused qkv weight, the rotate-half pair (i, i + half) of a q or k head, rotated
//   at the row's position exactly as rope_qk does; v rows in consecutive pairs as GV_PLAIN.
#define GV_PLAIN 0
#define GV_SILU 1
#define GV_ROPE 2
struct GemvEpilogue {
    int inter;        // GV_SILU: half the weight's rows
    int heads_qk;     // GV_ROPE: q + k heads
    int head_dim;     // GV_ROPE
    int max_pos;      // GV_ROPE: rows of the cos / sin tables
    const u32* pos;   // GV_ROPE: the row's position
    const float* cos_t;
    const float* sin_t;
};

template <int MODE>
__device__ __forceinline__ void gemv_rows(const GemvEpilogue& e, int p, int n, int& r0, int& r1, bool& live) {
    if (MODE == GV_SILU) {
        r0 = p, r1 = e.inter + p, live = p < e.inter;
    } else if (MODE == GV_ROPE && p < e.heads_qk * (e.head_dim >> 1)) {
        const int half = e.head_dim >> 1, h = p / half, i = p - h * half;
        r0 = h * e.head_dim + i, r1 = r0 + half, live = true;
    } else {
        const int v0 = MODE == GV_ROPE ? e.heads_qk * e.head_dim + 2 * (p - e.heads_qk * (e.head_dim >> 1)) : 2 * p;
        r0 = v0, r1 = v0 + 1, live = v0 < n;
    }
    r0 = min(r0, n - 1), r1 = min(r1, n - 1); // a dead warp still holds valid addresses
}

// A LoRA delta folded into the single-row GEMV (`Device::matmul_lora` at one row), shrink and
// expand both, so the site is one launch and the shrink's latency hides behind the weight stream.
// The shrink t = x·Aᵀ of the row is cut into pieces (gy groups of 8 A rows × `splits` runs of kc
// inputs). Each block takes a ticket when it starts; the first P = gy·splits tickets each compute
// one piece (their split partial sums, scratch regions 1..) before streaming their weight rows,
// and the block that finishes the last piece adds the partials in split order into region 0 and
// raises the ready flag. Each warp, once its two dot products are done, waits for the flag and
// adds s_j · Σ_k t[j·r + k] · Bᵀ[slot][k][col] to its columns before the epilogue, so RoPE /
// SiLU·mul stay fused. Tickets go out in the order blocks start, so every piece belongs to a
// block already running that waits on nothing before finishing it: no deadlock whatever the
// grid (the host keeps P ≤ blocks). The last block to leave zeroes the counters for the next
// launch (a recorded step replays this kernel). The sums do not depend on which block computed
// which piece. Which slot (if any) and its rank are data: a recorded step replays for any
// adapter, and a base row skips all of it. With `ahead` the RMSNorm before computed t already
// (lora_ahead.cu): no tickets, no pieces, no flag; the epilogue reads t at once.
struct GemvLora {
    float* t;          // scratch: region 0 the final t (n·r), region 1 + z split z's partials (W = n·R)
    const bf16_t* A;   // (S, n·R, k)
    const bf16_t* B;   // Bᵀ (S, R, b_ld)
    const u32* G;      // packed groups of the one row
    const u32* ranks;  // [slot]
    const float* scal; // [slot][3]
    u32* ctr;          // [ticket, pieces done, t ready, blocks left], zero between launches
    int C, n_slices, R, b_ld, off1, off2, gy, splits, kc;
    int ahead;         // t is already in region 0 (computed ahead, lora_ahead.cu): no pieces, no waiting
};

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The ticket and, for the first P tickets, one piece of the shrink (every thread of the block).
__device__ __forceinline__ void gemv_lora_piece(const float* __restrict__ x, int k, const GemvLora& L, int slot, int nr) {
    __shared__ int ticket;
    __shared__ bool last;
    if (threadIdx.x == 0) ticket = (int)atomicAdd(L.ctr, 1u);
    __syncthreads();
    const int P = L.gy * L.splits, i = ticket;
    if (i >= P) return;
    const int W = L.n_slices * L.R, cy = i % L.gy, z = i / L.gy;
    const int lane = threadIdx.x & 31, c = cy * 8 + (threadIdx.x >> 5) * 2;
    const int k0 = z * L.kc, k1 = min(k, k0 + L.kc);
    if (c < nr) {
        const bool two = c + 1 < nr;
        const uint4* a0 = reinterpret_cast<const uint4*>(L.A + ((size_t)slot * W + c) * k);
        const uint4* a1 = reinterpret_cast<const uint4*>(L.A + ((size_t)slot * W + c + (two ? 1 : 0)) * k);
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float acc0 = 0.f, acc1 = 0.f;
        for (int kb = (k0 >> 3) + lane; kb < (k1 >> 3); kb += 32) {
            const uint4 u = __ldg(a0 + kb), v = __ldg(a1 + kb);
            const float4 xa = __ldg(x4 + 2 * kb), xb = __ldg(x4 + 2 * kb + 1);
            acc0 = dot8(u, xa, xb, acc0);
            acc1 = dot8(v, xa, xb, acc1);
        }
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
            L.t[(size_t)(1 + z) * W + c] = acc0;
            if (two) L.t[(size_t)(1 + z) * W + c + 1] = acc1;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(L.ctr + 1, 1u) == (u32)P - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < nr; e += blockDim.x) {
        float v = 0.f;
        for (int zz = 0; zz < L.splits; ++zz) v += __ldcg(L.t + (size_t)(1 + zz) * W + e);
        L.t[e] = v;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicExch(L.ctr + 2, 1u);
}

template <int MODE, bool LORA>
__device__ __forceinline__ void gemv1_body(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,
                                           float* __restrict__ y, int n, int k, const GemvEpilogue& e, const GemvLora& L) {
    __shared__ uint4 ring[GV_WARPS][GV_STAGES][GV_ROWS][GV_U][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Without LoRA a warp computes one pair of outputs. With it the grid is at most what fits
    // on the GPU at once (lora.rs) and each warp loops over pairs, so the LoRA work each block
    // does once (its ticket, waiting for t, leaving) is paid once per block, not once per
    // 64 KiB of weights: with a block per pair it cost ~25% of the weight stream's rate.
    int p = blockIdx.x * GV_WARPS + warp;
    int rows[GV_ROWS];
    bool live;
    gemv_rows<MODE>(e, p, n, rows[0], rows[1], live);
    if (!LORA && !live) return;
    const int k8 = k >> 3;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint4* wr[GV_ROWS];
    const int per = 32 * GV_U; // 16-byte chunks of a row per stage
    const int stages = k8 / per;
    auto issue = [&](int s) {
        if (s < stages) {
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++)
#pragma unroll
                for (int u = 0; u < GV_U; u++) cp_async16(&ring[warp][s % GV_STAGES][r][u][lane], wr[r] + s * per + u * 32 + lane);
        }
        cp_async_commit(); // empty groups keep the count uniform
    };
    auto start = [&]() {
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) wr[r] = reinterpret_cast<const uint4*>(w + (size_t)rows[r] * k);
#pragma unroll
        for (int s = 0; s < GV_STAGES - 1; s++) issue(s);
    };
    // W is never written by a kernel: the first pair's first stages are requested before
    // waiting for the kernel that produced x.
    if (live) start();
    pdl_entry();
    // LoRA: the row's slot and rank (the same for the whole grid), then this block's ticket.
    int slot = 0, rk = 0;
    if (LORA) {
        if (L.G[0] > 0) slot = L.G[1 + 3 * L.C], rk = L.ranks[slot];
        if (rk > 0 && !L.ahead) gemv_lora_piece(x, k, L, slot, L.n_slices * rk);
    }
    // t of each slice at this lane's rank steps, loaded once the first pair needs it (or at
    // once when the norm computed it ahead: then the loads overlap the weight stream).
    float tv[3][2];
    bool have_t = false;
    if (LORA && rk > 0 && L.ahead) {
#pragma unroll
        for (int j = 0; j < 3; j++)
#pragma unroll
            for (int q = 0; q < 2; q++) tv[j][q] = j < L.n_slices && lane + 32 * q < rk ? __ldcg(L.t + j * rk + lane + 32 * q) : 0.f;
        have_t = true;
    }
    while (live) {
        // The expand's operands that no kernel writes (Bᵀ of this warp's two columns, a rank
        // step per lane, and their slices' scalings) load now, so only t is left for the tail.
        float bl[GV_ROWS][2], sc[GV_ROWS];
        int js[GV_ROWS];
        if (LORA && rk > 0) {
            const bf16_t* b = L.B + (size_t)slot * L.R * L.b_ld;
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                const int o = rows[r];
                js[r] = (o >= L.off1) + (o >= L.off2);
                sc[r] = L.scal[slot * 3 + js[r]];
#pragma unroll
                for (int q = 0; q < 2; q++) bl[r][q] = lane + 32 * q < rk ? bf2f(b[(size_t)(lane + 32 * q) * L.b_ld + o]) : 0.f;
            }
        }
        float acc[GV_ROWS];
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) acc[r] = 0.f;
        for (int s = 0; s < stages; s++) {
            issue(s + GV_STAGES - 1);
            cp_async_wait<GV_STAGES - 1>();
#pragma unroll
            for (int u = 0; u < GV_U; u++) {
                const int i = s * per + u * 32 + lane;
                const float4 a = __ldg(x4 + 2 * i), b = __ldg(x4 + 2 * i + 1);
#pragma unroll
                for (int r = 0; r < GV_ROWS; r++) acc[r] = dot8(ring[warp][s % GV_STAGES][r][u][lane], a, b, acc[r]);
            }
        }
        for (int i = stages * per + lane; i < k8; i += 32) {
            const float4 a = __ldg(x4 + 2 * i), b = __ldg(x4 + 2 * i + 1);
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) acc[r] = dot8(__ldg(wr[r] + i), a, b, acc[r]);
        }
        // This pair's outputs; the next pair's first stages are requested before its tail.
        const int pc = p, r0 = rows[0], r1 = rows[1];
        if (LORA) {
            p += gridDim.x * GV_WARPS;
            gemv_rows<MODE>(e, p, n, rows[0], rows[1], live);
            if (live) start();
        } else {
            live = false;
        }
        const int cur[GV_ROWS] = {r0, r1};
        float v[GV_ROWS];
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) v[r] = warp_sum(acc[r]) + (bias ? bias[cur[r]] : 0.f);
        if (LORA && rk > 0) {
            if (!have_t) {
                // Every lane acquires the flag itself (one coalesced load), so its reads of t
                // below are ordered after the reducer's writes.
                while (!L.ahead && ld_acquire(L.ctr + 2) == 0u) {
                }
#pragma unroll
                for (int j = 0; j < 3; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) tv[j][q] = j < L.n_slices && lane + 32 * q < rk ? __ldcg(L.t + j * rk + lane + 32 * q) : 0.f;
                have_t = true;
            }
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                float d = 0.f;
#pragma unroll
                for (int q = 0; q < 2; q++) d += bl[r][q] * (js[r] == 0 ? tv[0][q] : js[r] == 1 ? tv[1][q] : tv[2][q]);
                v[r] += sc[r] * warp_sum(d);
            }
        }
        if (lane == 0) {
            if (MODE == GV_SILU) {
                y[pc] = silu_times(v[0], v[1]);
            } else if (MODE == GV_ROPE && pc < e.heads_qk * (e.head_dim >> 1)) {
                const int half = e.head_dim >> 1, i = pc - (pc / half) * half;
                const int pos = min((int)e.pos[0], e.max_pos - 1);
                const float c = e.cos_t[(size_t)pos * half + i], sn = e.sin_t[(size_t)pos * half + i];
                y[r0] = v[0] * c - v[1] * sn;
                y[r1] = v[1] * c + v[0] * sn;
            } else {
                y[r0] = v[0];
                if (r1 > r0) y[r1] = v[1];
            }
        }
    }
    // The last block to leave zeroes the counters for the next launch.
    if (LORA && rk > 0 && !L.ahead) {
        __syncthreads();
        if (threadIdx.x == 0 && atomicAdd(L.ctr + 3, 1u) == gridDim.x - 1) L.ctr[0] = 0, L.ctr[1] = 0, L.ctr[2] = 0, L.ctr[3] = 0;
    }
}

#define GEMV1_KERNEL(NAME, MODE)                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                                                              \
        NAME(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y, int n, int k, \
             int inter_or_heads_qk, int head_dim, int max_pos,                                                                               \
             const u32* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t) {                                \
        const GemvEpilogue e = {inter_or_heads_qk, inter_or_heads_qk, head_dim, max_pos, pos, cos_t, sin_t};                                 \
        const GemvLora L = {};                                                                                                                \
        gemv1_body<MODE, false>(x, w, bias, y, n, k, e, L);                                                                                   \
    }
GEMV1_KERNEL(gemv1_bf16, GV_PLAIN)
GEMV1_KERNEL(gemv1_silu_bf16, GV_SILU)
GEMV1_KERNEL(gemv1_rope_bf16, GV_ROPE)

#define GEMV1_LORA_KERNEL(NAME, MODE)                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                                                              \
        NAME(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y, int n, int k, \
             int inter_or_heads_qk, int head_dim, int max_pos,                                                                               \
             const u32* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t,                                  \
             float* lt, const bf16_t* lA, const bf16_t* lB, const u32* lG, const u32* lranks, const float* lscal, u32* lctr,                 \
             int lC, int ln_slices, int lR, int lb_ld, int loff1, int loff2, int lgy, int lsplits, int lkc, int lahead) {                    \
        const GemvEpilogue e = {inter_or_heads_qk, inter_or_heads_qk, head_dim, max_pos, pos, cos_t, sin_t};                                 \
        const GemvLora L = {lt, lA, lB, lG, lranks, lscal, lctr, lC, ln_slices, lR, lb_ld, loff1, loff2, lgy, lsplits, lkc, lahead};         \
        gemv1_body<MODE, true>(x, w, bias, y, n, k, e, L);                                                                                    \
    }
GEMV1_LORA_KERNEL(gemv1_lora_bf16, GV_PLAIN)
GEMV1_LORA_KERNEL(gemv1_lora_silu_bf16, GV_SILU)
GEMV1_LORA_KERNEL(gemv1_lora_rope_bf16, GV_ROPE)

// ---- prefill attention on tensor cores ----------------------------------------------------------
// Flash-attention style: a block takes FA_BM consecutive query rows of one sequence (16 per warp)
// and one head, stages K/V tiles of FA_BN keys from the paged cache (bf16, straight from the block
// table) in shared memory, computes S = Q·Kᵀ and O += P·V with mma.sync m16n8k16 (bf16 operands,
// f32 accumulation) and keeps the softmax online in f32 (exp2 with log2 e folded into Q's scale).
// Q and P are rounded to bf16 for the tensor cores, as flash attention does. Causal per row: key t
// is visible to a row at position p iff t <= p (rows of a sequence have ascending positions).
// `tiles` holds (first row, row count, sequence) per block. HD is head_dim rounded up to a multiple
// of 32 (padding dims are zero in Q, K and V). K/V tiles are double-buffered: the next tile's
// cp.async copies are in flight while the current one is multiplied. Dynamic shared memory:
// fa_smem_bytes(HD) (over the default 48 KB for HD = 128: the host raises the limit).
#define FA_BM 64
#define FA_BN 64
#define FA_THREADS 128

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// d += a · b for one m16n8k16 tile (a row-major 16×16, b column-major 16×8, bf16; d f32).
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int HD>
__device__ __forceinline__ void flash_prefill(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                              const u32* __restrict__ tiles, const u32* __restrict__ positions,
                                              const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                              bf16_t* __restrict__ outb, int n_heads, int n_kv, int hd, int block_size, float scale) {
    constexpr int LD = HD + 8; // row stride in bf16: 16 bytes of padding make ldmatrix conflict-free
    constexpr int NS = FA_BN / 8, NO = HD / 8, KQ = HD / 16;
    extern __shared__ __align__(16) bf16_t fa_smem[]; // [2 buffers][K, V][FA_BN][LD]
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int tile = gridDim.x - 1 - blockIdx.x; // longest contexts first: less tail
    const int h = blockIdx.y;
    const int row0 = tiles[3 * tile], nrows = tiles[3 * tile + 1], seq = tiles[3 * tile + 2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int width = (n_heads + 2 * n_kv) * hd, kvw = n_kv * hd;
    const int kvh = h / (n_heads / n_kv);
    const u32* table = block_tables + (size_t)seq * bt_stride;
    const int maxpos = (int)positions[row0 + nrows - 1];

    // Copies K/V tile `it` into buffer `b` (zeros past the context and in padding dims).
    auto load_tile = [&](int it, int b) {
        bf16_t* ks = fa_smem + b * 2 * FA_BN * LD;
        bf16_t* vs = ks + FA_BN * LD;
        constexpr int CH = HD / 8; // 16-byte chunks per row
#pragma unroll
        for (int i = tid; i < FA_BN * CH; i += FA_THREADS) {
            const int j = i / CH, d = (i - j * CH) * 8, t = it * FA_BN + j;
            const bool valid = t <= maxpos && d < hd;
            size_t off = 0;
            if (valid) off = ((size_t)table[t / block_size] * block_size + t % block_size) * kvw + kvh * hd + d;
            if ((hd & 7) == 0) {
                cp_async16_zfill(&ks[j * LD + d], kc + off, valid);
                cp_async16_zfill(&vs[j * LD + d], vc + off, valid);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    const bool in = valid && d + e < hd;
                    ks[j * LD + d + e] = in ? kc[off + e] : (bf16_t)0;
                    vs[j * LD + d + e] = in ? vc[off + e] : (bf16_t)0;
                }
            }
        }
    };
    load_tile(0, 0);
    cp_async_commit();

    // Q (scaled by scale · log2 e) → bf16, staged in buffer 1, then into A fragments.
    {
        bf16_t* qs = fa_smem + 2 * FA_BN * LD;
        const float qscale = scale * 1.4426950408889634f;
        for (int i = tid; i < FA_BM * HD; i += FA_THREADS) {
            const int r = i / HD, d = i - r * HD;
            const float v = (r < nrows && d < hd) ? qkv[(size_t)(row0 + r) * width + h * hd + d] * qscale : 0.f;
            qs[r * LD + d] = f2bf(v);
        }
    }
    __syncthreads();
    u32 qf[KQ][4];
#pragma unroll
    for (int kk = 0; kk < KQ; kk++)
        ldsm_x4(qf[kk], &fa_smem[2 * FA_BN * LD + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 + (lane >> 4) * 8]);

    // This thread's two rows of the warp's 16 (mma C layout: rows lane/4 and lane/4 + 8).
    const int rA = warp * 16 + (lane >> 2), rB = rA + 8;
    const int posA = rA < nrows ? (int)positions[row0 + rA] : -1;
    const int posB = rB < nrows ? (int)positions[row0 + rB] : -1;
    const int wlast = min(warp * 16 + 15, nrows - 1);
    const int wmax = warp * 16 < nrows ? (int)positions[row0 + wlast] : -1;
    const int c2 = (lane & 3) * 2;

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float mA = NEG_INF, mB = NEG_INF, lA = 0.f, lB = 0.f;

    const int ntiles = maxpos / FA_BN + 1;
    for (int it = 0; it < ntiles; it++) {
        const int t0 = it * FA_BN;
        __syncthreads(); // every warp is done with the buffer the next tile goes into (or with Q)
        if (it + 1 < ntiles) load_tile(it + 1, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>(); // this thread's copies of tile `it` have landed
        __syncthreads();    // ... and everyone's
        const bf16_t* ks = fa_smem + (it & 1) * 2 * FA_BN * LD;
        const bf16_t* vs = ks + FA_BN * LD;
        if (t0 > wmax) continue; // every row of this warp is before the tile

        // S = Q · Kᵀ (16 rows × FA_BN keys per warp).
        float s[NS][4];
#pragma unroll
        for (int j = 0; j < NS; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KQ; kk++) {
#pragma unroll
            for (int jj = 0; jj < NS / 2; jj++) {
                u32 b[4];
                ldsm_x4(b, &ks[(jj * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8]);
                mma_bf16(s[2 * jj], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * jj + 1], qf[kk], b[2], b[3]);
            }
        }
        // Causal mask, online softmax (each row's max and sum over the 4 lanes that hold it).
        float mxA = mA, mxB = mB;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            const int t = t0 + j * 8 + c2;
            if (t > posA) s[j][0] = NEG_INF;
            if (t + 1 > posA) s[j][1] = NEG_INF;
            if (t > posB) s[j][2] = NEG_INF;
            if (t + 1 > posB) s[j][3] = NEG_INF;
            mxA = fmaxf(mxA, fmaxf(s[j][0], s[j][1]));
            mxB = fmaxf(mxB, fmaxf(s[j][2], s[j][3]));
        }
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
        const float uA = mxA == NEG_INF ? 0.f : mxA, uB = mxB == NEG_INF ? 0.f : mxB;
        const float cA = exp2f(mA - uA), cB = exp2f(mB - uB);
        float sumA = 0.f, sumB = 0.f;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            s[j][0] = exp2f(s[j][0] - uA);
            s[j][1] = exp2f(s[j][1] - uA);
            s[j][2] = exp2f(s[j][2] - uB);
            s[j][3] = exp2f(s[j][3] - uB);
            sumA += s[j][0] + s[j][1];
            sumB += s[j][2] + s[j][3];
        }
        lA = lA * cA + sumA;
        lB = lB * cB + sumB;
        mA = mxA;
        mB = mxB;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            o[j][0] *= cA;
            o[j][1] *= cA;
            o[j][2] *= cB;
            o[j][3] *= cB;
        }
        // O += P · V: the S accumulators are already in the A-fragment layout.
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                        pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < NO / 2; np++) {
                u32 b[4];
                ldsm_x4_t(b, &vs[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + np * 16 + (lane >> 4) * 8]);
                mma_bf16(o[2 * np], a, b[0], b[1]);
                mma_bf16(o[2 * np + 1], a, b[2], b[3]);
            }
        }
    }
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    // Row r's output from the accumulator half `hi` (0: rows lane/4, 1: rows lane/4 + 8).
    auto store = [&](int r, float l, int hi) {
        if (r >= nrows) return;
        const size_t at = (size_t)(row0 + r) * n_heads * hd + h * hd;
        float* orow = out + at;
        bf16_t* brow = outb ? outb + at : nullptr;
        const float inv = 1.f / l;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            const int d = j * 8 + c2;
            const float v0 = o[j][2 * hi] * inv, v1 = o[j][2 * hi + 1] * inv;
            if (d < hd) orow[d] = v0;
            if (d + 1 < hd) orow[d + 1] = v1;
            if (brow && d < hd) brow[d] = f2bf(v0);
            if (brow && d + 1 < hd) brow[d + 1] = f2bf(v1);
        }
    };
    store(rA, lA, 0);
    store(rB, lB, 1);
}

#define FLASH_PREFILL(HD)                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_##HD(                                                            \
        const float* qkv, const bf16_t* kc, const bf16_t* vc, const u32* tiles, const u32* positions, const u32* block_tables, int bt_stride,   \
        float* out, bf16_t* outb, int n_heads, int n_kv, int hd, int block_size, float scale) {                                                  \
        pdl_entry();                                                                                                                             \
        flash_prefill<HD>(qkv, kc, vc, tiles, positions, block_tables, bt_stride, out, outb, n_heads, n_kv, hd, block_size, scale);             \
    }
FLASH_PREFILL(32) FLASH_PREFILL(64) FLASH_PREFILL(96) FLASH_PREFILL(128)
