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

// The end of a row's norm once every block's partial sums `part` (Σ h² at [0], this slice's part
// of t_j at [1 + j]) are visible to the cluster: the row's normed slice into out (and outb), and
// this block's share of the row's t (added in block order, times inv).
__device__ __forceinline__ void lah_finish_row(const float* part, const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                               bf16_t* __restrict__ outb, int dim, float eps, int row, int k0, u32 q, int nr, float* __restrict__ t,
                                               u32 pos, int W) {
    float tot = 0.f;
    for (u32 b = 0; b < LAH_CL; ++b) tot += ld_cluster(&part[0], b);
    const float inv = rsqrtf(tot / dim + eps);
    const size_t base = (size_t)row * dim + k0;
    for (int i = threadIdx.x; i < dim / LAH_CL / 4; i += blockDim.x) {
        // h again, from x (this thread wrote it) or x + delta.
        const float4 v = reinterpret_cast<const float4*>(x + base)[i];
        const float4 wv = reinterpret_cast<const float4*>(w + k0)[i];
        const float4 o = make_float4((v.x * inv) * wv.x, (v.y * inv) * wv.y, (v.z * inv) * wv.z, (v.w * inv) * wv.w);
        reinterpret_cast<float4*>(out + base)[i] = o;
        if (outb) store_bf16x4(outb + base + 4 * i, o);
    }
    for (int j = q + LAH_CL * threadIdx.x; j < nr; j += LAH_CL * blockDim.x) {
        float s = 0.f;
        for (u32 b = 0; b < LAH_CL; ++b) s += ld_cluster(&part[1 + j], b);
        t[(size_t)pos * W + j] = s * inv;
    }
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
                                                     float* __restrict__ out, bf16_t* __restrict__ outb, int dim, float eps,
                                                     const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
                                                     int n_slices, int R, float* __restrict__ t,
                                                     const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,
                                                     const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p) {
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
    lah_finish_row(part, x, w, out, outb, dim, eps, r, k0, q, nr, t, pos, W);
    cluster_barrier(); // no block leaves while another may still read its shared memory
#undef LAH_LOAD_A
}

#define RMS_NORM_SHRINK(CPL)                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS) rms_norm_shrink_##CPL(                                                             \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, int R,  \
        float* __restrict__ t) {                                                                                                                \
        rms_norm_shrink_body<CPL, false>(x, delta, w, out, outb, dim, eps, A, G, C, ranks, n_slices, R, t, nullptr, 0, nullptr, nullptr, nullptr, \
                                         nullptr, 0, 0);                                                                                        \
    }                                                                                                                                           \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS) rms_norm_lora2_##CPL(                                                             \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, int R,  \
        float* __restrict__ t, const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,           \
        const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p) {                                                \
        rms_norm_shrink_body<CPL, true>(x, delta, w, out, outb, dim, eps, A, G, C, ranks, n_slices, R, t, xp, in_p, Ap, Btp, ranks_p, scal_p,    \
                                        R_p, b_ld_p);                                                                                           \
    }
RMS_NORM_SHRINK(1)
RMS_NORM_SHRINK(2)
RMS_NORM_SHRINK(4)

// ---- The same over groups of rows that share an adapter's A (and the previous site's A / Bᵀ) ----
//
// A cluster takes LAH_G rows of the staged walk (lora.rs `pack_tiles`: grouped rows by slot,
// then base rows) instead of one, each block the same input slice of every one of them; for each
// run of rows of one slot the A rows a warp loads serve every row of the run (at 64 decode rows
// of one adapter the per-row kernel reads qkv's 393 KB of A once per row, 25 MB of L2 reads a
// layer). Every sum is the per-row kernel's, in its order, so the outputs are identical.
#define LAH_G 4

