// A LoRA site's whole delta, row by row, in one launch (lora_rows.rs). Appended after
// lora_ahead.cu in the one NVRTC module (bf16 helpers, dot8, bf16x8_to_f32, warp_sum,
// pdl_entry, cluster_barrier and ld_cluster are in scope).
//
// Each row is one cluster of LRW_CL blocks. Block q owns the inputs [q·in/LRW_CL, …) of the
// shrink and a 1/LRW_CL share of the output columns of the expand: it dots its slice of the row
// with its slice of each of the slot's n·r A rows (a warp per A row), the blocks swap those
// partial sums through distributed shared memory (one cluster barrier) and each adds all of them
// in block order, so every block holds the same t = x·Aᵀ and no sum depends on timing; then each
// block scales t per slice and expands its columns, Σ_k s_j·t[j·r + k]·Bᵀ[slot][k][o]. With
// `add` the delta goes into y (a residual); without, y is a delta buffer the projection's
// epilogue adds, written whole: base rows get zeros.
//
// Rows are read where they are (no permutation): row r's slot is G[1 + 5C + r] (pack_tiles),
// LRW_NO_SLOT for base rows. The shared form gives a cluster up to P rows of one adapter instead
// (lora_rows_find). Only metadata staged before the step and A (written only by slot loads) are
// read before pdl_entry(), which every block reaches.

#define LRW_CL 8          // blocks per row (a portable cluster size)
#define LRW_THREADS 256   // threads per block
#define LRW_MAX_W 192     // n·r at most (3 slices of rank 64)
#define LRW_NO_SLOT 0xffffffffu

// The rows a cluster computes: P = 1 (`lora_rows_*`) row c itself, for an adapter row; P > 1
// (`lora_rows_shared_*`) up to P consecutive positions of one tile of the step's grouping (rows of
// one slot, `pack_tiles`: tiles of n rows give ceil(n / P) sub-tiles each, in tile order), so each
// A and Bᵀ element a block loads serves P rows; clusters past the step's sub-tiles compute
// nothing. Sets n (0: nothing), slot and rows[0..n). Reads only metadata staged before the step.
template <int P>
__device__ __forceinline__ int lora_rows_find(const u32* __restrict__ G, int C, int c, u32& slot, int* rows) {
    if (P == 1) {
        slot = G[1 + 5 * C + c];
        rows[0] = c;
        return slot == LRW_NO_SLOT ? 0 : 1;
    }
    __shared__ int sub_start, sub_len, sub_slot;
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        const int tiles = (int)G[0];
        int base = 0, found = 0;
        for (int i0 = 0; i0 < tiles && !found; i0 += 32) {
            const int i = i0 + lane;
            const int len = i < tiles ? (int)G[1 + 2 * C + i] : 0;
            const int subs = (len + P - 1) / P;
            int inc = subs;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            const int exc = inc - subs;
            const bool mine = c >= base + exc && c < base + inc;
            if (mine) {
                const int s = c - base - exc;
                sub_start = (int)G[1 + C + i] + s * P;
                sub_len = min(P, len - s * P);
                sub_slot = (int)G[1 + 3 * C + i];
            }
            found = __any_sync(0xffffffffu, mine);
            base += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (!found && lane == 0) sub_len = 0;
    }
    __syncthreads();
    const int n = sub_len;
    slot = n > 0 ? (u32)sub_slot : 0u;
#pragma unroll
    for (int p = 0; p < P; ++p) rows[p] = p < n ? (int)G[1 + sub_start + p] : 0;
    return n;
}

