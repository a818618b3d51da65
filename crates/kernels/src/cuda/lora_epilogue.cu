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

// SiLU(g)·u of 8 columns into out at element o (and its bf16 copy into outb, when given, at ob).
__device__ __forceinline__ void lep_silu_store8(const float* gv, const float* uv, float* __restrict__ out, bf16_t* __restrict__ outb, size_t o, size_t ob) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = silu_times(gv[e], uv[e]);
    lep_store8(out + o, v);
    if (outb) {
        store_bf16x4(outb + ob, make_float4(v[0], v[1], v[2], v[3]));
        store_bf16x4(outb + ob + 4, make_float4(v[4], v[5], v[6], v[7]));
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
extern "C" __global__ void __launch_bounds__(LEP_THREADS, LEP_MIN_BLOCKS) silu_mul_lora(const float* __restrict__ gu, float* __restrict__ out, bf16_t* __restrict__ outb, int inter, int ldb,
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
    lep_silu_store8(gv, uv, out, outb, (size_t)r * inter + i0, (size_t)r * ldb + i0);
}
