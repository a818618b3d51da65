// A LoRA site's shrink computed ahead, in the RMSNorm that makes its input (lora_ahead.rs).
// Appended after lora.cu in the one NVRTC module (bf16 helpers, dot8, warp_sum, block_sum and
// pdl_entry of kernels.cu are in scope).
//
// rms_norm / add_rms_norm of each row, fused with the shrink t = xn·Aᵀ of the site the row
// feeds next. xn_k = h_k·inv·w_k with h = x (+ delta) and inv = 1/sqrt(mean(h²) + eps), so
// t_j = inv · Σ_k h_k·w_k·A[slot][j][k]. A row is one cluster of LAH_CL blocks (sm_90), block q
// owning inputs [q·dim/LAH_CL, (q+1)·dim/LAH_CL): it sums its slice's squares and its slice's
// part of every t_j, the blocks swap those partials through distributed shared memory (one
// cluster barrier), and each block adds all of them in block order, so no sum depends on timing.
// A block reads and writes only its own slice of x, so `x += delta` needs no second pass and no
// block can see another's half-updated row. Base rows (no position) are normed only.
//
// Everything before pdl_entry() is metadata staged before the step (the row's position and slot,
// the slot's rank) and A (written only by slot loads, before the step): all of it is complete
// before any kernel of the step starts, so this kernel fetches its A rows while its predecessor
// (the projection making `delta`) still drains.
//
// Row r's position p = G[1 + 4C + r] and slot G[1 + 5C + r] (lora.rs `pack_tiles`); t is
// written as the shrink writes it, [C][n·R] by position, slice j of a rank-r slot at j·r, so the
// same consumers read it (the single-row GEMV's epilogue, lora_expand).

#define LAH_CL 8          // blocks per row (a portable cluster size)
#define LAH_THREADS 256   // threads per block
// Blocks per SM the registers are fitted to; an A/B may override it (QUIVER_CUDA_NVRTC_DEFINES).
#ifndef LAH_MIN_BLOCKS
#define LAH_MIN_BLOCKS 1
#endif
#define LAH_MAX_SLICE 1024 // inputs per block at most: dim ≤ 8192
#define LAH_MAX_W 192     // n·R at most (3 slices of rank 64)
#define LAH_RG 4          // A rows a warp loads at once

#define LAH_NO_POS 0xffffffffu

__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// `p` (this block's shared memory) as block `rank` of the cluster holds it.
__device__ __forceinline__ float ld_cluster(const float* p, u32 rank) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

// grid (rows · LAH_CL), cluster (LAH_CL), LAH_THREADS threads. dim % (8 · LAH_CL) == 0,
// n_slices · R ≤ LAH_MAX_W, and a block's slice dim / LAH_CL ≤ 256 · LAH_CPL inputs: the lanes
// of a warp hold an A row's slice in LAH_CPL 16-byte loads each (the host picks the kernel).
//
// With PREV (`rms_norm_lora2_*`, lora_epilogue.rs) the residual also gets the delta of the
// single-slice site before it (o_proj or down_proj, whose GEMM output is `delta`), deferred to
// here instead of a launch of its own: the cluster first computes that site's shrink from its
// input rows `xp` (block q dots its slice of the inputs with each A_p row, the partials are
// swapped and added in block order like the others), then every block adds s·t_p·Bᵀ_p to its
// columns of x along with `delta`. The same row slot serves both sites (one grouping a step).
#define LAH_MAX_RP 64 // rank of the previous site at most
#define LAH_PREV_CPL 8 // 16-byte chunks a lane of the previous site's input slice: in_p ≤ 8 · 32 · 8 · LAH_CL

