// ---- decode attention by KV head (GQA) ----------------------------------------------------------
// One block per (row, KV head) serves all G = n_heads / n_kv query heads that share the head, so
// each cached K and V row is read once per row instead of once per query head (`paged_attention`
// in kernels.cu reads it G times: at 256 rows of an 8B model's contexts of ~200 that was ~4× the
// KV bytes, and most of a decode step's attention time). Warps take tiles of 32 keys: lane i
// scores key i against the G queries (held scaled in shared memory), a tile needs one max and one
// sum reduction per head instead of one per key, and the weighted V sum then walks the tile's keys
// with each lane on its own 2 × HD/64 dims. Warps keep an online softmax each; their partial
// states are merged through shared memory at the end, one head at a time. Causal through
// `positions` like `paged_attention`, so prefill rows of a head dim the tensor-core kernel does
// not take run here too. HD is 64, 128 or 256; G at most MAXG, 4 or 8 (the host picks the
// smallest that holds G: the per-head state is registers, MAXG of each).

#define GQA_MAX_G 8
#define GQA_MAX_WARPS 16 // mod.rs: gqa_attn_threads

template <int HD, int MAXG>
__device__ __forceinline__ void attention_gqa(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                              const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                              const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                              int n_heads, int n_kv, int block_size, float scale) {
    constexpr int DP = HD / 64; // bf16 pairs per lane in the V sum
    __shared__ __align__(16) float sm_q[GQA_MAX_G * HD];
    __shared__ float sm_m[GQA_MAX_WARPS][GQA_MAX_G], sm_l[GQA_MAX_WARPS][GQA_MAX_G];
    __shared__ float sm_acc[GQA_MAX_WARPS][HD];
    pdl_entry();
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int G = n_heads / n_kv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int width = (n_heads + 2 * n_kv) * HD;
    const size_t kvw = (size_t)n_kv * HD;
    const int ctx = (int)positions[r] + 1;
    const u32* table = block_tables + (size_t)row_seq[r] * bt_stride;
    // The G query heads of this KV head are contiguous in the qkv row.
    const float* q = qkv + (size_t)r * width + (size_t)kvh * G * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) sm_q[i] = q[i] * scale;
    __syncthreads();

    float m[MAXG], l[MAXG], acc[MAXG][2 * DP];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = -__int_as_float(0x7f800000);
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 2 * DP; j++) acc[g][j] = 0.f;
    }
    const int n_tiles = (ctx + 31) >> 5;
    for (int tile = warp; tile < n_tiles; tile += nw) {
        const int t = tile * 32 + lane;
        const bool valid = t < ctx;
        const u32 slot = valid ? table[t / block_size] * (u32)block_size + (u32)(t % block_size) : 0u;
        // Scores: lane = key.
        float s[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) s[g] = 0.f;
        if (valid) {
            const uint4* k4 = reinterpret_cast<const uint4*>(kc + (size_t)slot * kvw + (size_t)kvh * HD);
#pragma unroll 4
            for (int c = 0; c < HD / 8; c++) {
                uint4 p = k4[c];
                float k8[8] = {__uint_as_float(p.x << 16), __uint_as_float(p.x & 0xffff0000u), __uint_as_float(p.y << 16), __uint_as_float(p.y & 0xffff0000u),
                               __uint_as_float(p.z << 16), __uint_as_float(p.z & 0xffff0000u), __uint_as_float(p.w << 16), __uint_as_float(p.w & 0xffff0000u)};
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < G) {
                        const float4* qq = reinterpret_cast<const float4*>(sm_q + g * HD + c * 8);
                        float4 a = qq[0], b = qq[1];
                        s[g] += k8[0] * a.x + k8[1] * a.y + k8[2] * a.z + k8[3] * a.w + k8[4] * b.x + k8[5] * b.y + k8[6] * b.z + k8[7] * b.w;
                    }
                }
            }
        }
        // Online softmax, one tile at a time: s[g] becomes the key's weight.
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < G) {
                float tmax = valid ? s[g] : -__int_as_float(0x7f800000);
                for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
                const float mn = fmaxf(m[g], tmax); // finite: lane 0's key is always valid
                const float corr = __expf(m[g] - mn);
                const float p = valid ? __expf(s[g] - mn) : 0.f;
                l[g] = l[g] * corr + warp_sum(p);
#pragma unroll
                for (int j = 0; j < 2 * DP; j++) acc[g][j] *= corr;
                m[g] = mn;
                s[g] = p;
            }
        }
        // Weighted V sum over the tile's keys: lane owns dims 2·lane + 64·jj (+1).
        const int nk = min(32, ctx - tile * 32);
#pragma unroll 4
        for (int k = 0; k < nk; k++) {
            const u32 sk = __shfl_sync(0xffffffffu, slot, k);
            const u32* v2 = reinterpret_cast<const u32*>(vc + (size_t)sk * kvw + (size_t)kvh * HD);
            float vv[2 * DP];
#pragma unroll
            for (int jj = 0; jj < DP; jj++) {
                u32 w = v2[lane + 32 * jj];
                vv[2 * jj] = __uint_as_float(w << 16);
                vv[2 * jj + 1] = __uint_as_float(w & 0xffff0000u);
            }
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < G) {
                    const float p = __shfl_sync(0xffffffffu, s[g], k);
#pragma unroll
                    for (int j = 0; j < 2 * DP; j++) acc[g][j] += p * vv[j];
                }
            }
        }
    }
    // Merge the warps' states, one head at a time through sm_acc.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; g++)
            if (g < G) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
    }
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < G) {
#pragma unroll
            for (int jj = 0; jj < DP; jj++) {
                sm_acc[warp][2 * lane + 64 * jj] = acc[g][2 * jj];
                sm_acc[warp][2 * lane + 64 * jj + 1] = acc[g][2 * jj + 1];
            }
            __syncthreads();
            float M = -__int_as_float(0x7f800000);
            for (int w = 0; w < nw; w++) M = fmaxf(M, sm_m[w][g]);
            float L = 0.f;
            for (int w = 0; w < nw; w++) L += sm_l[w][g] * __expf(sm_m[w][g] - M);
            float* o = out + (size_t)r * n_heads * HD + (size_t)(kvh * G + g) * HD;
            for (int d = threadIdx.x; d < HD; d += blockDim.x) {
                float sum = 0.f;
                for (int w = 0; w < nw; w++) sum += sm_acc[w][d] * __expf(sm_m[w][g] - M);
                o[d] = sum / L;
            }
            __syncthreads();
        }
    }
}

#define ATTENTION_GQA(HD, MAXG)                                                                                                                        \
    extern "C" __global__ void paged_attention_gqa_##HD##_##MAXG(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, \
                                                        const u32* __restrict__ row_seq, const u32* __restrict__ positions,                          \
                                                        const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out, int n_heads,   \
                                                        int n_kv, int block_size, float scale) {                                                     \
        attention_gqa<HD, MAXG>(qkv, kc, vc, row_seq, positions, block_tables, bt_stride, out, n_heads, n_kv, block_size, scale);                         \
    }
ATTENTION_GQA(64, 4)
ATTENTION_GQA(128, 4)
ATTENTION_GQA(256, 4)
ATTENTION_GQA(64, 8)
ATTENTION_GQA(128, 8)
ATTENTION_GQA(256, 8)
