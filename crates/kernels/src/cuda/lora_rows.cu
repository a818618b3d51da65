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
// LRW_NO_SLOT for base rows. Only metadata staged before the step and A (written only by slot
// loads) are read before pdl_entry(), which every block reaches.

#define LRW_CL 8          // blocks per row (a portable cluster size)
#define LRW_THREADS 256   // threads per block
#define LRW_MAX_W 192     // n·r at most (3 slices of rank 64)
#define LRW_NO_SLOT 0xffffffffu
// Blocks per SM the registers are fitted to; an A/B may override it (QUIVER_CUDA_NVRTC_DEFINES).
#ifndef LRW_MIN_BLOCKS
#define LRW_MIN_BLOCKS 1
#endif

// LRW_CPL: 16-byte chunks (8 inputs) a lane holds of the block's input slice; the host picks the
// smallest that covers in / LRW_CL / 8 / 32.
template <int LRW_CPL>
__device__ __forceinline__ void lora_rows_body(const float* __restrict__ x, const bf16_t* __restrict__ A, const bf16_t* __restrict__ Bt,
                                               const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal,
                                               int n_slices, int R, int in_dim, int b_ld, int off1, int off2, int out, int add,
                                               float* __restrict__ y) {
    __shared__ float part[LRW_MAX_W]; // this block's part of every t_j
    __shared__ float coef[LRW_MAX_W]; // t_j scaled by its slice's scaling
    const int r = blockIdx.x / LRW_CL;
    const u32 q = blockIdx.x % LRW_CL; // the cluster is LRW_CL consecutive blocks along x
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const u32 slot = G[1 + 5 * C + r];
    const int rk = slot == LRW_NO_SLOT ? 0 : (int)ranks[slot];
    const int nr = n_slices * rk, W = n_slices * R;
    const int ks = in_dim / LRW_CL, k0 = q * ks, chunks = ks / 8;
    // Output units of this block: 8-column groups when the widths allow 16-byte Bᵀ loads.
    const bool vec = (out & 7) == 0 && (b_ld & 7) == 0;
    const int units = vec ? out / 8 : out, per = (units + LRW_CL - 1) / LRW_CL;
    const int u0 = min(units, (int)q * per), u1 = min(units, u0 + per);
    float* yr = y + (size_t)r * out;
    // A rows a warp loads at once: ~8 16-byte loads a lane in flight whatever the slice width.
    constexpr int RG = LRW_CPL >= 8 ? 1 : 8 / LRW_CPL;
    const bf16_t* a0 = A + (size_t)(slot == LRW_NO_SLOT ? 0 : slot) * W * in_dim + k0;
    uint4 av[RG][LRW_CPL];
#define LRW_LOAD_A(j0)                                                                                       \
    _Pragma("unroll") for (int g = 0; g < RG; ++g) {                                                         \
        const int j = (j0) + nw * g;                                                                         \
        const uint4* a = reinterpret_cast<const uint4*>(a0 + (size_t)min(j, max(nr - 1, 0)) * in_dim);       \
        _Pragma("unroll") for (int c = 0; c < LRW_CPL; ++c) {                                                \
            const int ch = lane + 32 * c;                                                                    \
            av[g][c] = j < nr && ch < chunks ? __ldg(a + ch) : make_uint4(0, 0, 0, 0);                       \
        }                                                                                                    \
    }
    // The first A rows stream in while the predecessor (the GEMM's producer) drains.
    LRW_LOAD_A(warp)
    pdl_entry();
    if (nr == 0) {
        // A base row (the whole cluster agrees, so no block waits at a barrier alone).
        if (!add) {
            for (int u = u0 + threadIdx.x; u < u1; u += blockDim.x) {
                if (vec) {
                    reinterpret_cast<float4*>(yr + 8 * u)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
                    reinterpret_cast<float4*>(yr + 8 * u)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
                } else {
                    yr[u] = 0.f;
                }
            }
        }
        return;
    }
    // This lane's chunks of the row's slice, held for every A row.
    const float* xr = x + (size_t)r * in_dim + k0;
    float4 xu[LRW_CPL], xv[LRW_CPL];
#pragma unroll
    for (int c = 0; c < LRW_CPL; ++c) {
        const int ch = lane + 32 * c;
        xu[c] = ch < chunks ? *reinterpret_cast<const float4*>(xr + 8 * ch) : make_float4(0.f, 0.f, 0.f, 0.f);
        xv[c] = ch < chunks ? *reinterpret_cast<const float4*>(xr + 8 * ch + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int j0 = warp; j0 < nr; j0 += nw * RG) {
        if (j0 != warp) {
            LRW_LOAD_A(j0)
        }
#pragma unroll
        for (int g = 0; g < RG; ++g) {
            const int j = j0 + nw * g;
            if (j < nr) {
                float acc = 0.f;
#pragma unroll
                for (int c = 0; c < LRW_CPL; ++c) {
                    float af[8];
                    bf16x8_to_f32(av[g][c], af);
                    acc += dot8(af, xu[c], xv[c]);
                }
                acc = warp_sum(acc);
                if (lane == 0) part[j] = acc;
            }
        }
    }
#undef LRW_LOAD_A
    __syncthreads();
    cluster_barrier();
    for (int j = threadIdx.x; j < nr; j += blockDim.x) {
        float s = 0.f;
        for (u32 b = 0; b < LRW_CL; ++b) s += ld_cluster(&part[j], b);
        coef[j] = s * scal[slot * 3 + j / rk];
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
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = 0.f;
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
                        for (int e = 0; e < 8; ++e) acc[e] += coef[jr[e] + k0b + i] * bf[e];
                    }
                }
            }
            float4* yo = reinterpret_cast<float4*>(yr + o0);
            if (add) {
                const float4 p0 = yo[0], p1 = yo[1];
                acc[0] += p0.x; acc[1] += p0.y; acc[2] += p0.z; acc[3] += p0.w;
                acc[4] += p1.x; acc[5] += p1.y; acc[6] += p1.z; acc[7] += p1.w;
            }
            yo[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            yo[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
    } else {
        for (int o = u0 + threadIdx.x; o < u1; o += blockDim.x) {
            const int jr = ((o >= off1) + (o >= off2)) * rk;
            float acc = 0.f;
            for (int k = 0; k < rk; ++k) acc += coef[jr + k] * bf2f(b[(size_t)k * b_ld + o]);
            yr[o] = add ? yr[o] + acc : acc;
        }
    }
}

#define LRW_KERNEL(CPL)                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(LRW_THREADS, LRW_MIN_BLOCKS) lora_rows_##CPL(const float* __restrict__ x, const bf16_t* __restrict__ A,     \
            const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal, \
            int n_slices, int R, int in_dim, int b_ld, int off1, int off2, int out, int add, float* __restrict__ y) {                      \
        lora_rows_body<CPL>(x, A, Bt, G, C, ranks, scal, n_slices, R, in_dim, b_ld, off1, off2, out, add, y);                             \
    }
LRW_KERNEL(1)
LRW_KERNEL(2)
LRW_KERNEL(4)
LRW_KERNEL(8)