// The run of rows of one slot starting at i0 (rows with `n[i] > 0`): its end.
template <int N>
__device__ __forceinline__ int lah_run_end(const int* n, const u32* slot, int i0) {
    int i1 = i0 + 1;
    while (i1 < N && n[i1] && slot[i1] == slot[i0]) ++i1;
    return i1;
}

template <int LAH_CPL, bool PREV>
__device__ __forceinline__ void rms_norm_shrink_rg_body(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w,
                                                        float* __restrict__ out, bf16_t* __restrict__ outb, int dim, float eps,
                                                        const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
                                                        int n_slices, int R, float* __restrict__ t,
                                                        const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,
                                                        const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p, int m) {
    __shared__ __align__(16) float hw[LAH_G][LAH_MAX_SLICE / 2]; // h·w over this block's slice, per row (slices ≤ 512 here)
    __shared__ float part[LAH_G][1 + LAH_MAX_W];
    __shared__ float sh[33];
    __shared__ float part_p[LAH_G][PREV ? LAH_MAX_RP : 1], coef_p[LAH_G][PREV ? LAH_MAX_RP : 1];
    const int grp = blockIdx.x / LAH_CL;
    const u32 q = blockIdx.x % LAH_CL;
    const int ks = dim / LAH_CL, k0 = q * ks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int W = n_slices * R;
    const int chunks = ks / 8;
    int row[LAH_G], nr[LAH_G];
    u32 pos[LAH_G], slot[LAH_G];
#pragma unroll
    for (int i = 0; i < LAH_G; ++i) {
        const int wi = grp * LAH_G + i;
        const u32 rr = wi < m ? G[1 + 6 * C + wi] : LAH_NO_POS;
        row[i] = rr == LAH_NO_POS ? -1 : (int)rr;
        pos[i] = rr == LAH_NO_POS ? LAH_NO_POS : G[1 + 4 * C + rr];
        slot[i] = pos[i] == LAH_NO_POS ? 0 : G[1 + 5 * C + rr];
        nr[i] = pos[i] == LAH_NO_POS ? 0 : n_slices * (int)ranks[slot[i]];
    }
    uint4 av[LAH_RG][LAH_CPL];
#define LAH_LOAD_A_OF(s, n, j0)                                                                                   \
    _Pragma("unroll") for (int g = 0; g < LAH_RG; ++g) {                                                          \
        const int j = (j0) + nw * g;                                                                              \
        const uint4* a = reinterpret_cast<const uint4*>(A + ((size_t)(s) * W + min(j, max((n) - 1, 0))) * dim + k0); \
        _Pragma("unroll") for (int c = 0; c < LAH_CPL; ++c) {                                                     \
            const int ch = lane + 32 * c;                                                                         \
            av[g][c] = j < (n) && ch < chunks ? __ldg(a + ch) : make_uint4(0, 0, 0, 0);                           \
        }                                                                                                         \
    }
    // The first run's first A rows stream in while the predecessor drains.
    if (warp < nr[0]) { LAH_LOAD_A_OF(slot[0], nr[0], warp) }
    pdl_entry();
    int rp[LAH_G];
#pragma unroll
    for (int i = 0; i < LAH_G; ++i) rp[i] = 0;
    if constexpr (PREV) {
#pragma unroll
        for (int i = 0; i < LAH_G; ++i) rp[i] = pos[i] == LAH_NO_POS ? 0 : (int)ranks_p[slot[i]];
        const int ksp = in_p / LAH_CL, chp = ksp / 8;
        // The previous site's shrink, run by run: each A_p load serves the run's rows.
        for (int i0 = 0; i0 < LAH_G;) {
            if (!rp[i0]) {
                ++i0;
                continue;
            }
            const int i1 = lah_run_end<LAH_G>(rp, slot, i0);
            for (int j = warp; j < rp[i0]; j += nw) {
                const uint4* a = reinterpret_cast<const uint4*>(Ap + (size_t)slot[i0] * R_p * in_p + q * ksp + (size_t)j * in_p);
                uint4 ap[LAH_PREV_CPL];
#pragma unroll
                for (int c = 0; c < LAH_PREV_CPL; ++c) ap[c] = lane + 32 * c < chp ? __ldg(a + lane + 32 * c) : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int i = 0; i < LAH_G; ++i) {
                    if (i < i0 || i >= i1) continue;
                    const float4* xr = reinterpret_cast<const float4*>(xp + (size_t)row[i] * in_p + q * ksp);
                    float acc = 0.f;
#pragma unroll
                    for (int c = 0; c < LAH_PREV_CPL; ++c) {
                        const int ch = lane + 32 * c;
                        if (ch < chp) acc = dot8(ap[c], xr[2 * ch], xr[2 * ch + 1], acc);
                    }
                    acc = warp_sum(acc);
                    if (lane == 0) part_p[i][j] = acc;
                }
            }
            i0 = i1;
        }
        cluster_barrier(); // every block's part of t_p is written and visible to the cluster
#pragma unroll
        for (int i = 0; i < LAH_G; ++i) {
            for (int j = threadIdx.x; j < rp[i]; j += blockDim.x) {
                float sp = 0.f;
                for (u32 b = 0; b < LAH_CL; ++b) sp += ld_cluster(&part_p[i][j], b);
                coef_p[i][j] = sp * scal_p[slot[i] * 3];
            }
        }
        __syncthreads();
    }
    float ss[LAH_G];