template <int LAH_CPL, bool PREV>
__device__ __forceinline__ void rms_norm_shrink_body(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w,
                                                     float* __restrict__ out, bf16_t* __restrict__ outb, int dim, int ldb, float eps,
                                                     const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
                                                     int n_slices, int R, float* __restrict__ t,
                                                     const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,
                                                     const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p,
                                                     const float* __restrict__ scal, int tail_cols) {
    __shared__ __align__(16) float hw[LAH_MAX_SLICE]; // h·w over this block's slice
    __shared__ float part[1 + LAH_MAX_W];              // [0] Σ h², [1 + j] this slice's part of t_j
    __shared__ float sh[33];
    __shared__ float part_p[PREV ? LAH_MAX_RP : 1], coef_p[PREV ? LAH_MAX_RP : 1]; // the previous site's t: this block's part, then scaled
    const int r = blockIdx.x / LAH_CL;
    const u32 q = blockIdx.x % LAH_CL; // the cluster is LAH_CL consecutive blocks along x
    const int ks = dim / LAH_CL, k0 = q * ks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const u32 pos = G[1 + 4 * C + r];
    const u32 slot = pos == LAH_NO_POS ? 0 : G[1 + 5 * C + r];
    const int nr = pos == LAH_NO_POS ? 0 : n_slices * (int)ranks[slot];
    const int W = n_slices * R;
    const int chunks = ks / 8; // 8-input chunks of the slice
    // This warp's first LAH_RG A rows (j = warp + nw·i), loaded before waiting for the
    // predecessor.
    uint4 av[LAH_RG][LAH_CPL];
#define LAH_LOAD_A(j0)                                                                                                \
    _Pragma("unroll") for (int i = 0; i < LAH_RG; ++i) {                                                              \
        const int j = (j0) + nw * i;                                                                                  \
        const uint4* a = reinterpret_cast<const uint4*>(A + ((size_t)slot * W + min(j, max(nr - 1, 0))) * dim + k0); \
        _Pragma("unroll") for (int c = 0; c < LAH_CPL; ++c) {                                                         \
            const int ch = lane + 32 * c;                                                                             \
            av[i][c] = j < nr && ch < chunks ? __ldg(a + ch) : make_uint4(0, 0, 0, 0);                                \
        }                                                                                                             \
    }
    if (warp < nr) { LAH_LOAD_A(warp) }
    pdl_entry();
    const size_t base = (size_t)r * dim + k0;
    int rp = 0;
    if constexpr (PREV) {
        rp = pos == LAH_NO_POS ? 0 : (int)ranks_p[slot];
        const int ksp = in_p / LAH_CL, chp = ksp / 8; // chp ≤ 32 · LAH_PREV_CPL (the host checks)
        const float4* xr = reinterpret_cast<const float4*>(xp + (size_t)r * in_p + q * ksp);
        const bf16_t* ap = Ap + (size_t)slot * R_p * in_p + q * ksp;
        for (int j = warp; j < rp; j += nw) {
            // All of a lane's 16-byte loads of the A row in flight at once (session 23 measured
            // this shrink as one dependent load after another: the fused norm took 19 µs at 16
            // rows against add_rms_norm's 7).
            const uint4* a = reinterpret_cast<const uint4*>(ap + (size_t)j * in_p);
            uint4 av[LAH_PREV_CPL];
#pragma unroll
            for (int c = 0; c < LAH_PREV_CPL; ++c) av[c] = lane + 32 * c < chp ? __ldg(a + lane + 32 * c) : make_uint4(0, 0, 0, 0);
            float acc = 0.f;
#pragma unroll
            for (int c = 0; c < LAH_PREV_CPL; ++c) {
                const int ch = lane + 32 * c;
                if (ch < chp) acc = dot8(av[c], xr[2 * ch], xr[2 * ch + 1], acc);
            }
            acc = warp_sum(acc);
            if (lane == 0) part_p[j] = acc;
        }
        cluster_barrier(); // every block's part of t_p is written and visible to the cluster
        for (int j = threadIdx.x; j < rp; j += blockDim.x) {
            float sp = 0.f;
            for (u32 b = 0; b < LAH_CL; ++b) sp += ld_cluster(&part_p[j], b);
            coef_p[j] = sp * scal_p[slot * 3];
        }
        __syncthreads();
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < ks / 4; i += blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(x + base)[i];
        if (delta) {
            const float4 d = reinterpret_cast<const float4*>(delta + base)[i];
            v.x += d.x, v.y += d.y, v.z += d.z, v.w += d.w;
        }
        if (PREV && rp) {
            // s·t_p·Bᵀ_p over this thread's 4 columns (8-byte Bᵀ loads: b_ld_p % 4 == 0).
            const bf16_t* bp = Btp + (size_t)slot * R_p * b_ld_p + k0 + 4 * i;
            float e[4] = {0.f, 0.f, 0.f, 0.f};
            for (int j = 0; j < rp; ++j) {
                const uint2 bb = __ldg(reinterpret_cast<const uint2*>(bp + (size_t)j * b_ld_p));
                const float c = coef_p[j];
                e[0] += c * __uint_as_float(bb.x << 16), e[1] += c * __uint_as_float(bb.x & 0xffff0000u);
                e[2] += c * __uint_as_float(bb.y << 16), e[3] += c * __uint_as_float(bb.y & 0xffff0000u);
            }
            v.x += e[0], v.y += e[1], v.z += e[2], v.w += e[3];
        }
        if (delta || rp) reinterpret_cast<float4*>(x + base)[i] = v;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        const float4 wv = reinterpret_cast<const float4*>(w + k0)[i];
        reinterpret_cast<float4*>(hw)[i] = make_float4(v.x * wv.x, v.y * wv.y, v.z * wv.z, v.w * wv.w);
    }
    ss = block_sum(ss, sh); // its barriers also publish hw
    if (threadIdx.x == 0) part[0] = ss;
    // This slice's part of every t_j: a warp per A row, LAH_RG rows' loads in flight at once.
    for (int j0 = warp; j0 < nr; j0 += nw * LAH_RG) {
        if (j0 != warp) { LAH_LOAD_A(j0) }
        float acc[LAH_RG];
#pragma unroll
        for (int i = 0; i < LAH_RG; ++i) acc[i] = 0.f;
#pragma unroll
        for (int c = 0; c < LAH_CPL; ++c) {
            const int ch = lane + 32 * c;
            if (ch < chunks) {
                const float4 h0 = reinterpret_cast<const float4*>(hw)[2 * ch], h1 = reinterpret_cast<const float4*>(hw)[2 * ch + 1];
#pragma unroll
                for (int i = 0; i < LAH_RG; ++i) acc[i] = dot8(av[i][c], h0, h1, acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < LAH_RG; ++i) {
            const float v = warp_sum(acc[i]);
            if (lane == 0 && j0 + nw * i < nr) part[1 + j0 + nw * i] = v;
        }
    }
    cluster_barrier(); // every block's partials are written and visible to the cluster
    float tot = 0.f;
    for (u32 b = 0; b < LAH_CL; ++b) tot += ld_cluster(&part[0], b);
    const float inv = rsqrtf(tot / dim + eps);
    for (int i = threadIdx.x; i < ks / 4; i += blockDim.x) {
        // h again, from x (this thread wrote it) or x + delta.
        float4 v = reinterpret_cast<const float4*>(x + base)[i];
        const float4 wv = reinterpret_cast<const float4*>(w + k0)[i];
        const float4 o = make_float4((v.x * inv) * wv.x, (v.y * inv) * wv.y, (v.z * inv) * wv.z, (v.w * inv) * wv.w);
        reinterpret_cast<float4*>(out + base)[i] = o;
        if (outb) store_bf16x4(outb + (size_t)r * ldb + k0 + 4 * i, o);
    }
    // With the site's LoRA tail (tail_cols > 0, lora_tail.rs `TailRows`) t̂ goes beside the bf16
    // copy as `lora_tail_shrink` would place it: s_j·t in column slot·W + j·R + i for slice j's
    // rank index i, zeros in every other column (other slots, base rows, i ≥ rank).
    const int rank = nr > 0 ? nr / n_slices : 0;
    // (The host sizes tail_cols to hold every row's slot; the bound keeps a write in the room.)
    bf16_t* tb = outb && tail_cols > 0 ? outb + (size_t)r * ldb + dim : nullptr;
    const bool tb_slot = tb && nr > 0 && ((int)slot + 1) * W <= tail_cols;
    for (int j = q + LAH_CL * threadIdx.x; j < nr; j += LAH_CL * blockDim.x) {
        float s = 0.f;
        for (u32 b = 0; b < LAH_CL; ++b) s += ld_cluster(&part[1 + j], b);
        t[(size_t)pos * W + j] = s * inv;
        if (tb_slot) {
            const int js = j / rank;
            tb[slot * W + js * R + (j - js * rank)] = f2bf(s * inv * scal[slot * 3 + js]);
        }
    }
    if (tb) {
        for (int c = q + LAH_CL * threadIdx.x; c < tail_cols; c += LAH_CL * blockDim.x) {
            const int rem = c - (int)slot * W, i = rem - (rem / R) * R;
            if (!tb_slot || rem < 0 || rem >= W || i >= rank) tb[c] = f2bf(0.f); // the loop above writes the rest
        }
    }
    cluster_barrier(); // no block leaves while another may still read its shared memory
#undef LAH_LOAD_A
}

#define RMS_NORM_SHRINK(CPL)                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS, LAH_MIN_BLOCKS) rms_norm_shrink_##CPL(                                                             \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, int ldb, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, \
        int R,                                                                                                                                   \
        float* __restrict__ t, const float* __restrict__ scal, int tail_cols) {                                                                 \
        rms_norm_shrink_body<CPL, false>(x, delta, w, out, outb, dim, ldb, eps, A, G, C, ranks, n_slices, R, t, nullptr, 0, nullptr, nullptr, nullptr, \
                                         nullptr, 0, 0, scal, tail_cols);                                                                       \
    }                                                                                                                                           \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS, LAH_MIN_BLOCKS) rms_norm_lora2_##CPL(                                                             \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, int ldb, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, \
        int R,                                                                                                                                   \
        float* __restrict__ t, const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,           \
        const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p, const float* __restrict__ scal, int tail_cols) { \
        rms_norm_shrink_body<CPL, true>(x, delta, w, out, outb, dim, ldb, eps, A, G, C, ranks, n_slices, R, t, xp, in_p, Ap, Btp, ranks_p, scal_p,    \
                                        R_p, b_ld_p, scal, tail_cols);                                                                          \
    }
RMS_NORM_SHRINK(1)
RMS_NORM_SHRINK(2)
RMS_NORM_SHRINK(4)
