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

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] = f2bf(x[i]);
}

// x ≈ hi + lo with both in bf16 (hi = bf16(x), lo = bf16(x − hi)): two bf16 GEMMs then carry
// ~16 bits of the f32 activations instead of 8.
extern "C" __global__ void f32_to_bf16_split(const float* __restrict__ x, bf16_t* __restrict__ hi, bf16_t* __restrict__ lo, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        bf16_t h = f2bf(x[i]);
        hi[i] = h;
        lo[i] = f2bf(x[i] - bf2f(h));
    }
}

extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b, int cols, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] += b[i % cols];
}

extern "C" __global__ void add_inplace(float* __restrict__ a, const float* __restrict__ b, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) a[i] += b[i];
}

// One block per row.
extern "C" __global__ void embedding_bf16(const bf16_t* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim) {
    const bf16_t* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf2f(src[i]);
}

extern "C" __global__ void embedding_f32(const float* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out, int dim) {
    const float* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows, float* __restrict__ out, int dim) {
    const float* src = x + (size_t)rows[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

// out = x / sqrt(mean(x²) + eps) * w, one block per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int dim, float eps) {
    __shared__ float sh[33];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = xr[i]; s += v * v; }
    s = block_sum(s, sh);
    float inv = rsqrtf(s / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (xr[i] * inv) * w[i];
}

// resid += delta; out = rmsnorm(resid) * w. Each thread rereads only the elements it wrote.
extern "C" __global__ void add_rms_norm(float* __restrict__ resid, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, int dim, float eps) {
    __shared__ float sh[33];
    float* r = resid + (size_t)blockIdx.x * dim;
    const float* d = delta + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { float v = r[i] + d[i]; r[i] = v; s += v * v; }
    s = block_sum(s, sh);
    float inv = rsqrtf(s / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (r[i] * inv) * w[i];
}

// Rotate-half RoPE on the q and k heads of each fused qkv row. One block per row; threads
// walk (head, pair) indices.
extern "C" __global__ void rope_qk(float* __restrict__ qkv, const u32* __restrict__ positions, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, int heads_qk, int head_dim, int half, int width, int max_pos) {
    int r = blockIdx.x;
    int pos = min((int)positions[r], max_pos - 1);
    const float* c = cos_t + (size_t)pos * half;
    const float* s = sin_t + (size_t)pos * half;
    float* row = qkv + (size_t)r * width;
    for (int t = threadIdx.x; t < heads_qk * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float* p = row + h * head_dim;
        float x0 = p[i], x1 = p[i + half];
        p[i] = x0 * c[i] - x1 * s[i];
        p[i + half] = x1 * c[i] + x0 * s[i];
    }
}

extern "C" __global__ void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int inter, long n) {
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x) {
        long r = idx / inter;
        int i = (int)(idx - r * inter);
        float g = gu[r * 2 * inter + i];
        float u = gu[r * 2 * inter + inter + i];
        out[idx] = g / (1.f + expf(-g)) * u;
    }
}

// Writes each new row's k and v into its cache slot (bf16). One block per row.
extern "C" __global__ void kv_write(const float* __restrict__ qkv, const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                    const u32* __restrict__ block_tables, int bt_stride, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                    int n_heads, int n_kv, int head_dim, int block_size) {
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

#define ATTN_WARPS 8
#define MAX_DPL 8 // dims per lane: head_dim <= 256

// Causal attention of each new row against its sequence's cache, up to and including its own
// position. Grid (rows, n_heads), ATTN_WARPS warps per block. Each warp walks a strided share of
// the context with an online softmax; lane l owns dims l, l+32, ...; the warps' partial states
// are merged through shared memory at the end.
extern "C" __global__ void paged_attention(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                           const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                           const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                           int n_heads, int n_kv, int head_dim, int block_size, float scale) {
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

    float qv[MAX_DPL], acc[MAX_DPL];
#pragma unroll
    for (int j = 0; j < MAX_DPL; j++) {
        int d = lane + 32 * j;
        qv[j] = d < head_dim ? q[d] * scale : 0.f;
        acc[j] = 0.f;
    }
    float m = -__int_as_float(0x7f800000), l = 0.f;
    for (int t = warp; t < ctx; t += ATTN_WARPS) {
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
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.f;
    for (int w = 0; w < ATTN_WARPS; w++) L += sm_l[w] * __expf(sm_m[w] - M);
    float* o = out + (size_t)r * n_heads * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < ATTN_WARPS; w++) s += sm_acc[w][d] * __expf(sm_m[w] - M);
        o[d] = s / L;
    }
}

