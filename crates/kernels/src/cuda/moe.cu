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
// renormalised over the k. One thread per row.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, u32* __restrict__ expert, float* __restrict__ weight, int m, int E, int k, int renorm) {
    pdl_entry();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= m) return;
    const float* l = logits + (size_t)r * E;
    float mx = -__int_as_float(0x7f800000);
    for (int x = 0; x < E; x++) mx = fmaxf(mx, l[x]);
    float sum = 0.f;
    for (int x = 0; x < E; x++) sum += expf(l[x] - mx);
    u32* ids = expert + (size_t)r * k;
    float* ws = weight + (size_t)r * k;
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.f;
        for (int x = 0; x < E; x++) {
            bool taken = false;
            for (int t = 0; t < j; t++) taken |= ids[t] == (u32)x;
            if (taken) continue;
            const float v = l[x];
            if (best < 0 || v > bv) { best = x; bv = v; }
        }
        ids[j] = (u32)best;
        ws[j] = expf(bv - mx) / sum;
        total += ws[j];
    }
    if (renorm)
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

__device__ __forceinline__ float moe_w(const bf16_t* w, size_t i) { return bf2f(w[i]); }
__device__ __forceinline__ float moe_w(const float* w, size_t i) { return w[i]; }

// y[p, c] = x[p] · W_e[c] for the positions of one tile (blockIdx.x) and MOE_WARPS ·
// MOE_COLS_PER_WARP output columns (blockIdx.y). Each warp reads a column's weight row once for
// all the tile's rows, lanes striding k; each row's sum is its own (lane partials reduced in a
// fixed order), whatever rows share the tile.
template <typename W>
__device__ void moe_matmul_impl(const float* __restrict__ x, const W* __restrict__ w, const u32* __restrict__ tiles, const u32* __restrict__ tiles_n,
                                float* __restrict__ y, int N, int K) {
    if (blockIdx.x >= *tiles_n) return;
    const u32 start = tiles[3 * blockIdx.x], rows = tiles[3 * blockIdx.x + 1], e = tiles[3 * blockIdx.x + 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const W* we = w + (size_t)e * N * K;
    for (int c = 0; c < MOE_COLS_PER_WARP; c++) {
        const int col = (blockIdx.y * MOE_WARPS + warp) * MOE_COLS_PER_WARP + c;
        if (col >= N) return;
        const W* wr = we + (size_t)col * K;
        float acc[MOE_TILE_M];
        for (int r = 0; r < MOE_TILE_M; r++) acc[r] = 0.f;
        for (int kk = lane; kk < K; kk += 32) {
            const float wv = moe_w(wr, kk);
            for (int r = 0; r < MOE_TILE_M; r++)
                if (r < rows) acc[r] += wv * x[(size_t)(start + r) * K + kk];
        }
        for (int r = 0; r < MOE_TILE_M; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && r < rows) y[(size_t)(start + r) * N + col] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_matmul_bf16(const float* x, const bf16_t* w, const u32* tiles, const u32* tiles_n, float* y, int N, int K) {
    pdl_entry();
    moe_matmul_impl(x, w, tiles, tiles_n, y, N, K);
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_matmul_f32(const float* x, const float* w, const u32* tiles, const u32* tiles_n, float* y, int N, int K) {
    pdl_entry();
    moe_matmul_impl(x, w, tiles, tiles_n, y, N, K);
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
