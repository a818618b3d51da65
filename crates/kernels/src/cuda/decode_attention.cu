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

// ---- decode attention by KV head, v2 (the default; QUIVER_CUDA_ATTN_DECODE=v1 keeps the above) ----
// Same work split (one block per (row, KV head), every query head of the KV head, causal through
// `positions`), built to stream K/V at the memory bound. The above lost ~3x to it at 256 rows: a
// lane read its own key's whole row, so every warp-wide load touched 32 rows 2 KB apart, and the
// V sum kept only ~256 bytes a warp in flight. Here:
// - Each warp streams its tiles of T = 2048 / HD keys (8 KB of K and V) into its own
//   shared-memory ring with cp.async: a warp-wide copy covers whole K/V rows (coalesced), and the
//   next tile is in flight while the current one is computed. Keys past the context are
//   zero-filled, so the V sum runs over whole tiles without NaN from stale shared memory (0 · 0).
// - Scores: lane l takes key l % T and part l / T of its dims (32 / T parts of 64 dims; shuffles
//   add the parts), dotted against the queries in shared memory (scaled; the parts 16 bytes apart
//   so a load's broadcasts fall in different banks). K rows are padded by 16 bytes so the 8 lanes
//   of a 16-byte load phase read 8 different banks.
// - V sum: lane owns HD/32 consecutive dims of every key (one conflict-free load a key), the
//   tile's weights read back from shared memory as broadcasts.
// - Warps' states merge once at the end: each warp leaves its accumulators in its own (idle)
//   ring, one __syncthreads, then the block writes the G·HD outputs coalesced, and their bf16
//   copy for the o-projection GEMM when `outb` is set.
// The grid is 1-D, KV heads fastest: a row's KV-head blocks run together and read neighbouring
// pieces of the same cache rows. Block: KVD_WARPS warps; dynamic shared memory: their rings
// (attention.rs `kv_ring_bytes`, which must match KVD_RING below).
#define KVD_WARPS 4
#define KVD_STAGES 2
#define KVD_KEYS(HD) (2048 / (HD))
#define KVD_RING(HD) (KVD_STAGES * KVD_KEYS(HD) * (2 * (HD) + 8)) // bf16 a warp

template <int N>
__device__ __forceinline__ void bf16s_to_f32(const bf16_t* p, float* f) {
    u32 w[N / 2];
    if constexpr (N == 2) {
        w[0] = *reinterpret_cast<const u32*>(p);
    } else if constexpr (N == 4) {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        w[0] = t.x, w[1] = t.y;
    } else {
        static_assert(N == 8, "2, 4 or 8 dims a lane");
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        w[0] = t.x, w[1] = t.y, w[2] = t.z, w[3] = t.w;
    }
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// N floats (1, 2, 4 or 8; 4·N-byte aligned) between shared memory and registers.
template <int N>
__device__ __forceinline__ void store_f32s(float* p, const float* f) {
    if constexpr (N == 1) {
        p[0] = f[0];
    } else if constexpr (N == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
    }
}
template <int N>
__device__ __forceinline__ void load_f32s(const float* p, float* f) {
    if constexpr (N == 1) {
        f[0] = p[0];
    } else if constexpr (N == 2) {
        const float2 t = *reinterpret_cast<const float2*>(p);
        f[0] = t.x, f[1] = t.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 t = *reinterpret_cast<const float4*>(p + i);
            f[i] = t.x, f[i + 1] = t.y, f[i + 2] = t.z, f[i + 3] = t.w;
        }
    }
}

