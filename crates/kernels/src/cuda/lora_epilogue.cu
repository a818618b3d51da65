// A LoRA site's expand inside the epilogue of its projection (lora_epilogue.rs). Appended after
// lora_rows.cu in the one NVRTC module (bf16x8_to_f32, store_bf16x4, silu_times and pdl_entry
// are in scope).
//
// qkv's and gate_up's shrink t = xn·Aᵀ is computed in the RMSNorm before them (lora_ahead.cu),
// so once cuBLAS has made the base output nothing stands between it and the delta but the
// epilogue that runs anyway (RoPE on qkv, SiLU·mul on gate_up). These kernels are those
// epilogues with the expand Σ_k s_j·t[j·r + k]·Bᵀ[slot][k][o] added to each column first: no
// launch of its own, no delta buffer, no side stream to fork and join. Each thread owns 8
// columns (16-byte Bᵀ loads, all of a slot's rank steps in flight): for RoPE 8 rotate pairs
// of a q / k head (16 columns) or 8 v columns, for SiLU·mul 8 gate columns and their 8 up
// columns. A row's blocks are along x, rows along y; every block scales the row's t once
// into shared memory.
//
// Row r's position p = G[1 + 4C + r] and slot G[1 + 5C + r] (lora.rs `pack_tiles`; base rows
// have neither); t is [C][n·R] by position as the norm wrote it.

#define LEP_THREADS 128
// Tuning constants an A/B may override without a rebuild (QUIVER_CUDA_NVRTC_DEFINES, module.rs):
// blocks per SM the registers are fitted to (__launch_bounds__), and Bᵀ rank steps in flight.
#ifndef LEP_MIN_BLOCKS
#define LEP_MIN_BLOCKS 1
#endif
#ifndef LEP_KG
#define LEP_KG 8
#endif
#define LEP_MAX_W 192 // n·r at most (3 slices of rank 64)
#define LEP_NONE 0xffffffffu

// Row r's scaled coefficients coef[j] = t_j · s_{slice of j} (j < n·rk); returns its rank (0 for
// a base row) and slot. Every thread of the block calls it (it ends with a barrier).
__device__ __forceinline__ int lep_coef(const float* __restrict__ t, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
                                        const float* __restrict__ scal, int n_slices, int W, int r, float* coef, u32* slot) {
    const u32 p = G[1 + 4 * C + r], s = G[1 + 5 * C + r];
    const int rk = (p == LEP_NONE || s == LEP_NONE) ? 0 : (int)ranks[s];
    for (int j = threadIdx.x; j < n_slices * rk; j += blockDim.x) coef[j] = t[(size_t)p * W + j] * scal[s * 3 + j / rk];
    __syncthreads();
    *slot = s;
    return rk;
}

// d[e] = Σ_k coef[k]·Bᵀ[k][o0 + e] over k < rk, for the 8 columns from o0 (b: the slot's Bᵀ).
__device__ __forceinline__ void lep_delta8(const bf16_t* __restrict__ b, int b_ld, int o0, const float* coef, int rk, float* d) {
#pragma unroll
    for (int e = 0; e < 8; ++e) d[e] = 0.f;
    for (int k0 = 0; k0 < rk; k0 += LEP_KG) {
        uint4 bq[LEP_KG];
#pragma unroll
        for (int i = 0; i < LEP_KG; ++i) bq[i] = k0 + i < rk ? __ldg(reinterpret_cast<const uint4*>(b + (size_t)(k0 + i) * b_ld + o0)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < LEP_KG; ++i) {
            if (k0 + i < rk) {
                float bf[8];
                bf16x8_to_f32(bq[i], bf);
                const float c = coef[k0 + i];
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] += c * bf[e];
            }
        }
    }
}

__device__ __forceinline__ void lep_load8(const float* p, float* v) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void lep_store8(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// SiLU(g)·u of 8 columns into out (and its bf16 copy outb, when given) at element o.
__device__ __forceinline__ void lep_silu_store8(const float* gv, const float* uv, float* __restrict__ out, bf16_t* __restrict__ outb, size_t o) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = silu_times(gv[e], uv[e]);
    lep_store8(out + o, v);
    if (outb) {
        store_bf16x4(outb + o, make_float4(v[0], v[1], v[2], v[3]));
        store_bf16x4(outb + o + 4, make_float4(v[4], v[5], v[6], v[7]));
    }
}

