// The GEMVs of decode steps (gemm.rs): a small-M GEMV and the single-row GEMV whose epilogues
// fuse SiLU·mul, RoPE and a LoRA site's shrink and expand. Appended after kernels.cu in the one
// NVRTC module (module.rs KERNELS_SRC): its bf16 helpers, warp_sum, pdl_entry, silu_times and norm4
// are in scope.

// ---- small-M GEMV: y[m, n] = x[m, :] · W[n, :] (+ bias[n]) for M ≤ 8 rows, bf16 W, any k ---------
// (Both GEMVs read W's rows `ldw ≥ k` elements apart: a weight may keep room beside its rows.)
// Decode is bandwidth-bound on W: one warp per output column streams its W row once with 16-byte
// loads and applies it to all M input rows (f32, read through the cache), so W is read once per
// step whatever M is. Each (m, n) accumulates in the same order for every M, so a row's result
// does not depend on which other rows share the step.
template <int M>
__device__ __forceinline__ void gemv_bf16_impl(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,
                                               float* __restrict__ y, int n, int k, int ldw) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= n) return;
    const bf16_t* wr = w + (size_t)row * ldw;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    if ((k & 7) == 0) {
        const uint4* w4 = reinterpret_cast<const uint4*>(wr);
        int k8 = k >> 3;
#pragma unroll 4
        for (int i = lane; i < k8; i += 32) {
            uint4 p = __ldg(w4 + i);
            float wv[8] = {__uint_as_float(p.x << 16), __uint_as_float(p.x & 0xffff0000u), __uint_as_float(p.y << 16), __uint_as_float(p.y & 0xffff0000u),
                           __uint_as_float(p.z << 16), __uint_as_float(p.z & 0xffff0000u), __uint_as_float(p.w << 16), __uint_as_float(p.w & 0xffff0000u)};
#pragma unroll
            for (int m = 0; m < M; m++) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)m * k) + 2 * i;
                float4 a = xr[0], b = xr[1];
                acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
            }
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            float wv = bf2f(wr[i]);
#pragma unroll
            for (int m = 0; m < M; m++) acc[m] += wv * x[(size_t)m * k + i];
        }
    }
    float b = bias ? bias[row] : 0.f;
#pragma unroll
    for (int m = 0; m < M; m++) {
        float s = warp_sum(acc[m]);
        if (lane == m) y[(size_t)m * n + row] = s + b;
    }
}

#define GEMV(M) \
    extern "C" __global__ void gemv_bf16_##M(const float* x, const bf16_t* w, const float* bias, float* y, int n, int k, int ldw) { pdl_entry(); gemv_bf16_impl<M>(x, w, bias, y, n, k, ldw); }
GEMV(1) // the fallback for k % 8 != 0 (gemv1_bf16 below handles the rest)


// ---- single-row GEMV for decode -----------------------------------------------------------------
// y[n] = x · W[n, :]ᵀ (+ bias[n]) for one f32 row x and bf16 W, k % 8 == 0. Batch-1 decode streams
// every weight once per step, so this kernel is the step's bound. Each warp owns GV_ROWS rows and
// streams them through its own GV_STAGES-deep ring in shared memory with cp.async (16 bytes per
// lane, L1 bypassed): GV_STAGES - 1 stages stay in flight while one is consumed. (Loads into
// registers let ptxas sink them next to their FMAs, leaving only ~3 in flight per lane.) Each lane
// reads back only the slots it copied itself, so the ring needs no barrier. x (f32) is read
// through L1, shared by all warps of the SM.
#define GV_ROWS 2
#define GV_U 2
#define GV_STAGES 4
#define GV_WARPS 4

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float dot8(uint4 p, float4 a, float4 b, float acc) {
    acc = fmaf(__uint_as_float(p.x << 16), a.x, acc);
    acc = fmaf(__uint_as_float(p.x & 0xffff0000u), a.y, acc);
    acc = fmaf(__uint_as_float(p.y << 16), a.z, acc);
    acc = fmaf(__uint_as_float(p.y & 0xffff0000u), a.w, acc);
    acc = fmaf(__uint_as_float(p.z << 16), b.x, acc);
    acc = fmaf(__uint_as_float(p.z & 0xffff0000u), b.y, acc);
    acc = fmaf(__uint_as_float(p.w << 16), b.z, acc);
    acc = fmaf(__uint_as_float(p.w & 0xffff0000u), b.w, acc);
    return acc;
}

