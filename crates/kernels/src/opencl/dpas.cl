// DPAS kernels (Intel XMX units, cl_intel_subgroup_matrix_multiply_accumulate) for the bf16
// weight GEMM (dense, and the experts' grouped GEMM of MoE layers), compiled for one subgroup
// width SG (16: PVC, Xe2; 8: DG2 / Arc A-series / Flex); host side in gemm.rs and moe.rs.
// Compiled only for a DPAS kernel set; every other op stays portable.
//
// y[m, n] = x[m, :] · W[n, :] (+ bias[n]): a subgroup owns DPAS_MT tiles of 8 rows and DPAS_NT
// tiles of SG columns, K in steps of 16. The matrix operands per the extension:
// - B (16 k × SG n): lane n holds 8 ints, int j packing W[n][k0 + 2j] (low half) and
//   W[n][k0 + 2j + 1]: a row-major bf16 W row is already this VNNI layout, one 32-byte load.
// - A (8 rows × 16 k) of x, rounded to bf16 as a hi + lo pair (hi = bf16(x), lo = bf16(x − hi),
//   about 16 mantissa bits of the f32 activations; two DPAS per step): SG = 16, lane i holds
//   A[m][i] (a short per row); SG = 8, lane i holds A[m][2i], A[m][2i + 1] (an int per row).
// - acc (8 rows × SG): lane n holds C[m][n], m = 0..7.
// Each y element's sum runs over k in the same order whatever rows share the tile (rows past M
// are zero), so a row's result does not depend on its batch.
//
// DPAS_EMULATE = 1 replaces the builtin by a software version with the extension's reference
// semantics (operands gathered across the subgroup with shuffles, products added in k order),
// for runtimes without the matrix extension (Intel's CPU runtime in the tests).

#pragma OPENCL EXTENSION cl_intel_subgroups : enable

#ifndef DPAS_MT
#define DPAS_MT 2
#endif
#ifndef DPAS_NT
#define DPAS_NT 2
#endif

#if SG == 16
typedef short8 dpas_a;
#else
typedef int8 dpas_a;
#endif

#if DPAS_EMULATE
inline float8 dpas_bf16_k16(dpas_a a, int8 b, float8 acc) {
    float r[8];
    vstore8(acc, 0, r);
    uint bv[8];
    vstore8(as_uint8(b), 0, bv);
#if SG == 16
    ushort av[8];
    vstore8(as_ushort8(a), 0, av);
#else
    uint av[8];
    vstore8(as_uint8(a), 0, av);
#endif
    for (int m = 0; m < 8; m++) {
        for (int j = 0; j < 8; j++) {
#if SG == 16
            const float a0 = bf2f((ushort)intel_sub_group_shuffle((uint)av[m], 2 * j));
            const float a1 = bf2f((ushort)intel_sub_group_shuffle((uint)av[m], 2 * j + 1));
#else
            const uint pa = intel_sub_group_shuffle(av[m], j);
            const float a0 = bf2f((ushort)(pa & 0xffffu)), a1 = bf2f((ushort)(pa >> 16));
#endif
            r[m] = fma(a0, bf2f((ushort)(bv[j] & 0xffffu)), r[m]);
            r[m] = fma(a1, bf2f((ushort)(bv[j] >> 16)), r[m]);
        }
    }
    return vload8(0, r);
}
#else
#pragma OPENCL EXTENSION cl_intel_subgroup_matrix_multiply_accumulate : enable
#ifndef cl_intel_subgroup_matrix_multiply_accumulate
// A compiler whose device list does not announce the extension (the offline compiler of the
// codegen gate) still implements the builtin: declare the two forms used here.
float8 __attribute__((overloadable)) intel_sub_group_bf16_bf16_matrix_mad_k16(short8 a, int8 b, float8 acc);
float8 __attribute__((overloadable)) intel_sub_group_bf16_bf16_matrix_mad_k16(int8 a, int8 b, float8 acc);
#endif
#define dpas_bf16_k16(a, b, acc) intel_sub_group_bf16_bf16_matrix_mad_k16(a, b, acc)
#endif