// RoPE of the 8 rotate pairs (x0[e], x1[e]) of half-dim index i0.. at position pos, stored at
// row + o0 / o1 (rope_qk's arithmetic exactly).
__device__ __forceinline__ void lep_rope_store8(float* row, int o0, int o1, const float* x0, const float* x1, const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t, int pos, int half, int i0) {
    float c[8], s[8], y0[8], y1[8];
    lep_load8(cos_t + (size_t)pos * half + i0, c);
    lep_load8(sin_t + (size_t)pos * half + i0, s);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        y0[e] = fmaf(x0[e], c[e], -(x1[e] * s[e]));
        y1[e] = fmaf(x1[e], c[e], x0[e] * s[e]);
    }
    lep_store8(row + o0, y0);
    lep_store8(row + o1, y1);
}

// Slice j of column o, times the rank: where its coefficients start.
__device__ __forceinline__ int lep_slice_at(int o, int off1, int off2, int rk) { return ((o >= off1) + (o >= off2)) * rk; }

// rope_qk (kernels.cu) with the delta: grid (units / LEP_THREADS, rows). half % 8 == 0, the v
// part of the row a multiple of 8 wide, b_ld % 8 == 0 (the host checks).
extern "C" __global__ void __launch_bounds__(LEP_THREADS, LEP_MIN_BLOCKS) rope_qk_lora(float* __restrict__ qkv, const u32* __restrict__ positions, const float* __restrict__ cos_t,
        const float* __restrict__ sin_t, int heads_qk, int head_dim, int half, int width, int max_pos, const float* __restrict__ t,
        const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal,
        int n_slices, int R, int b_ld, int off1, int off2) {
    __shared__ float coef[LEP_MAX_W];
    pdl_entry();
    const int r = blockIdx.y;
    u32 slot;
    const int rk = lep_coef(t, G, C, ranks, scal, n_slices, n_slices * R, r, coef, &slot);
    const int hp = half / 8, qk_units = heads_qk * hp;
    const int units = qk_units + (width - heads_qk * head_dim) / 8;
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units) return;
    float* row = qkv + (size_t)r * width;
    const bf16_t* b = Bt + (size_t)(rk ? slot : 0) * R * b_ld;
    if (u < qk_units) {
        const int h = u / hp, i0 = (u - h * hp) * 8;
        const int o0 = h * head_dim + i0, o1 = o0 + half;
        float x0[8], x1[8];
        lep_load8(row + o0, x0);
        lep_load8(row + o1, x1);
        if (rk) {
            float d0[8], d1[8];
            const int jr = lep_slice_at(o0, off1, off2, rk); // a head lies in one slice
            lep_delta8(b, b_ld, o0, coef + jr, rk, d0);
            lep_delta8(b, b_ld, o1, coef + jr, rk, d1);
#pragma unroll
            for (int e = 0; e < 8; ++e) x0[e] += d0[e], x1[e] += d1[e];
        }
        lep_rope_store8(row, o0, o1, x0, x1, cos_t, sin_t, min((int)positions[r], max_pos - 1), half, i0);
    } else if (rk) {
        const int o0 = heads_qk * head_dim + (u - qk_units) * 8;
        float x[8], d[8];
        lep_load8(row + o0, x);
        lep_delta8(b, b_ld, o0, coef + lep_slice_at(o0, off1, off2, rk), rk, d);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] += d[e];
        lep_store8(row + o0, x);
    }
}

// silu_mul (kernels.cu) with the delta of gate and up: grid (inter / 8 / LEP_THREADS, rows),
// inter % 8 == 0, b_ld % 8 == 0. outb (the down projection's bf16 input, or null) as silu_mul.
extern "C" __global__ void __launch_bounds__(LEP_THREADS, LEP_MIN_BLOCKS) silu_mul_lora(const float* __restrict__ gu, float* __restrict__ out, bf16_t* __restrict__ outb, int inter,
        const float* __restrict__ t, const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
        const float* __restrict__ scal, int n_slices, int R, int b_ld, int off1, int off2) {
    __shared__ float coef[LEP_MAX_W];
    pdl_entry();
    const int r = blockIdx.y;
    u32 slot;
    const int rk = lep_coef(t, G, C, ranks, scal, n_slices, n_slices * R, r, coef, &slot);
    const int i0 = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i0 >= inter) return;
    const float* g = gu + (size_t)r * 2 * inter;
    float gv[8], uv[8];
    lep_load8(g + i0, gv);
    lep_load8(g + inter + i0, uv);
    if (rk) {
        const bf16_t* b = Bt + (size_t)slot * R * b_ld;
        float dg[8], du[8];
        lep_delta8(b, b_ld, i0, coef + lep_slice_at(i0, off1, off2, rk), rk, dg);
        lep_delta8(b, b_ld, inter + i0, coef + lep_slice_at(inter + i0, off1, off2, rk), rk, du);
#pragma unroll
        for (int e = 0; e < 8; ++e) gv[e] += dg[e], uv[e] += du[e];
    }
    lep_silu_store8(gv, uv, out, outb, (size_t)r * inter + i0);
}