// What a warp does with its two dot products. Each saves a whole kernel (and the round trip of
// its input through memory) on the latency-bound chain of a batch-1 decode step:
// - GV_PLAIN: rows 2p and 2p + 1 of y.
// - GV_SILU: rows p and inter + p of a fused [gate; up] weight; y[p] = silu(gate) · up, as silu_mul.
// - GV_ROPE: over a fused qkv weight, the rotate-half pair (i, i + half) of a q or k head, rotated
//   at the row's position exactly as rope_qk does; v rows in consecutive pairs as GV_PLAIN.
#define GV_PLAIN 0
#define GV_SILU 1
#define GV_ROPE 2
struct GemvEpilogue {
    int inter;        // GV_SILU: half the weight's rows
    int heads_qk;     // GV_ROPE: q + k heads
    int head_dim;     // GV_ROPE
    int max_pos;      // GV_ROPE: rows of the cos / sin tables
    const u32* pos;   // GV_ROPE: the row's position
    const float* cos_t;
    const float* sin_t;
};

template <int MODE>
__device__ __forceinline__ void gemv_rows(const GemvEpilogue& e, int p, int n, int& r0, int& r1, bool& live) {
    if (MODE == GV_SILU) {
        r0 = p, r1 = e.inter + p, live = p < e.inter;
    } else if (MODE == GV_ROPE && p < e.heads_qk * (e.head_dim >> 1)) {
        const int half = e.head_dim >> 1, h = p / half, i = p - h * half;
        r0 = h * e.head_dim + i, r1 = r0 + half, live = true;
    } else {
        const int v0 = MODE == GV_ROPE ? e.heads_qk * e.head_dim + 2 * (p - e.heads_qk * (e.head_dim >> 1)) : 2 * p;
        r0 = v0, r1 = v0 + 1, live = v0 < n;
    }
    r0 = min(r0, n - 1), r1 = min(r1, n - 1); // a dead warp still holds valid addresses
}