template <int HD, int MAXG>
__device__ __forceinline__ void attention_kv(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                             const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                             const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                             bf16_t* __restrict__ outb, int ldb, const u32* __restrict__ row_tiles, int n_heads, int n_kv, int block_size,
                                             float scale) {
    static_assert((MAXG == 1 || MAXG == 2 || MAXG == 4 || MAXG == 8) && (HD == 64 || HD == 128 || HD == 256), "MAXG 1, 2, 4 or 8; HD 64, 128 or 256");
    constexpr int T = KVD_KEYS(HD);          // keys a tile: 32, 16, 8
    constexpr int PARTS = 32 / T;            // lanes a key in the scores: 1, 2, 4
    constexpr int PD = HD / PARTS;           // dims a lane dots: 64
    constexpr int CPR = HD / 8;              // 16-byte chunks a K/V row
    constexpr int KLD = HD + 8;              // K row stride in bf16 (16 bytes of padding)
    constexpr int STAGE = T * (KLD + HD);    // one tile's K then V, bf16
    constexpr int CPL = T * CPR / 32;        // chunks of K (and of V) a lane copies a tile: 8
    constexpr int QPD = PD + 4;              // floats a part of a query head in sm_q
    constexpr int QLD = PARTS * QPD;         // floats a query head in sm_q
    constexpr int DPL = HD / 32;             // dims a lane owns in the V sum
    static_assert(KVD_STAGES * STAGE == KVD_RING(HD) && PD == 64 && CPL == 8, "tile shape");
    static_assert(MAXG * HD * 4 <= KVD_RING(HD) * 2, "a warp's accumulators fit its ring");
    constexpr unsigned FULL = 0xffffffffu;
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) bf16_t kvd_smem[]; // [warps][KVD_STAGES][K: T × KLD, V: T × HD]
    __shared__ __align__(16) float sm_q[MAXG * QLD];
    __shared__ __align__(16) float sm_p[KVD_WARPS][T][MAXG];
    __shared__ float sm_m[KVD_WARPS][MAXG], sm_l[KVD_WARPS][MAXG];
    pdl_entry();
    // Rows 0.. in order, or (a mixed step's one-row sequences) the first rows of the prefill
    // tiles (first row, rows, sequence) at `row_tiles`.
    // (Read again where the output is written rather than held in a register through the loop:
    // holding it spilled the 256-dim, 8-head build.)
    auto row = [&]() -> int { return row_tiles ? (int)row_tiles[3 * (blockIdx.x / n_kv)] : (int)(blockIdx.x / n_kv); };
    const int r = row(), kvh = blockIdx.x % n_kv;
    const int G = n_heads / n_kv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int width = (n_heads + 2 * n_kv) * HD;
    const size_t kvw = (size_t)n_kv * HD;
    const int ctx = (int)positions[r] + 1;
    const u32* table = block_tables + (size_t)row_seq[r] * bt_stride;
    const bf16_t* kbase = kc + (size_t)kvh * HD;
    const bf16_t* vbase = vc + (size_t)kvh * HD;
    bf16_t* ring = kvd_smem + warp * KVD_RING(HD);
    const int n_tiles = (ctx + T - 1) / T;
    // This warp's tiles: warp, warp + KVD_WARPS, ... (neighbouring warps on neighbouring keys).
    const int mine = n_tiles > warp ? (n_tiles - 1 - warp) / KVD_WARPS + 1 : 0;
    const int key = lane % T, part = lane / T;

    // The cache slot of key `key` of the warp's i-th tile (0 past the context).
    auto slot_of = [&](int i) -> u32 {
        const u32 t = (u32)((warp + i * KVD_WARPS) * T + key);
        return t < (u32)ctx ? table[t / (u32)block_size] * (u32)block_size + t % (u32)block_size : 0u;
    };
    // Queues the copies of the warp's i-th tile into ring stage s; `slot` is `slot_of(i)`, which
    // the copying lanes take by shuffle from lane `key` (a warp-uniform call: all lanes).
    auto issue = [&](int i, int s, u32 slot) {
        const int t0 = (warp + i * KVD_WARPS) * T;
        bf16_t* ks = ring + s * STAGE;
        bf16_t* vs = ks + T * KLD;
#pragma unroll
        for (int j = 0; j < CPL; j++) {
            const int ch = lane + 32 * j, kk = ch / CPR, c = ch % CPR;
            const u32 sk = __shfl_sync(FULL, slot, kk);
            const size_t off = (size_t)sk * kvw + c * 8;
            const bool ok = t0 + kk < ctx;
            cp_async16_zfill(ks + kk * KLD + c * 8, kbase + off, ok);
            cp_async16_zfill(vs + kk * HD + c * 8, vbase + off, ok);
        }
    };