// The A operands (hi and lo) of rows row0 .. row0 + 7 of x at inputs k0 .. k0 + 15.
inline void load_a(__global const float* x, int row0, int M, int K, int k0, int lane, dpas_a* hi, dpas_a* lo) {
#if SG == 16
    ushort h[8], l[8];
    for (int m = 0; m < 8; m++) {
        const float v = row0 + m < M ? x[(size_t)(row0 + m) * K + k0 + lane] : 0.f;
        h[m] = f2bf(v);
        l[m] = f2bf(v - bf2f(h[m]));
    }
    *hi = as_short8(vload8(0, h));
    *lo = as_short8(vload8(0, l));
#else
    uint h[8], l[8];
    for (int m = 0; m < 8; m++) {
        float v0 = 0.f, v1 = 0.f;
        if (row0 + m < M) {
            v0 = x[(size_t)(row0 + m) * K + k0 + 2 * lane];
            v1 = x[(size_t)(row0 + m) * K + k0 + 2 * lane + 1];
        }
        const ushort h0 = f2bf(v0), h1 = f2bf(v1);
        h[m] = (uint)h0 | ((uint)h1 << 16);
        l[m] = (uint)f2bf(v0 - bf2f(h0)) | ((uint)f2bf(v1 - bf2f(h1)) << 16);
    }
    *hi = as_int8(vload8(0, h));
    *lo = as_int8(vload8(0, l));
#endif
}

// The subgroup's DPAS_MT row tiles from m0 and DPAS_NT column tiles from n0 of y.
inline void dpas_gemm_tile(__global const float* x, __global const ushort* w, __global const float* bias, int has_bias,
                           __global float* y, int M, int N, int K, int m0, int n0) {
    const int lane = get_sub_group_local_id();
    float8 acc[DPAS_MT][DPAS_NT];
    for (int mt = 0; mt < DPAS_MT; mt++)
        for (int t = 0; t < DPAS_NT; t++) acc[mt][t] = (float8)(0.f);
    for (int k0 = 0; k0 < K; k0 += 16) {
        int8 b[DPAS_NT];
        for (int t = 0; t < DPAS_NT; t++) {
            const int n = min(n0 + t * SG + lane, N - 1);
            b[t] = as_int8(vload8(0, (__global const uint*)(w + (size_t)n * K + k0)));
        }
        for (int mt = 0; mt < DPAS_MT; mt++) {
            if (m0 + mt * 8 >= M) break;
            dpas_a hi, lo;
            load_a(x, m0 + mt * 8, M, K, k0, lane, &hi, &lo);
            for (int t = 0; t < DPAS_NT; t++) {
                acc[mt][t] = dpas_bf16_k16(hi, b[t], acc[mt][t]);
                acc[mt][t] = dpas_bf16_k16(lo, b[t], acc[mt][t]);
            }
        }
    }
    for (int mt = 0; mt < DPAS_MT; mt++) {
        for (int t = 0; t < DPAS_NT; t++) {
            const int n = n0 + t * SG + lane;
            float r[8];
            vstore8(acc[mt][t], 0, r);
            if (n >= N) continue;
            const float bv = has_bias ? bias[n] : 0.f;
            for (int m = 0; m < 8; m++) {
                const int row = m0 + mt * 8 + m;
                if (row < M) y[(size_t)row * N + n] = has_bias ? r[m] + bv : r[m];
            }
        }
    }
}

__attribute__((intel_reqd_sub_group_size(SG)))
__kernel __attribute__((reqd_work_group_size(SG, 1, 1)))
void dpas_gemm_bf16(__global const float* x, __global const ushort* w, __global const float* bias, int has_bias,
                    __global float* y, int M, int N, int K) {
    dpas_gemm_tile(x, w, bias, has_bias, y, M, N, K, get_group_id(1) * 8 * DPAS_MT, get_group_id(0) * SG * DPAS_NT);
}

// The experts' grouped GEMM (host side in moe.rs; tile list as in moe.cl): subgroup (column
// block, tile) runs the dense kernel's tiles over the tile's rows against its expert's W in the
// stacked [E, N, K] buffer, DPAS_MT·8 rows at a time.
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel __attribute__((reqd_work_group_size(SG, 1, 1)))
void dpas_moe_gemm_bf16(__global const float* x, __global const ushort* w, __global const u32* tiles, __global float* y, int N, int K) {
    const u32 t = get_group_id(1);
    if (t >= tiles[0]) return;
    const u32 start = tiles[1 + 3 * t], rows = tiles[2 + 3 * t], e = tiles[3 + 3 * t];
    __global const float* xt = x + (size_t)start * K;
    __global const ushort* we = w + (size_t)e * N * K;
    for (int m0 = 0; m0 < (int)rows; m0 += 8 * DPAS_MT)
        dpas_gemm_tile(xt, we, x, 0, y + (size_t)start * N, rows, N, K, m0, get_group_id(0) * SG * DPAS_NT);
}