#pragma unroll
    for (int i = 0; i < LAH_G; ++i) ss[i] = 0.f;
    for (int u = threadIdx.x; u < ks / 4; u += blockDim.x) {
        // The previous site's delta over this thread's 4 columns, run by run, each Bᵀ_p load
        // serving the run's rows.
        float e[LAH_G][4];
#pragma unroll
        for (int i = 0; i < LAH_G; ++i) e[i][0] = e[i][1] = e[i][2] = e[i][3] = 0.f;
        if (PREV) {
            for (int i0 = 0; i0 < LAH_G;) {
                if (!rp[i0]) {
                    ++i0;
                    continue;
                }
                const int i1 = lah_run_end<LAH_G>(rp, slot, i0);
                const bf16_t* bp = Btp + (size_t)slot[i0] * R_p * b_ld_p + k0 + 4 * u;
                for (int j = 0; j < rp[i0]; ++j) {
                    const uint2 bb = __ldg(reinterpret_cast<const uint2*>(bp + (size_t)j * b_ld_p));
                    const float b0 = __uint_as_float(bb.x << 16), b1 = __uint_as_float(bb.x & 0xffff0000u);
                    const float b2 = __uint_as_float(bb.y << 16), b3 = __uint_as_float(bb.y & 0xffff0000u);
#pragma unroll
                    for (int i = 0; i < LAH_G; ++i) {
                        if (i < i0 || i >= i1) continue;
                        const float c = coef_p[i][j];
                        e[i][0] += c * b0, e[i][1] += c * b1, e[i][2] += c * b2, e[i][3] += c * b3;
                    }
                }
                i0 = i1;
            }
        }
        const float4 wv = reinterpret_cast<const float4*>(w + k0)[u];
#pragma unroll
        for (int i = 0; i < LAH_G; ++i) {
            if (row[i] < 0) continue;
            float* xr = x + (size_t)row[i] * dim + k0;
            float4 v = reinterpret_cast<const float4*>(xr)[u];
            if (delta) {
                const float4 d = reinterpret_cast<const float4*>(delta + (size_t)row[i] * dim + k0)[u];
                v.x += d.x, v.y += d.y, v.z += d.z, v.w += d.w;
            }
            if (PREV && rp[i]) v.x += e[i][0], v.y += e[i][1], v.z += e[i][2], v.w += e[i][3];
            if (delta || rp[i]) reinterpret_cast<float4*>(xr)[u] = v;
            ss[i] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            reinterpret_cast<float4*>(hw[i])[u] = make_float4(v.x * wv.x, v.y * wv.y, v.z * wv.z, v.w * wv.w);
        }
    }