// ---- SiLU·mul with gate_up's expand over tiles of rows (opt-in, lora_epilogue.rs) ----
//
// silu_mul_lora above loads the slot's Bᵀ columns for every row (917 KB a row for the 8B shape's
// gate_up at rank 16), in dependent rounds of 8 rank steps, with few warps to hide them (session
// 25's ncu at 64 rows: 17 us, 25% occupancy, its warps waiting on L1TEX). Here a block takes
// LET_TR consecutive rows × LET_TC columns, one (row, 8-column unit) per thread as above, and
// stages the Bᵀ columns of the slot of its first adapter row in shared memory once: one round of
// loads for the block, issued with the rows' gate / up loads. Rows of that slot read Bᵀ from
// shared memory; rows of another slot load theirs as silu_mul_lora does. Each delta is the same
// sum in the same order (Σ_k from zero in rank order), so outputs are the per-row kernel's.
// grid (ceil(inter / LET_TC), ceil(m / LET_TR)), LEP_THREADS threads, dynamic shared memory
// 2 · R · LET_TC bf16. inter % 8 == 0, b_ld % 8 == 0 (the host checks).

#define LET_TC 128 // columns per block: 16 units of 8
#define LET_TR 8   // rows per block (LET_TR · LET_TC / 8 == LEP_THREADS)
#ifndef LET_KG
#define LET_KG 4   // staging loads a thread has in flight at once
#endif

// Stages `n` 16-byte chunks into shared memory, LET_KG loads in flight per thread: the block
// passed last sets `src` (null: zeros) and `dst` for chunk q.
#define LET_STAGE(n, ...)                                                                     \
    for (int q0 = threadIdx.x; q0 < (n); q0 += LET_KG * blockDim.x) {                        \
        uint4 sv[LET_KG];                                                                     \
        bf16_t* sd[LET_KG];                                                                   \
        _Pragma("unroll") for (int g = 0; g < LET_KG; ++g) {                                 \
            const int q = q0 + g * blockDim.x;                                                \
            const bf16_t* src = nullptr;                                                      \
            bf16_t* dst = nullptr;                                                            \
            if (q < (n)) __VA_ARGS__                                                          \
            sv[g] = src ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0); \
            sd[g] = dst;                                                                      \
        }                                                                                     \
        _Pragma("unroll") for (int g = 0; g < LET_KG; ++g) if (sd[g]) *reinterpret_cast<uint4*>(sd[g]) = sv[g]; \
    }

// Two deltas of 8 columns from staged Bᵀ chunks: d0[e] = Σ_k c0[k]·p0[k·stride + e] and d1 the
// same over p1 / c1, k < rk (the per-row kernels' sums, in their order).
__device__ __forceinline__ void let_delta8x2(const bf16_t* p0, const bf16_t* p1, size_t stride, const float* c0, const float* c1, int rk, float* d0,
                                             float* d1) {
#pragma unroll
    for (int e = 0; e < 8; ++e) d0[e] = 0.f, d1[e] = 0.f;
    for (int k = 0; k < rk; ++k) {
        float b0[8], b1[8];
        bf16x8_to_f32(*reinterpret_cast<const uint4*>(p0 + k * stride), b0);
        bf16x8_to_f32(*reinterpret_cast<const uint4*>(p1 + k * stride), b1);
        const float a0 = c0[k], a1 = c1[k];
#pragma unroll
        for (int e = 0; e < 8; ++e) d0[e] += a0 * b0[e], d1[e] += a1 * b1[e];
    }
}