#pragma unroll
    for (int s = 0; s < KVD_STAGES; s++) {
        if (s < mine) issue(s, s, slot_of(s));
        cp_async_commit(); // empty groups keep the wait count uniform
    }

    // The G query heads of this KV head are contiguous in the qkv row. Heads G..MAXG are zeros:
    // the dot and V loops run over all MAXG heads without a branch (branches per head kept ptxas
    // from interleaving the heads' FMA chains), and their weights are zero.
    const float* q = qkv + (size_t)r * width + (size_t)kvh * G * HD;
    for (int i = threadIdx.x; i < MAXG * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        sm_q[g * QLD + (d / PD) * QPD + d % PD] = g < G ? q[i] * scale : 0.f;
    }
    __syncthreads();

    float m[MAXG], l[MAXG], acc[MAXG][DPL];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; j++) acc[g][j] = 0.f;
    }
    float* pw = &sm_p[warp][0][0];
    const bf16_t* krow0 = ring + key * KLD + part * PD;
    const float* qp = sm_q + part * QPD;
    for (int i = 0; i < mine; i++) {
        // The block-table read for the tile queued after this one, early: its latency hides under
        // this tile's math instead of stalling the copies.
        const u32 ahead = i + KVD_STAGES < mine ? slot_of(i + KVD_STAGES) : 0u;
        cp_async_wait<KVD_STAGES - 1>(); // this lane's copies of tile i have landed...
        __syncwarp();                    // ... and every lane's, visibly
        const int st = (i % KVD_STAGES) * STAGE;
        // Part of a score per lane: key `key`, dims [part · PD, (part + 1) · PD).
        float s[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) s[g] = 0.f;
#pragma unroll
        for (int c = 0; c < PD / 8; c++) {
            const uint4 p = *reinterpret_cast<const uint4*>(krow0 + st + c * 8);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                const float4* qq = reinterpret_cast<const float4*>(qp + g * QLD + c * 8);
                s[g] = dot8(p, qq[0], qq[1], s[g]);
            }
        }
        // Online softmax over the tile (the PARTS lanes of a key hold the same score). The max is
        // the warp's (shared by the V sum's accumulators); each lane sums its own key's weights
        // into l, added up across the keys once after the loop.
        const bool valid = (warp + i * KVD_WARPS) * T + key < ctx;
        float pv[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            pv[g] = 0.f;
            if (g < G) {
                float sc = s[g];
#pragma unroll
                for (int o = T; o < 32; o <<= 1) sc += __shfl_xor_sync(FULL, sc, o);
                float tmax = valid ? sc : NEG_INF;
#pragma unroll
                for (int o = T / 2; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(FULL, tmax, o));
                const float mn = fmaxf(m[g], tmax); // finite: the tile's first key is in the context
                const float corr = __expf(m[g] - mn);
                const float p = valid ? __expf(sc - mn) : 0.f;
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int j = 0; j < DPL; j++) acc[g][j] *= corr;
                m[g] = mn;
                pv[g] = p;
            }
        }
        if (part == 0) store_f32s<MAXG>(pw + key * MAXG, pv);
        __syncwarp();
        // Weighted V sum: lane owns dims [lane · DPL, (lane + 1) · DPL) of every key.
        const bf16_t* vs = ring + st + T * KLD + lane * DPL;
#pragma unroll 8
        for (int k = 0; k < T; k++) {
            float v[DPL];
            bf16s_to_f32<DPL>(vs + k * HD, v);
            float p[MAXG];
            load_f32s<MAXG>(pw + k * MAXG, p);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
#pragma unroll
                for (int j = 0; j < DPL; j++) acc[g][j] = fmaf(p[g], v[j], acc[g][j]);
            }
        }
        __syncwarp(); // every lane is done with this stage and with sm_p before they are refilled
        if (i + KVD_STAGES < mine) issue(i + KVD_STAGES, i % KVD_STAGES, ahead);
        cp_async_commit();
    }
    cp_async_wait<0>(); // only empty groups are left, but the ring is reused below
    __syncwarp();
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
#pragma unroll
        for (int o = T / 2; o > 0; o >>= 1) l[g] += __shfl_xor_sync(FULL, l[g], o);
    }

    // Merge: each warp's accumulators go to its own ring, then the block combines the warps'
    // states element by element.
    float* wacc = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < G) {
#pragma unroll
            for (int j = 0; j < DPL; j++) wacc[g * HD + lane * DPL + j] = acc[g][j];
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
    __syncthreads();
    const size_t at = ((size_t)row() * n_heads + (size_t)kvh * G) * HD;
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        const int g = e / HD;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < KVD_WARPS; w++) M = fmaxf(M, sm_m[w][g]); // finite: warp 0 has tile 0
        float L = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < KVD_WARPS; w++) {
            const float f = __expf(sm_m[w][g] - M); // 0 for a warp without tiles (m = -inf)
            L += sm_l[w][g] * f;
            sum += reinterpret_cast<const float*>(kvd_smem + w * KVD_RING(HD))[e] * f;
        }
        const float o = sum / L;
        out[at + e] = o;
        if (outb) outb[(size_t)row() * ldb + (size_t)kvh * G * HD + e] = f2bf(o);
    }
}

// KVD_WARPS warps a block: the host launches exactly that many (attention.rs).
#define ATTENTION_KV(HD, MAXG)                                                                                                                         \
    extern "C" __global__ void __launch_bounds__(KVD_WARPS * 32, 3) decode_attention_kv_##HD##_##MAXG(                                               \
        const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, const u32* __restrict__ row_seq,                   \
        const u32* __restrict__ positions, const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out, bf16_t* __restrict__ outb,      \
        int ldb, const u32* __restrict__ row_tiles, int n_heads, int n_kv, int block_size, float scale) {                                                        \
        attention_kv<HD, MAXG>(qkv, kc, vc, row_seq, positions, block_tables, bt_stride, out, outb, ldb, row_tiles, n_heads, n_kv, block_size, scale);     \
    }
ATTENTION_KV(64, 1)
ATTENTION_KV(128, 1)
ATTENTION_KV(256, 1)
ATTENTION_KV(64, 2)
ATTENTION_KV(128, 2)
ATTENTION_KV(256, 2)
ATTENTION_KV(64, 4)
ATTENTION_KV(128, 4)
ATTENTION_KV(256, 4)
ATTENTION_KV(64, 8)
ATTENTION_KV(128, 8)
ATTENTION_KV(256, 8)
