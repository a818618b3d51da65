// Portable weight GEMM: y[m, n] = x[m, :] · W[n, :] (+ bias[n]), W f32 or bf16 [N, K], x and y f32
// (host side in gemm.rs). Three kernels with one arithmetic: each y[m, n] is a single fma chain
// over k = 0 .. K-1 from zero, then the bias, so a row's result is the same whichever kernel
// ran it and whatever rows shared the call (batch invariance, as the CPU's GEMM).
//
// - gemm_*: GEMM_T x GEMM_T output tiles, x and W staged in local memory GEMM_T inputs at a time.
// - moe_gemm_*: the experts' grouped GEMM (host side in moe.rs): work-group row t takes tile t of
//   the routing's tile list (at most MOE_TILE_M grouped rows of one expert, moe.cl) and runs the
//   same GEMM tiles over them against that expert's W in the stacked [E, N, K] buffer, so an
//   expert's row gets exactly the result the dense GEMM would give it.
// - gemv_*: up to GEMV_ROWS rows (decode); a work-item per output column, W read once for all
//   rows: the group's GEMV_WG rows of W and the x rows staged in local memory GEMV_KC inputs at a
//   time, W loaded along k by consecutive work-items (coalesced), each column's chain over k in
//   order.

#ifndef GEMM_T
#define GEMM_T 16
#endif
#ifndef GEMV_WG
#define GEMV_WG 64
#endif
#ifndef GEMV_KC
#define GEMV_KC 64
#endif
#define GEMV_ROWS 4

#define LOAD_F32(p) (p)
#define LOAD_BF16(p) bf2f(p)

#define GEMM_KERNELS(SUFFIX, WT, LOADW)                                                                                         \
    /* The GEMM_T x GEMM_T tile of y at rows m0.., columns n0.. by the work-group (all reach each barrier). */                 \
    inline void gemm_tile_##SUFFIX(__global const float* x, __global const WT* w, __global const float* bias, int has_bias,     \
                                   __global float* y, int M, int N, int K, int m0, int n0,                                     \
                                   __local float xs[GEMM_T][GEMM_T + 1], __local float ws[GEMM_T][GEMM_T + 1]) {               \
        const int j = get_local_id(0), i = get_local_id(1);                                                                     \
        float acc = 0.f;                                                                                                        \
        for (int k0 = 0; k0 < K; k0 += GEMM_T) {                                                                                \
            const int k = k0 + j;                                                                                               \
            xs[i][j] = (m0 + i < M && k < K) ? x[(size_t)(m0 + i) * K + k] : 0.f;                                               \
            ws[i][j] = (n0 + i < N && k < K) ? LOADW(w[(size_t)(n0 + i) * K + k]) : 0.f;                                        \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                                       \
            const int kn = min(GEMM_T, K - k0);                                                                                 \
            for (int kk = 0; kk < kn; kk++) acc = fma(xs[i][kk], ws[j][kk], acc);                                               \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                                       \
        }                                                                                                                       \
        if (m0 + i < M && n0 + j < N) y[(size_t)(m0 + i) * N + n0 + j] = has_bias ? acc + bias[n0 + j] : acc;                   \
    }                                                                                                                           \
    __kernel __attribute__((reqd_work_group_size(GEMM_T, GEMM_T, 1)))                                                          \
    void gemm_##SUFFIX(__global const float* x, __global const WT* w, __global const float* bias, int has_bias,                \
                       __global float* y, int M, int N, int K) {                                                               \
        __local float xs[GEMM_T][GEMM_T + 1];                                                                                   \
        __local float ws[GEMM_T][GEMM_T + 1];                                                                                   \
        gemm_tile_##SUFFIX(x, w, bias, has_bias, y, M, N, K, get_group_id(1) * GEMM_T, get_group_id(0) * GEMM_T, xs, ws);       \
    }                                                                                                                           \
    __kernel __attribute__((reqd_work_group_size(GEMM_T, GEMM_T, 1)))                                                          \
    void moe_gemm_##SUFFIX(__global const float* x, __global const WT* w, __global const u32* tiles, __global float* y,        \
                           int N, int K) {                                                                                      \
        __local float xs[GEMM_T][GEMM_T + 1];                                                                                   \
        __local float ws[GEMM_T][GEMM_T + 1];                                                                                   \
        const u32 t = get_group_id(1);                                                                                          \
        if (t >= tiles[0]) return;                                                                                              \
        const u32 start = tiles[1 + 3 * t], rows = tiles[2 + 3 * t], e = tiles[3 + 3 * t];                                     \
        __global const float* xt = x + (size_t)start * K;                                                                       \
        __global const WT* we = w + (size_t)e * N * K;                                                                          \
        for (int m0 = 0; m0 < (int)rows; m0 += GEMM_T)                                                                          \
            gemm_tile_##SUFFIX(xt, we, x, 0, y + (size_t)start * N, rows, N, K, m0, get_group_id(0) * GEMM_T, xs, ws);          \
    }                                                                                                                           \
    __kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1)))                                                              \
    void gemv_##SUFFIX(__global const float* x, __global const WT* w, __global const float* bias, int has_bias,                \
                       __global float* y, int M, int N, int K) {                                                               \
        __local float xs[GEMV_ROWS * GEMV_KC];                                                                                  \
        __local float ws[GEMV_WG][GEMV_KC + 1];                                                                                 \
        const int lid = get_local_id(0), n0 = get_group_id(0) * GEMV_WG, n = n0 + lid;                                         \
        float acc[GEMV_ROWS];                                                                                                   \
        for (int r = 0; r < GEMV_ROWS; r++) acc[r] = 0.f;                                                                       \
        for (int k0 = 0; k0 < K; k0 += GEMV_KC) {                                                                               \
            const int kn = min(GEMV_KC, K - k0);                                                                                \
            for (int e = lid; e < M * GEMV_KC; e += GEMV_WG) {                                                                  \
                const int r = e / GEMV_KC, kk = e - r * GEMV_KC;                                                                \
                xs[e] = kk < kn ? x[(size_t)r * K + k0 + kk] : 0.f;                                                             \
            }                                                                                                                   \
            /* W rows of the group's columns, read along k by consecutive work-items */                                         \
            for (int c = 0; c < GEMV_WG; c++) {                                                                                 \
                const int row = min(n0 + c, N - 1);                                                                             \
                for (int kk = lid; kk < kn; kk += GEMV_WG) ws[c][kk] = LOADW(w[(size_t)row * K + k0 + kk]);                    \
            }                                                                                                                   \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                                       \
            for (int kk = 0; kk < kn; kk++) {                                                                                   \
                const float wv = ws[lid][kk];                                                                                   \
                for (int r = 0; r < GEMV_ROWS; r++)                                                                             \
                    if (r < M) acc[r] = fma(xs[r * GEMV_KC + kk], wv, acc[r]);                                                  \
            }                                                                                                                   \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                                       \
        }                                                                                                                       \
        if (n < N)                                                                                                              \
            for (int r = 0; r < M; r++) y[(size_t)r * N + n] = has_bias ? acc[r] + bias[n] : acc[r];                            \
    }

GEMM_KERNELS(f32, float, LOAD_F32)
GEMM_KERNELS(bf16, ushort, LOAD_BF16)