// The block's rows r0.. (past m: none): their ranks (0 for base rows) and slots, every row's
// scaled coefficients coef[i][j] (lep_coef's), and the slot of the first adapter row, whose Bᵀ
// the block stages (LEP_NONE, rank 0 if none). Every thread calls it; it has a barrier, and the
// coefficients are read only after the caller's next one.
struct LetBlock {
    u32 slot;
    int rk;
};
__device__ __forceinline__ LetBlock let_rows(const float* __restrict__ t, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
                                             const float* __restrict__ scal, int n_slices, int W, int r0, int m, float (*coef)[LEP_MAX_W], int* rks, u32* slots) {
    if (threadIdx.x < LET_TR) {
        const int r = r0 + threadIdx.x;
        const u32 p = r < m ? G[1 + 4 * C + r] : LEP_NONE, s = r < m ? G[1 + 5 * C + r] : LEP_NONE;
        rks[threadIdx.x] = (p == LEP_NONE || s == LEP_NONE) ? 0 : (int)ranks[s];
        slots[threadIdx.x] = s;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < LET_TR * W; e += blockDim.x) {
        const int i = e / W, j = e % W, rk = rks[i];
        if (j < n_slices * rk) coef[i][j] = t[(size_t)G[1 + 4 * C + r0 + i] * W + j] * scal[slots[i] * 3 + j / rk];
    }
    int bi = 0;
    while (bi < LET_TR && !rks[bi]) ++bi;
    return bi < LET_TR ? LetBlock{slots[bi], rks[bi]} : LetBlock{LEP_NONE, 0};
}

extern "C" __global__ void __launch_bounds__(LEP_THREADS, LEP_MIN_BLOCKS) silu_mul_lora_tiled(const float* __restrict__ gu, float* __restrict__ out,
        bf16_t* __restrict__ outb, int inter, int m, const float* __restrict__ t, const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C,
        const u32* __restrict__ ranks, const float* __restrict__ scal, int n_slices, int R, int b_ld, int off1, int off2) {
    extern __shared__ __align__(16) unsigned char let_smem[];
    bf16_t* bs = reinterpret_cast<bf16_t*>(let_smem); // [slice][k][LET_TC]
    __shared__ float coef[LET_TR][LEP_MAX_W];
    __shared__ int rks[LET_TR];
    __shared__ u32 slots[LET_TR];
    pdl_entry();
    const int r0 = blockIdx.y * LET_TR, c0 = blockIdx.x * LET_TC;
    const LetBlock blk = let_rows(t, G, C, ranks, scal, n_slices, n_slices * R, r0, m, coef, rks, slots);
    const u32 bslot = blk.slot;
    const int brk = blk.rk;
    // The block slot's Bᵀ columns [c0, c0 + LET_TC) of the gate slice and of the up slice.
    // This thread's row loads first, then the staging: all in flight together.
    const int i = threadIdx.x / (LET_TC / 8), u = threadIdx.x % (LET_TC / 8);
    const int r = r0 + i, i0 = c0 + 8 * u;
    float gv[8], uv[8];
    const bool live = r < m && i0 < inter;
    if (live) {
        const float* g = gu + (size_t)r * 2 * inter;
        lep_load8(g + i0, gv);
        lep_load8(g + inter + i0, uv);
    }
    const int chunks = 2 * brk * (LET_TC / 8);
    LET_STAGE(chunks, {
        const int sl = q / (brk * (LET_TC / 8)), k = (q / (LET_TC / 8)) % brk, ch = q % (LET_TC / 8);
        src = c0 + ch * 8 < inter ? Bt + ((size_t)bslot * R + k) * b_ld + (sl ? inter : 0) + c0 + ch * 8 : nullptr;
        dst = bs + ((size_t)sl * R + k) * LET_TC + ch * 8;
    })
    __syncthreads();
    if (!live) return;
    const int rk = rks[i];
    if (rk) {
        float dg[8], du[8];
        const int jg = lep_slice_at(i0, off1, off2, rk), ju = lep_slice_at(inter + i0, off1, off2, rk);
        if (slots[i] == bslot) {
            let_delta8x2(bs + 8 * u, bs + (size_t)R * LET_TC + 8 * u, LET_TC, coef[i] + jg, coef[i] + ju, rk, dg, du);
        } else {
            const bf16_t* b = Bt + (size_t)slots[i] * R * b_ld;
            lep_delta8(b, b_ld, i0, coef[i] + jg, rk, dg);
            lep_delta8(b, b_ld, inter + i0, coef[i] + ju, rk, du);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) gv[e] += dg[e], uv[e] += du[e];
    }
    lep_silu_store8(gv, uv, out, outb, (size_t)r * inter + i0);
}

