// Mixture-of-experts and q/k-norm kernels (appended to kernels.cu, whose helpers they use).
// Routing layout (moe.rs: DevRouting): pair i = r·k + j is row r's j-th choice; the pairs are
// grouped by expert, expert e's at positions offsets[e]..offsets[e+1]; `tiles` lists runs of at
// most MOE_TILE_M positions of one expert as (start, rows, expert) for the grouped GEMM.

#define MOE_TILE_M 8
#define MOE_WARPS 8
#define MOE_COLS_PER_WARP 4

// RMSNorm in place over groups of the q and k parts of a fused qkv row: block (row, group),
// groups [0, q_out/qg) are q's, then k's.
extern "C" __global__ void qk_norm(float* __restrict__ qkv, const float* __restrict__ wq, const float* __restrict__ wk, int width, int q_out,
                                   int qg, int kg, float eps) {
    pdl_entry();
    __shared__ float sh[33];
    const int g = blockIdx.y, nq = q_out / qg;
    const bool is_q = g < nq;
    const int len = is_q ? qg : kg;
    float* x = qkv + (size_t)blockIdx.x * width + (is_q ? (size_t)g * qg : (size_t)q_out + (size_t)(g - nq) * kg);
    const float* w = is_q ? wq : wk;
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += x[i] * x[i];
    s = block_sum(s, sh);
    const float inv = rsqrtf(s / len + eps);
    for (int i = threadIdx.x; i < len; i += blockDim.x) x[i] = (x[i] * inv) * w[i];
}

// Softmax over each row's E router logits, its top k (ties to the lower expert), optionally
// renormalised over the k. One warp per row: lane l holds experts l, l + 32, … (E ≤ 1024, one
// bit each in `taken`); each of the k rounds is a warp argmax. One thread per row ran the k·E
// scan serially, 20–40 µs a layer at E = 128, k = 8.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, u32* __restrict__ expert, float* __restrict__ weight, int m, int E, int k, int renorm) {
    pdl_entry();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= m) return;
    const float* l = logits + (size_t)r * E;
    float mx = -__int_as_float(0x7f800000);
    for (int x = lane; x < E; x += 32) mx = fmaxf(mx, l[x]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float part = 0.f;
    for (int x = lane; x < E; x += 32) part += expf(l[x] - mx);
    const float sum = warp_sum(part);
    u32* ids = expert + (size_t)r * k;
    float* ws = weight + (size_t)r * k;
    u32 taken = 0;
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.f;
        for (int x = lane, i = 0; x < E; x += 32, i++) {
            if ((taken >> i) & 1u) continue;
            const float v = l[x];
            if (best < 0 || v > bv) { best = x; bv = v; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const int ob = __shfl_xor_sync(0xffffffffu, best, o);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) { best = ob; bv = ov; }
        }
        if ((best & 31) == lane) taken |= 1u << (best >> 5);
        const float w = expf(bv - mx) / sum;
        if (lane == 0) {
            ids[j] = (u32)best;
            ws[j] = w;
        }
        total += w;
    }
    if (renorm && lane == 0)
        for (int j = 0; j < k; j++) ws[j] /= total;
}

// Groups the n pairs by expert (one block): counts, offsets, tile list, then each pair's
// position (atomic cursors: the order within an expert varies, which changes no result, since the
// grouped GEMM computes each row on its own). `tiles_n` receives the number of tiles.
extern "C" __global__ void moe_group(const u32* __restrict__ expert, u32* __restrict__ offsets, u32* __restrict__ cursor, u32* __restrict__ row_of,
                                     u32* __restrict__ pos_of, u32* __restrict__ tiles, u32* __restrict__ tiles_n, int n, int E, int k) {
    pdl_entry();
    extern __shared__ u32 count[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&count[expert[i]], 1u);
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 off = 0, t = 0;
        for (int e = 0; e < E; e++) {
            offsets[e] = off;
            cursor[e] = off;
            for (u32 s = 0; s < count[e]; s += MOE_TILE_M) {
                tiles[3 * t] = off + s;
                tiles[3 * t + 1] = min((u32)MOE_TILE_M, count[e] - s);
                tiles[3 * t + 2] = (u32)e;
                t++;
            }
            off += count[e];
        }
        offsets[E] = off;
        *tiles_n = t;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const u32 p = atomicAdd(&cursor[expert[i]], 1u);
        pos_of[i] = p;
        row_of[p] = (u32)(i / k);
    }
}