// ---- small-M GEMV: y[m, n] = x[m, :] · W[n, :] (+ bias[n]) for M ≤ 8 rows, bf16 W -----------
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
    extern "C" __global__ void gemv_bf16_##M(const float* x, const bf16_t* w, const float* bias, float* y, int n, int k) { gemv_bf16_impl<M>(x, w, bias, y, n, k); }
GEMV(1) GEMV(2) GEMV(3) GEMV(4) GEMV(5) GEMV(6) GEMV(7) GEMV(8)

// ---- prefill attention, tiled ------------------------------------------------------------------
// A block takes up to PQ consecutive query rows of one sequence (one warp each) and one head,
// and walks the context in tiles of PK keys staged in shared memory (bf16 → f32 once per block
// instead of once per row). Lane j scores key j of the tile; the warp then folds the tile into
// its online softmax and accumulates P·V with lane l owning dims l, l+32, ... Rows of a sequence
// within a step have ascending positions, so a tile's last row sees the longest context.
// `tiles` holds (first row, row count, sequence) per block. head_dim ≤ 128.
#define PQ 8
#define PK 32

extern "C" __global__ void prefill_attention(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                             const u32* __restrict__ tiles, const u32* __restrict__ positions,
                                             const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                             int n_heads, int n_kv, int head_dim, int block_size, float scale) {
    extern __shared__ float smem[];
    const int hd = head_dim, hdp = head_dim + 1;
    float* ks = smem;            // [PK][hd + 1] (padded: lanes read different rows)
    float* vs = ks + PK * hdp;   // [PK][hd]
    float* qs = vs + PK * hd;    // [PQ][hd]
    float* ps = qs + PQ * hd;    // [PQ][PK]
    const int h = blockIdx.y;
    const int row0 = tiles[3 * blockIdx.x], nrows = tiles[3 * blockIdx.x + 1], seq = tiles[3 * blockIdx.x + 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int width = (n_heads + 2 * n_kv) * hd, kvw = n_kv * hd;
    const int kvh = h / (n_heads / n_kv);
    const u32* table = block_tables + (size_t)seq * bt_stride;
    for (int i = threadIdx.x; i < PQ * hd; i += blockDim.x) {
        int r = i / hd, d = i - r * hd;
        qs[i] = r < nrows ? qkv[(size_t)(row0 + r) * width + h * hd + d] * scale : 0.f;
    }
    const bool active = warp < nrows;
    const int pos = active ? (int)positions[row0 + warp] : -1;
    const int maxpos = (int)positions[row0 + nrows - 1];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float m = -__int_as_float(0x7f800000), l = 0.f;
    for (int t0 = 0; t0 <= maxpos; t0 += PK) {
        __syncthreads();
        for (int i = threadIdx.x; i < PK * hd; i += blockDim.x) {
            int j = i / hd, d = i - j * hd, t = t0 + j;
            float kk = 0.f, vv = 0.f;
            if (t <= maxpos) {
                size_t off = ((size_t)table[t / block_size] * block_size + t % block_size) * kvw + kvh * hd + d;
                kk = bf2f(kc[off]);
                vv = bf2f(vc[off]);
            }
            ks[j * hdp + d] = kk;
            vs[j * hd + d] = vv;
        }
        __syncthreads();
        if (!active || t0 > pos) continue;
        const int t = t0 + lane;
        float s = -__int_as_float(0x7f800000);
        if (t <= pos) {
            const float* q = qs + warp * hd;
            const float* kr = ks + lane * hdp;
            float a = 0.f;
            for (int d = 0; d < hd; d++) a += q[d] * kr[d];
            s = a;
        }
        float tm = s;
        for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
        const float mn = fmaxf(m, tm);
        const float p = t <= pos ? __expf(s - mn) : 0.f;
        const float corr = __expf(m - mn);
        l = l * corr + warp_sum(p);
        ps[warp * PK + lane] = p;
        __syncwarp();
        const int tn = min(PK, pos - t0 + 1);
#pragma unroll
        for (int j = 0; j < 4; j++) acc[j] *= corr;
        for (int jj = 0; jj < tn; jj++) {
            const float pj = ps[warp * PK + jj];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int d = lane + 32 * j;
                if (d < hd) acc[j] += pj * vs[jj * hd + d];
            }
        }
        __syncwarp();
        m = mn;
    }
    if (active) {
        float* o = out + (size_t)(row0 + warp) * n_heads * hd + h * hd;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int d = lane + 32 * j;
            if (d < hd) o[d] = acc[j] / l;
        }
    }
}