// A LoRA delta folded into the single-row GEMV (`Device::matmul_lora` at one row), shrink and
// expand both, so the site is one launch and the shrink's latency hides behind the weight stream.
// The shrink t = x·Aᵀ of the row is cut into pieces (gy groups of 8 A rows × `splits` runs of kc
// inputs). Each block takes a ticket when it starts; the first P = gy·splits tickets each compute
// one piece (their split partial sums, scratch regions 1..) before streaming their weight rows,
// and the block that finishes the last piece adds the partials in split order into region 0 and
// raises the ready flag. Each warp, once its two dot products are done, waits for the flag and
// adds s_j · Σ_k t[j·r + k] · Bᵀ[slot][k][col] to its columns before the epilogue, so RoPE /
// SiLU·mul stay fused. Tickets go out in the order blocks start, so every piece belongs to a
// block already running that waits on nothing before finishing it: no deadlock whatever the
// grid (the host keeps P ≤ blocks). The last block to leave zeroes the counters for the next
// launch (a recorded step replays this kernel). The sums do not depend on which block computed
// which piece. Which slot (if any) and its rank are data: a recorded step replays for any
// adapter, and a base row skips all of it. With `ahead` the RMSNorm before computed t already
// (lora_ahead.cu): no tickets, no pieces, no flag; the epilogue reads t at once.
struct GemvLora {
    float* t;          // scratch: region 0 the final t (n·r), region 1 + z split z's partials (W = n·R)
    const bf16_t* A;   // (S, n·R, k)
    const bf16_t* B;   // Bᵀ (S, R, b_ld)
    const u32* G;      // packed groups of the one row
    const u32* ranks;  // [slot]
    const float* scal; // [slot][3]
    u32* ctr;          // [ticket, pieces done, t ready, blocks left], zero between launches
    int C, n_slices, R, b_ld, off1, off2, gy, splits, kc;
    int ahead;         // t is already in region 0 (computed ahead, lora_ahead.cu): no pieces, no waiting
};

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The ticket and, for the first P tickets, one piece of the shrink (every thread of the block).
__device__ __forceinline__ void gemv_lora_piece(const float* __restrict__ x, int k, const GemvLora& L, int slot, int nr) {
    __shared__ int ticket;
    __shared__ bool last;
    if (threadIdx.x == 0) ticket = (int)atomicAdd(L.ctr, 1u);
    __syncthreads();
    const int P = L.gy * L.splits, i = ticket;
    if (i >= P) return;
    const int W = L.n_slices * L.R, cy = i % L.gy, z = i / L.gy;
    const int lane = threadIdx.x & 31, c = cy * 8 + (threadIdx.x >> 5) * 2;
    const int k0 = z * L.kc, k1 = min(k, k0 + L.kc);
    if (c < nr) {
        const bool two = c + 1 < nr;
        const uint4* a0 = reinterpret_cast<const uint4*>(L.A + ((size_t)slot * W + c) * k);
        const uint4* a1 = reinterpret_cast<const uint4*>(L.A + ((size_t)slot * W + c + (two ? 1 : 0)) * k);
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float acc0 = 0.f, acc1 = 0.f;
        for (int kb = (k0 >> 3) + lane; kb < (k1 >> 3); kb += 32) {
            const uint4 u = __ldg(a0 + kb), v = __ldg(a1 + kb);
            const float4 xa = __ldg(x4 + 2 * kb), xb = __ldg(x4 + 2 * kb + 1);
            acc0 = dot8(u, xa, xb, acc0);
            acc1 = dot8(v, xa, xb, acc1);
        }
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
            L.t[(size_t)(1 + z) * W + c] = acc0;
            if (two) L.t[(size_t)(1 + z) * W + c + 1] = acc1;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(L.ctr + 1, 1u) == (u32)P - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < nr; e += blockDim.x) {
        float v = 0.f;
        for (int zz = 0; zz < L.splits; ++zz) v += __ldcg(L.t + (size_t)(1 + zz) * W + e);
        L.t[e] = v;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicExch(L.ctr + 2, 1u);
}

template <int MODE, bool LORA>
__device__ __forceinline__ void gemv1_body(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,
                                           float* __restrict__ y, int n, int k, int ldw, const GemvEpilogue& e, const GemvLora& L) {
    __shared__ uint4 ring[GV_WARPS][GV_STAGES][GV_ROWS][GV_U][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Without LoRA a warp computes one pair of outputs. With it the grid is at most what fits
    // on the GPU at once (lora.rs) and each warp loops over pairs, so the LoRA work each block
    // does once (its ticket, waiting for t, leaving) is paid once per block, not once per
    // 64 KiB of weights: with a block per pair it cost ~25% of the weight stream's rate.
    int p = blockIdx.x * GV_WARPS + warp;
    int rows[GV_ROWS];
    bool live;
    gemv_rows<MODE>(e, p, n, rows[0], rows[1], live);
    if (!LORA && !live) return;
    const int k8 = k >> 3;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint4* wr[GV_ROWS];
    const int per = 32 * GV_U; // 16-byte chunks of a row per stage
    const int stages = k8 / per;
    auto issue = [&](int s) {
        if (s < stages) {
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++)
#pragma unroll
                for (int u = 0; u < GV_U; u++) cp_async16(&ring[warp][s % GV_STAGES][r][u][lane], wr[r] + s * per + u * 32 + lane);
        }
        cp_async_commit(); // empty groups keep the count uniform
    };
    auto start = [&]() {
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) wr[r] = reinterpret_cast<const uint4*>(w + (size_t)rows[r] * ldw);
#pragma unroll
        for (int s = 0; s < GV_STAGES - 1; s++) issue(s);
    };
    // W is never written by a kernel: the first pair's first stages are requested before
    // waiting for the kernel that produced x.
    if (live) start();
    pdl_entry();
    // LoRA: the row's slot and rank (the same for the whole grid), then this block's ticket.
    int slot = 0, rk = 0;
    if (LORA) {
        if (L.G[0] > 0) slot = L.G[1 + 3 * L.C], rk = L.ranks[slot];
        if (rk > 0 && !L.ahead) gemv_lora_piece(x, k, L, slot, L.n_slices * rk);
    }
    // t of each slice at this lane's rank steps, loaded once the first pair needs it (or at
    // once when the norm computed it ahead: then the loads overlap the weight stream).
    float tv[3][2];
    bool have_t = false;
    if (LORA && rk > 0 && L.ahead) {
#pragma unroll
        for (int j = 0; j < 3; j++)
#pragma unroll
            for (int q = 0; q < 2; q++) tv[j][q] = j < L.n_slices && lane + 32 * q < rk ? __ldcg(L.t + j * rk + lane + 32 * q) : 0.f;
        have_t = true;
    }
    while (live) {
        // The expand's operands that no kernel writes (Bᵀ of this warp's two columns, a rank
        // step per lane, and their slices' scalings) load now, so only t is left for the tail.
        float bl[GV_ROWS][2], sc[GV_ROWS];
        int js[GV_ROWS];
        if (LORA && rk > 0) {
            const bf16_t* b = L.B + (size_t)slot * L.R * L.b_ld;
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                const int o = rows[r];
                js[r] = (o >= L.off1) + (o >= L.off2);
                sc[r] = L.scal[slot * 3 + js[r]];
#pragma unroll
                for (int q = 0; q < 2; q++) bl[r][q] = lane + 32 * q < rk ? bf2f(b[(size_t)(lane + 32 * q) * L.b_ld + o]) : 0.f;
            }
        }
        float acc[GV_ROWS];
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) acc[r] = 0.f;
        for (int s = 0; s < stages; s++) {
            issue(s + GV_STAGES - 1);
            cp_async_wait<GV_STAGES - 1>();
#pragma unroll
            for (int u = 0; u < GV_U; u++) {
                const int i = s * per + u * 32 + lane;
                const float4 a = __ldg(x4 + 2 * i), b = __ldg(x4 + 2 * i + 1);
#pragma unroll
                for (int r = 0; r < GV_ROWS; r++) acc[r] = dot8(ring[warp][s % GV_STAGES][r][u][lane], a, b, acc[r]);
            }
        }
        for (int i = stages * per + lane; i < k8; i += 32) {
            const float4 a = __ldg(x4 + 2 * i), b = __ldg(x4 + 2 * i + 1);
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) acc[r] = dot8(__ldg(wr[r] + i), a, b, acc[r]);
        }
        // This pair's outputs; the next pair's first stages are requested before its tail.
        const int pc = p, r0 = rows[0], r1 = rows[1];
        if (LORA) {
            p += gridDim.x * GV_WARPS;
            gemv_rows<MODE>(e, p, n, rows[0], rows[1], live);
            if (live) start();
        } else {
            live = false;
        }
        const int cur[GV_ROWS] = {r0, r1};
        float v[GV_ROWS];
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) v[r] = warp_sum(acc[r]) + (bias ? bias[cur[r]] : 0.f);
        if (LORA && rk > 0) {
            if (!have_t) {
                // Every lane acquires the flag itself (one coalesced load), so its reads of t
                // below are ordered after the reducer's writes.
                while (!L.ahead && ld_acquire(L.ctr + 2) == 0u) {
                }
#pragma unroll
                for (int j = 0; j < 3; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) tv[j][q] = j < L.n_slices && lane + 32 * q < rk ? __ldcg(L.t + j * rk + lane + 32 * q) : 0.f;
                have_t = true;
            }
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                float d = 0.f;
#pragma unroll
                for (int q = 0; q < 2; q++) d += bl[r][q] * (js[r] == 0 ? tv[0][q] : js[r] == 1 ? tv[1][q] : tv[2][q]);
                v[r] += sc[r] * warp_sum(d);
            }
        }
        if (lane == 0) {
            if (MODE == GV_SILU) {
                y[pc] = silu_times(v[0], v[1]);
            } else if (MODE == GV_ROPE && pc < e.heads_qk * (e.head_dim >> 1)) {
                const int half = e.head_dim >> 1, i = pc - (pc / half) * half;
                const int pos = min((int)e.pos[0], e.max_pos - 1);
                const float c = e.cos_t[(size_t)pos * half + i], sn = e.sin_t[(size_t)pos * half + i];
                y[r0] = v[0] * c - v[1] * sn;
                y[r1] = v[1] * c + v[0] * sn;
            } else {
                y[r0] = v[0];
                if (r1 > r0) y[r1] = v[1];
            }
        }
    }
    // The last block to leave zeroes the counters for the next launch.
    if (LORA && rk > 0 && !L.ahead) {
        __syncthreads();
        if (threadIdx.x == 0 && atomicAdd(L.ctr + 3, 1u) == gridDim.x - 1) L.ctr[0] = 0, L.ctr[1] = 0, L.ctr[2] = 0, L.ctr[3] = 0;
    }
}