// ---- LoRA on DPAS (host side in lora.rs; layouts and packed tiles as in lora.cl) -------------
// The pool is f32, so both operands go in as bf16 hi + lo pairs and each step takes three DPAS
// (hi·hi, hi·lo, lo·hi: "bf16x3", about f32 accuracy; the fourth product is below f32's
// rounding). A subgroup owns one tile of at most 16 rows (two row tiles of 8) and SG columns.

#define LT(G, C, k, i) ((int)(G)[1 + (k) * (C) + (i)])

// hi and lo bf16 halves of two floats, packed low / high as the DPAS B operand wants.
inline void split2(float v0, float v1, uint* hi, uint* lo) {
    const ushort h0 = f2bf(v0), h1 = f2bf(v1);
    *hi = (uint)h0 | ((uint)h1 << 16);
    *lo = (uint)f2bf(v0 - bf2f(h0)) | ((uint)f2bf(v1 - bf2f(h1)) << 16);
}

// The A operand (hi, lo) of 8 rows at 16 contraction steps: `val(m, k)` for row m < rows, else 0.
#define LOAD_A_ROWS(val, rows, lane, hi, lo)                                                        \
    do {                                                                                            \
        uint h_[8], l_[8];                                                                          \
        for (int m = 0; m < 8; m++) {                                                               \
            float v0 = 0.f, v1 = 0.f;                                                               \
            if (m < (rows)) {                                                                       \
                if (SG == 16) v0 = val(m, lane);                                                    \
                else { v0 = val(m, 2 * (lane)); v1 = val(m, 2 * (lane) + 1); }                      \
            }                                                                                       \
            if (SG == 16) {                                                                         \
                const ushort hh = f2bf(v0);                                                         \
                h_[m] = hh;                                                                         \
                l_[m] = f2bf(v0 - bf2f(hh));                                                        \
            } else {                                                                                \
                split2(v0, v1, &h_[m], &l_[m]);                                                     \
            }                                                                                       \
        }                                                                                           \
        hi = AS_DPAS_A(vload8(0, h_));                                                              \
        lo = AS_DPAS_A(vload8(0, l_));                                                              \
    } while (0)
#if SG == 16
#define AS_DPAS_A(v) as_short8(convert_ushort8(v))
#else
#define AS_DPAS_A(v) as_int8(v)
#endif

inline float8 dpas3(dpas_a ahi, dpas_a alo, int8 bhi, int8 blo, float8 acc) {
    acc = dpas_bf16_k16(ahi, bhi, acc);
    acc = dpas_bf16_k16(ahi, blo, acc);
    return dpas_bf16_k16(alo, bhi, acc);
}

// t[p][c] = x[perm[p]] · A[slot][c] for c < n·r (in_dim % 16 == 0). Subgroup (column tile, tile).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel __attribute__((reqd_work_group_size(SG, 1, 1)))
void dpas_lora_shrink(__global const float* x, __global const float* A, __global const u32* meta, int g_off, int C,
                      __global const u32* table, int ranks_off, int n_slices, int R, int in_dim, __global float* t) {
    const int lane = get_sub_group_local_id(), c0 = get_group_id(0) * SG, tile = get_group_id(1);
    __global const u32* G = meta + g_off;
    if (tile >= (int)G[0]) return;
    const int p0 = LT(G, C, 1, tile), n = LT(G, C, 2, tile), slot = LT(G, C, 3, tile);
    const int W = n_slices * R, nr = n_slices * (int)table[ranks_off + slot];
    if (c0 >= nr) return;
    __global const float* a = A + ((size_t)slot * W + min(c0 + lane, nr - 1)) * in_dim;
    __global const u32* perm = G + 1;
    float8 acc0 = (float8)(0.f), acc1 = (float8)(0.f);
    for (int k0 = 0; k0 < in_dim; k0 += 16) {
        uint bh[8], bl[8];
        for (int j = 0; j < 8; j++) split2(a[k0 + 2 * j], a[k0 + 2 * j + 1], &bh[j], &bl[j]);
        const int8 bhi = as_int8(vload8(0, bh)), blo = as_int8(vload8(0, bl));
        dpas_a hi, lo;
#define XV0(m, k) x[(size_t)perm[p0 + (m)] * in_dim + k0 + (k)]
        LOAD_A_ROWS(XV0, n, lane, hi, lo);
        acc0 = dpas3(hi, lo, bhi, blo, acc0);
        if (n > 8) {
#define XV1(m, k) x[(size_t)perm[p0 + 8 + (m)] * in_dim + k0 + (k)]
            LOAD_A_ROWS(XV1, n - 8, lane, hi, lo);
            acc1 = dpas3(hi, lo, bhi, blo, acc1);
        }
    }
    const int c = c0 + lane;
    if (c >= nr) return;
    float r0[8], r1[8];
    vstore8(acc0, 0, r0);
    vstore8(acc1, 0, r1);
    for (int m = 0; m < min(n, 16); m++) t[(size_t)(p0 + m) * W + c] = m < 8 ? r0[m] : r1[m - 8];
}