#pragma unroll
    for (int i = 0; i < LAH_G; ++i) {
        const float s = block_sum(ss[i], sh); // its barriers also publish hw
        if (threadIdx.x == 0) part[i][0] = s;
    }
    // This slice's part of every t_j, run by run: a warp's A rows (LAH_RG at once) against
    // every row of the run.
    for (int i0 = 0; i0 < LAH_G;) {
        if (!nr[i0]) {
            ++i0;
            continue;
        }
        const int i1 = lah_run_end<LAH_G>(nr, slot, i0);
        for (int j0 = warp; j0 < nr[i0]; j0 += nw * LAH_RG) {
            if (i0 != 0 || j0 != warp) { LAH_LOAD_A_OF(slot[i0], nr[i0], j0) }
#pragma unroll
            for (int i = 0; i < LAH_G; ++i) {
                if (i < i0 || i >= i1) continue;
                float acc[LAH_RG];
#pragma unroll
                for (int g = 0; g < LAH_RG; ++g) acc[g] = 0.f;
#pragma unroll
                for (int c = 0; c < LAH_CPL; ++c) {
                    const int ch = lane + 32 * c;
                    if (ch < chunks) {
                        const float4 h0 = reinterpret_cast<const float4*>(hw[i])[2 * ch], h1 = reinterpret_cast<const float4*>(hw[i])[2 * ch + 1];
#pragma unroll
                        for (int g = 0; g < LAH_RG; ++g) acc[g] = dot8(av[g][c], h0, h1, acc[g]);
                    }
                }
#pragma unroll
                for (int g = 0; g < LAH_RG; ++g) {
                    const float v = warp_sum(acc[g]);
                    if (lane == 0 && j0 + nw * g < nr[i0]) part[i][1 + j0 + nw * g] = v;
                }
            }
        }
        i0 = i1;
    }
    cluster_barrier(); // every block's partials are written and visible to the cluster
#pragma unroll
    for (int i = 0; i < LAH_G; ++i)
        if (row[i] >= 0) lah_finish_row(part[i], x, w, out, outb, dim, eps, row[i], k0, q, nr[i], t, pos[i], W);
    cluster_barrier(); // no block leaves while another may still read its shared memory
#undef LAH_LOAD_A_OF
}

#define RMS_NORM_SHRINK_RG(CPL)                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS) rms_norm_shrink_rg_##CPL(                                                          \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, int R,  \
        float* __restrict__ t, int m) {                                                                                                         \
        rms_norm_shrink_rg_body<CPL, false>(x, delta, w, out, outb, dim, eps, A, G, C, ranks, n_slices, R, t, nullptr, 0, nullptr, nullptr,      \
                                            nullptr, nullptr, 0, 0, m);                                                                         \
    }                                                                                                                                           \
    extern "C" __global__ void __launch_bounds__(LAH_THREADS) rms_norm_lora2_rg_##CPL(                                                          \
        float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w, float* __restrict__ out, bf16_t* __restrict__ outb, \
        int dim, float eps, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, int n_slices, int R,  \
        float* __restrict__ t, const float* __restrict__ xp, int in_p, const bf16_t* __restrict__ Ap, const bf16_t* __restrict__ Btp,           \
        const u32* __restrict__ ranks_p, const float* __restrict__ scal_p, int R_p, int b_ld_p, int m) {                                         \
        rms_norm_shrink_rg_body<CPL, true>(x, delta, w, out, outb, dim, eps, A, G, C, ranks, n_slices, R, t, xp, in_p, Ap, Btp, ranks_p, scal_p, \
                                           R_p, b_ld_p, m);                                                                                     \
    }
RMS_NORM_SHRINK_RG(1)
RMS_NORM_SHRINK_RG(2)