#define GEMV1_KERNEL(NAME, MODE)                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                                                              \
        NAME(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y, int n, int k, \
             int ldw, int inter_or_heads_qk, int head_dim, int max_pos,                                                                      \
             const u32* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t) {                                \
        const GemvEpilogue e = {inter_or_heads_qk, inter_or_heads_qk, head_dim, max_pos, pos, cos_t, sin_t};                                 \
        const GemvLora L = {};                                                                                                                \
        gemv1_body<MODE, false>(x, w, bias, y, n, k, ldw, e, L);                                                                              \
    }
GEMV1_KERNEL(gemv1_bf16, GV_PLAIN)
GEMV1_KERNEL(gemv1_silu_bf16, GV_SILU)
GEMV1_KERNEL(gemv1_rope_bf16, GV_ROPE)

#define GEMV1_LORA_KERNEL(NAME, MODE)                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                                                              \
        NAME(const float* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y, int n, int k, \
             int ldw, int inter_or_heads_qk, int head_dim, int max_pos,                                                                      \
             const u32* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t,                                  \
             float* lt, const bf16_t* lA, const bf16_t* lB, const u32* lG, const u32* lranks, const float* lscal, u32* lctr,                 \
             int lC, int ln_slices, int lR, int lb_ld, int loff1, int loff2, int lgy, int lsplits, int lkc, int lahead) {                    \
        const GemvEpilogue e = {inter_or_heads_qk, inter_or_heads_qk, head_dim, max_pos, pos, cos_t, sin_t};                                 \
        const GemvLora L = {lt, lA, lB, lG, lranks, lscal, lctr, lC, ln_slices, lR, lb_ld, loff1, loff2, lgy, lsplits, lkc, lahead};         \
        gemv1_body<MODE, true>(x, w, bias, y, n, k, ldw, e, L);                                                                              \
    }
GEMV1_LORA_KERNEL(gemv1_lora_bf16, GV_PLAIN)
GEMV1_LORA_KERNEL(gemv1_lora_silu_bf16, GV_SILU)
GEMV1_LORA_KERNEL(gemv1_lora_rope_bf16, GV_ROPE)