// y[perm[p]][o] += s_j · Σ_{k<r} t[p][j·r + k] · Bᵀ[slot][k][o], j the slice of column o. The
// contraction runs over r padded to 16 (steps past r are zero on both sides); a column tile that
// straddles a slice boundary runs once per slice it touches, the other slice's lanes zero in B.
// Subgroup (column tile, tile).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel __attribute__((reqd_work_group_size(SG, 1, 1)))
void dpas_lora_expand(__global const float* t, __global const float* B, __global const u32* meta, int g_off, int C,
                      __global const u32* table, int ranks_off, int scal_off, int n_slices, int R, int b_ld,
                      int off1, int off2, int out, __global float* y) {
    const int lane = get_sub_group_local_id(), o0 = get_group_id(0) * SG, tile = get_group_id(1);
    __global const u32* G = meta + g_off;
    if (tile >= (int)G[0]) return;
    const int p0 = LT(G, C, 1, tile), n = LT(G, C, 2, tile), slot = LT(G, C, 3, tile);
    const int r = (int)table[ranks_off + slot];
    if (r == 0) return;
    const int o = o0 + lane, oc = min(o, out - 1);
    const int jl = (oc >= off1) + (oc >= off2); // this lane's slice
    const int j_first = (o0 >= off1) + (o0 >= off2), j_last = (min(o0 + SG, out) - 1 >= off1) + (min(o0 + SG, out) - 1 >= off2);
    const int W = n_slices * R;
    __global const u32* perm = G + 1;
    __global const float* b = B + (size_t)slot * R * b_ld + oc;
    float d0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, d1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = j_first; j <= j_last; j++) {
        float8 acc0 = (float8)(0.f), acc1 = (float8)(0.f);
        const bool mine = jl == j && o < out;
        for (int k0 = 0; k0 < r; k0 += 16) {
            uint bh[8], bl[8];
            for (int q = 0; q < 8; q++) {
                const int k = k0 + 2 * q;
                const float v0 = mine && k < r ? b[(size_t)k * b_ld] : 0.f;
                const float v1 = mine && k + 1 < r ? b[(size_t)(k + 1) * b_ld] : 0.f;
                split2(v0, v1, &bh[q], &bl[q]);
            }
            const int8 bhi = as_int8(vload8(0, bh)), blo = as_int8(vload8(0, bl));
            dpas_a hi, lo;
#define TV0(m, k) (k0 + (k) < r ? t[(size_t)(p0 + (m)) * W + j * r + k0 + (k)] : 0.f)
            LOAD_A_ROWS(TV0, n, lane, hi, lo);
            acc0 = dpas3(hi, lo, bhi, blo, acc0);
            if (n > 8) {
#define TV1(m, k) (k0 + (k) < r ? t[(size_t)(p0 + 8 + (m)) * W + j * r + k0 + (k)] : 0.f)
                LOAD_A_ROWS(TV1, n - 8, lane, hi, lo);
                acc1 = dpas3(hi, lo, bhi, blo, acc1);
            }
        }
        const float s = mine ? as_float(table[scal_off + slot * 3 + j]) : 0.f;
        float r0[8], r1[8];
        vstore8(acc0, 0, r0);
        vstore8(acc1, 0, r1);
        for (int m = 0; m < 8; m++) {
            d0[m] += s * r0[m];
            d1[m] += s * r1[m];
        }
    }
    if (o >= out) return;
    for (int m = 0; m < min(n, 16); m++) y[(size_t)perm[p0 + m] * out + o] += m < 8 ? d0[m] : d1[m - 8];
}