// out[p] = x[row_of[p]], one block per position.
extern "C" __global__ void moe_gather(const float* __restrict__ x, const u32* __restrict__ row_of, float* __restrict__ out, int dim) {
    pdl_entry();
    const float* src = x + (size_t)row_of[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

// V consecutive weights of a column as f32: 8 bf16 or 4 f32 in one 16-byte load, or 1.
template <int V> __device__ __forceinline__ void moe_load_w(const bf16_t* p, float* o) {
    if constexpr (V == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[2 * i] = __uint_as_float(w[i] << 16);
            o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) o[i] = bf2f(p[i]);
    }
}
template <int V> __device__ __forceinline__ void moe_load_w(const float* p, float* o) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + i);
            o[i] = f.x, o[i + 1] = f.y, o[i + 2] = f.z, o[i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) o[i] = p[i];
    }
}

// y[p, c] = x[p] · W_e[c] for the positions of one tile (blockIdx.x) and MOE_WARPS ·
// MOE_COLS_PER_WARP output columns (blockIdx.y). Each warp reads its columns' weight rows once
// for all the tile's rows, the columns side by side so that a lane has their loads in flight
// together (V per lane per step: 16-byte loads where K allows; one column after another, one
// element at a time, the kernel waited on memory latency and read 7% of the bandwidth). Each
// row's sum is its own (lane partials in k order, reduced in a fixed order), whatever rows share
// the tile.
template <typename W, int V>
__device__ void moe_matmul_impl(const float* __restrict__ x, const W* __restrict__ w, const u32* __restrict__ tiles, const u32* __restrict__ tiles_n,
                                float* __restrict__ y, int N, int K) {
    if (blockIdx.x >= *tiles_n) return;
    const u32 start = tiles[3 * blockIdx.x], rows = tiles[3 * blockIdx.x + 1], e = tiles[3 * blockIdx.x + 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col0 = (blockIdx.y * MOE_WARPS + warp) * MOE_COLS_PER_WARP;
    const int ncols = min(MOE_COLS_PER_WARP, N - col0);
    if (ncols <= 0) return;
    const W* we = w + (size_t)e * N * K + (size_t)col0 * K;
    const float* xs = x + (size_t)start * K;
    float acc[MOE_COLS_PER_WARP][MOE_TILE_M];
#pragma unroll
    for (int c = 0; c < MOE_COLS_PER_WARP; c++)
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; r++) acc[c][r] = 0.f;
    for (int kk = lane * V; kk < K; kk += 32 * V) {
        float wv[MOE_COLS_PER_WARP][V];
#pragma unroll
        for (int c = 0; c < MOE_COLS_PER_WARP; c++) {
            if (c < ncols) {
                moe_load_w<V>(we + (size_t)c * K + kk, wv[c]);
            } else {
#pragma unroll
                for (int v = 0; v < V; v++) wv[c][v] = 0.f;
            }
        }
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; r++) {
            if (r < rows) {
                float xv[V];
                moe_load_w<V>(xs + (size_t)r * K + kk, xv);
#pragma unroll
                for (int c = 0; c < MOE_COLS_PER_WARP; c++)
#pragma unroll
                    for (int v = 0; v < V; v++) acc[c][r] += wv[c][v] * xv[v];
            }
        }
    }
#pragma unroll
    for (int c = 0; c < MOE_COLS_PER_WARP; c++) {
        if (c >= ncols) break;
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; r++) {
            const float s = warp_sum(acc[c][r]);
            if (lane == 0 && r < rows) y[(size_t)(start + r) * N + col0 + c] = s;
        }
    }
}

// `vec`: K allows 16-byte loads of weights and activations (every row 16-byte aligned).
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_matmul_bf16(const float* x, const bf16_t* w, const u32* tiles, const u32* tiles_n, float* y, int N, int K, int vec) {
    pdl_entry();
    if (vec) moe_matmul_impl<bf16_t, 8>(x, w, tiles, tiles_n, y, N, K);
    else moe_matmul_impl<bf16_t, 1>(x, w, tiles, tiles_n, y, N, K);
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_matmul_f32(const float* x, const float* w, const u32* tiles, const u32* tiles_n, float* y, int N, int K, int vec) {
    pdl_entry();
    if (vec) moe_matmul_impl<float, 4>(x, w, tiles, tiles_n, y, N, K);
    else moe_matmul_impl<float, 1>(x, w, tiles, tiles_n, y, N, K);
}

// out[r] = Σ_j weight[r·k + j] · y[pos_of[r·k + j]], choices in order; one block per row.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weight, const u32* __restrict__ pos_of, float* __restrict__ out,
                                       int dim, int k) {
    pdl_entry();
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; j++) acc += weight[r * k + j] * y[(size_t)pos_of[r * k + j] * dim + i];
        out[(size_t)r * dim + i] = acc;
    }
}

// out[r] += sigmoid(gate[r]) · x[r].
extern "C" __global__ void add_sigmoid_gated(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ gate, int dim, long n) {
    pdl_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float s = 1.f / (1.f + expf(-gate[i / dim]));
        out[i] += s * x[i];
    }
}