// rope_qk_lora over tiles of LET_TR rows × 16 units, as silu_mul_lora_tiled: a unit is what a
// rope_qk_lora thread owns (a q / k rotate pair's two 8-column chunks o0 and o1 = o0 + half, or
// 8 v columns), and the block stages the Bᵀ chunks of its 16 units for its first adapter row's
// slot, bs[k][unit][chunk][8]. grid (ceil(units / 16), ceil(m / LET_TR)), LEP_THREADS threads,
// dynamic shared memory R · 16 · 2 · 8 bf16; the host's conditions are rope_qk_lora's.
#define LET_UNITS 16 // units per block (LET_TR · LET_UNITS == LEP_THREADS)

// Columns of unit u: its first chunk's start, and the second's (-1 for a v unit).
__device__ __forceinline__ void let_rope_cols(int u, int qk_units, int hp, int head_dim, int half, int heads_qk, int* o0, int* o1) {
    if (u < qk_units) {
        const int h = u / hp;
        *o0 = h * head_dim + (u - h * hp) * 8;
        *o1 = *o0 + half;
    } else {
        *o0 = heads_qk * head_dim + (u - qk_units) * 8;
        *o1 = -1;
    }
}

extern "C" __global__ void __launch_bounds__(LEP_THREADS, LEP_MIN_BLOCKS) rope_qk_lora_tiled(float* __restrict__ qkv, const u32* __restrict__ positions,
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, int heads_qk, int head_dim, int half, int width, int max_pos, int m,
        const float* __restrict__ t, const bf16_t* __restrict__ Bt, const u32* __restrict__ G, int C, const u32* __restrict__ ranks,
        const float* __restrict__ scal, int n_slices, int R, int b_ld, int off1, int off2) {
    extern __shared__ __align__(16) unsigned char let_smem[];
    bf16_t* bs = reinterpret_cast<bf16_t*>(let_smem); // [k][LET_UNITS][2][8]
    __shared__ float coef[LET_TR][LEP_MAX_W];
    __shared__ int rks[LET_TR];
    __shared__ u32 slots[LET_TR];
    pdl_entry();
    const int r0 = blockIdx.y * LET_TR, ub = blockIdx.x * LET_UNITS;
    const int hp = half / 8, qk_units = heads_qk * hp;
    const int units = qk_units + (width - heads_qk * head_dim) / 8;
    const LetBlock blk = let_rows(t, G, C, ranks, scal, n_slices, n_slices * R, r0, m, coef, rks, slots);
    // This thread's row loads first, then the staging: all in flight together.
    const int i = threadIdx.x / LET_UNITS, ul = threadIdx.x % LET_UNITS;
    const int r = r0 + i, u = ub + ul;
    const bool live = r < m && u < units;
    int o0 = 0, o1 = -1;
    float x0[8], x1[8] = {};
    float* row = qkv + (size_t)r * width;
    if (live) {
        let_rope_cols(u, qk_units, hp, head_dim, half, heads_qk, &o0, &o1);
        lep_load8(row + o0, x0);
        if (o1 >= 0) lep_load8(row + o1, x1);
    }
    LET_STAGE(blk.rk * LET_UNITS * 2, {
        const int k = q / (LET_UNITS * 2), sul = (q / 2) % LET_UNITS, c = q % 2, su = ub + sul;
        int s0 = -1, s1 = -1;
        if (su < units) let_rope_cols(su, qk_units, hp, head_dim, half, heads_qk, &s0, &s1);
        const int col = c ? s1 : s0;
        src = col >= 0 ? Bt + ((size_t)blk.slot * R + k) * b_ld + col : nullptr;
        dst = bs + (((size_t)k * LET_UNITS + sul) * 2 + c) * 8;
    })
    __syncthreads();
    if (!live) return;
    const int rk = rks[i];
    if (rk) {
        // A head lies in one slice, and so do a unit's v columns.
        const float* cf = coef[i] + lep_slice_at(o0, off1, off2, rk);
        float d0[8], d1[8] = {};
        if (slots[i] == blk.slot) {
            let_delta8x2(bs + ul * 16, bs + ul * 16 + 8, LET_UNITS * 16, cf, cf, rk, d0, d1);
        } else {
            const bf16_t* b = Bt + (size_t)slots[i] * R * b_ld;
            lep_delta8(b, b_ld, o0, cf, rk, d0);
            if (o1 >= 0) lep_delta8(b, b_ld, o1, cf, rk, d1);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) x0[e] += d0[e], x1[e] += d1[e];
    }
    if (o1 < 0) {
        if (rk) lep_store8(row + o0, x0); // v columns change only by the delta
        return;
    }
    lep_rope_store8(row, o0, o1, x0, x1, cos_t, sin_t, min((int)positions[r], max_pos - 1), half, o0 % head_dim);
}