// LRW_CPL: 16-byte chunks (8 inputs) a lane holds of the block's input slice; the host picks the
// smallest that covers in / LRW_CL / 8 / 32. P: rows a cluster may compute (lora_rows_find), their
// input slices held in registers (P × LRW_CPL chunks a lane; staging them in shared memory
// instead measured 2–3× slower, session 21). A row's sums are the same whatever P and whichever
// rows share its cluster.
template <int LRW_CPL, int P>
__device__ __forceinline__ void lora_rows_body(const float* __restrict__ x, const bf16_t* __restrict__ A, const bf16_t* __restrict__ Bt,
                                               const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal,
                                               int n_slices, int R, int in_dim, int b_ld, int off1, int off2, int out, int add,
                                               float* __restrict__ y) {
    __shared__ float part[P][LRW_MAX_W]; // this block's part of every t_j of each row
    __shared__ float coef[P][LRW_MAX_W]; // t_j scaled by its slice's scaling
    const int c = blockIdx.x / LRW_CL;
    const u32 q = blockIdx.x % LRW_CL; // the cluster is LRW_CL consecutive blocks along x
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    u32 slot;
    int rows[P];
    const int n = lora_rows_find<P>(G, C, c, slot, rows);
    const int rk = n > 0 ? (int)ranks[slot] : 0;
    const int nr = n_slices * rk, W = n_slices * R;
    const int ks = in_dim / LRW_CL, k0 = q * ks, chunks = ks / 8;
    // Output units of this block: 8-column groups when the widths allow 16-byte Bᵀ loads.
    const bool vec = (out & 7) == 0 && (b_ld & 7) == 0;
    const int units = vec ? out / 8 : out, per = (units + LRW_CL - 1) / LRW_CL;
    const int u0 = min(units, (int)q * per), u1 = min(units, u0 + per);
    // A rows a warp loads at once: ~8 16-byte loads a lane in flight whatever the slice width.
    constexpr int RG = LRW_CPL >= 8 ? 1 : 8 / LRW_CPL;
    const bf16_t* a0 = A + (size_t)(n > 0 ? slot : 0) * W * in_dim + k0;
    uint4 av[RG][LRW_CPL];
#define LRW_LOAD_A(j0)                                                                                       \
    _Pragma("unroll") for (int g = 0; g < RG; ++g) {                                                         \
        const int j = (j0) + nw * g;                                                                         \
        const uint4* a = reinterpret_cast<const uint4*>(a0 + (size_t)min(j, max(nr - 1, 0)) * in_dim);       \
        _Pragma("unroll") for (int cc = 0; cc < LRW_CPL; ++cc) {                                             \
            const int ch = lane + 32 * cc;                                                                   \
            av[g][cc] = j < nr && ch < chunks ? __ldg(a + ch) : make_uint4(0, 0, 0, 0);                      \
        }                                                                                                    \
    }
    // The first A rows stream in while the predecessor (the GEMM's producer) drains.
    LRW_LOAD_A(warp)
    pdl_entry();
    // A delta buffer is written whole: row c's share gets zeros when row c has no delta here (a
    // base row, or its adapter leaves this site out); an adapter row's cluster writes the rest.
    // The whole cluster agrees on what follows.
    const u32 own = G[1 + 5 * C + c];
    if (!add && (own == LRW_NO_SLOT || ranks[own] == 0)) {
        float* yc = y + (size_t)c * out;
        for (int u = u0 + threadIdx.x; u < u1; u += blockDim.x) {
            if (vec) {
                reinterpret_cast<float4*>(yc + 8 * u)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
                reinterpret_cast<float4*>(yc + 8 * u)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
            } else {
                yc[u] = 0.f;
            }
        }
    }
    if (nr == 0) return;
    // This lane's chunks of each row's slice, held for every A row.
    float4 xu[P][LRW_CPL], xv[P][LRW_CPL];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const float* xr = x + (size_t)rows[p] * in_dim + k0;
#pragma unroll
        for (int cc = 0; cc < LRW_CPL; ++cc) {
            const int ch = lane + 32 * cc;
            const bool ok = p < n && ch < chunks;
            xu[p][cc] = ok ? *reinterpret_cast<const float4*>(xr + 8 * ch) : make_float4(0.f, 0.f, 0.f, 0.f);
            xv[p][cc] = ok ? *reinterpret_cast<const float4*>(xr + 8 * ch + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    for (int j0 = warp; j0 < nr; j0 += nw * RG) {
        if (j0 != warp) {
            LRW_LOAD_A(j0)
        }
#pragma unroll
        for (int g = 0; g < RG; ++g) {
            const int j = j0 + nw * g;
            if (j < nr) {
                float acc[P];
#pragma unroll
                for (int p = 0; p < P; ++p) acc[p] = 0.f;
#pragma unroll
                for (int cc = 0; cc < LRW_CPL; ++cc) {
                    float af[8];
                    bf16x8_to_f32(av[g][cc], af);
#pragma unroll
                    for (int p = 0; p < P; ++p) acc[p] += dot8(af, xu[p][cc], xv[p][cc]);
                }
#pragma unroll
                for (int p = 0; p < P; ++p) {
                    const float s = warp_sum(acc[p]);
                    if (lane == 0) part[p][j] = s;
                }
            }
        }
    }
#undef LRW_LOAD_A
    __syncthreads();
    cluster_barrier();
    for (int e = threadIdx.x; e < n * nr; e += blockDim.x) {
        const int p = e / nr, j = e - p * nr;
        float s = 0.f;
        for (u32 b = 0; b < LRW_CL; ++b) s += ld_cluster(&part[p][j], b);
        coef[p][j] = s * scal[slot * 3 + j / rk];
    }
    // No block leaves (or reuses its `part`) while another still reads it.
    cluster_barrier();
    __syncthreads();
    const bf16_t* b = Bt + (size_t)slot * R * b_ld;
    if (vec) {
        for (int u = u0 + threadIdx.x; u < u1; u += blockDim.x) {
            const int o0 = 8 * u;
            int jr[8]; // j·r of each column's slice
#pragma unroll
            for (int e = 0; e < 8; ++e) jr[e] = ((o0 + e >= off1) + (o0 + e >= off2)) * rk;
            float acc[P][8];
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[p][e] = 0.f;
            // Bᵀ rows 16 at a time, all in flight together.
            for (int k0b = 0; k0b < rk; k0b += 16) {
                uint4 bq[16];
#pragma unroll
                for (int i = 0; i < 16; ++i) bq[i] = k0b + i < rk ? __ldg(reinterpret_cast<const uint4*>(b + (size_t)(k0b + i) * b_ld + o0)) : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    if (k0b + i < rk) {
                        float bf[8];
                        bf16x8_to_f32(bq[i], bf);
#pragma unroll
                        for (int p = 0; p < P; ++p)
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[p][e] += coef[p][jr[e] + k0b + i] * bf[e];
                    }
                }
            }
#pragma unroll
            for (int p = 0; p < P; ++p) {
                if (p < n) {
                    float4* yo = reinterpret_cast<float4*>(y + (size_t)rows[p] * out + o0);
                    if (add) {
                        const float4 p0 = yo[0], p1 = yo[1];
                        acc[p][0] += p0.x; acc[p][1] += p0.y; acc[p][2] += p0.z; acc[p][3] += p0.w;
                        acc[p][4] += p1.x; acc[p][5] += p1.y; acc[p][6] += p1.z; acc[p][7] += p1.w;
                    }
                    yo[0] = make_float4(acc[p][0], acc[p][1], acc[p][2], acc[p][3]);
                    yo[1] = make_float4(acc[p][4], acc[p][5], acc[p][6], acc[p][7]);
                }
            }
        }
    } else {
        for (int o = u0 + threadIdx.x; o < u1; o += blockDim.x) {
            const int jr = ((o >= off1) + (o >= off2)) * rk;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                if (p < n) {
                    float acc = 0.f;
                    for (int k = 0; k < rk; ++k) acc += coef[p][jr + k] * bf2f(b[(size_t)k * b_ld + o]);
                    float* yo = y + (size_t)rows[p] * out + o;
                    *yo = add ? *yo + acc : acc;
                }
            }
        }
    }
}

#define LRW_KERNEL(NAME, CPL, P)                                                                                                             \
    extern "C" __global__ void __launch_bounds__(LRW_THREADS) NAME(const float* __restrict__ x, const bf16_t* __restrict__ A,                 \
            const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal, \
            int n_slices, int R, int in_dim, int b_ld, int off1, int off2, int out, int add, float* __restrict__ y) {                      \
        lora_rows_body<CPL, P>(x, A, Bt, G, C, ranks, scal, n_slices, R, in_dim, b_ld, off1, off2, out, add, y);                          \
    }
LRW_KERNEL(lora_rows_1, 1, 1)
LRW_KERNEL(lora_rows_2, 2, 1)
LRW_KERNEL(lora_rows_4, 4, 1)
LRW_KERNEL(lora_rows_8, 8, 1)
LRW_KERNEL(lora_rows_shared_1_4, 1, 4)
LRW_KERNEL(lora_rows_shared_2_4, 2, 4)
LRW_KERNEL(lora_rows_shared_4_2, 4, 2)
