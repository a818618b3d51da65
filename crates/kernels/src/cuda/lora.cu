// LoRA kernels (`Device::lora_apply` on CUDA; host side in lora.rs). Appended to kernels.cu by
// NVRTC (one module), so the bf16 helpers, pdl_entry() and the mma / ldmatrix helpers of the
// prefill attention above are in scope.
//
// Rows are read and written in place through the packed groups staged with the batch
// (quiver_kernels::lora::pack_tiles): G[0] = tiles, perm = G + 1, and for tile i at G + 1 + C·k
// (k = 1 start, 2 length, 3 slot), C the grouping's row capacity, a tile at most LORA_TILE rows
// of one slot. A grid over all C tiles (what a recorded step launches) finds the unused ones
// empty, so a graph stays right whatever adapters the rows use and however many groups there
// are (unlike a grid baked to the recorded count).
//
// Pool layout (lora.rs docs): A (S, n·R, in) bf16, slice j of a rank-r site at rows [j·r, j·r+r);
// Bᵀ (S, R, b_ld) bf16; ranks [slot] u32 and scalings [slot][3] f32 of this site's table entry.
// Every kernel contracts over exactly the slot's rank r, so mixed ranks cost what their ranks do.
//
// The shrink writes t = x·Aᵀ, unscaled, as [C][n·R] f32 (region 0 of its scratch; split-k
// partials go to regions 1.. and the last block of each group adds them in a fixed order); the
// expand scales per slice and adds into the base output.

#define LORA_TILE 64   // most rows per tile (lora.rs: TILE_ROWS)
#define LORA_SUB 16    // expand: rows whose coefficients sit in shared memory at a time
#define LORA_KC 8      // expand: rank steps of Bᵀ held in registers at a time

__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float dot8(const float* a, float4 u, float4 v) {
    return a[0] * u.x + a[1] * u.y + a[2] * u.z + a[3] * u.w + a[4] * v.x + a[5] * v.y + a[6] * v.z + a[7] * v.w;
}

// How many of the grid's gridDim.z k-splits a shrink uses for this step, and the inputs per split
// (a multiple of `align`): enough splits that the step's tiles × column groups × splits reach
// `target` blocks (the host passes twice the SM count), never more than the grid has. It depends
// on the step's tile count, read from device memory like every kernel's view of the step, so a
// recorded step picks the split for the adapters it is replayed with: one adapter's rows (few
// tiles) spread over many splits, many adapters' (many tiles) over few.
__device__ __forceinline__ int2 lora_splits(int tiles, int in_dim, int target, int align) {
    const int groups = max(1, tiles * (int)gridDim.y);
    const int want = min((int)gridDim.z, max(1, (target + groups - 1) / groups));
    const int klen = ((in_dim + want - 1) / want + align - 1) / align * align;
    return make_int2(klen, (in_dim + klen - 1) / klen);
}

// Split-k fix-up: called by every thread of a block once it has written its partial sums of
// rows p0..p0+n, columns [c_lo, c_hi) for split blockIdx.z into region 1 + z of t. The last of the
// `splits` blocks of this (tile, column group) to arrive adds the partials in split order into
// region 0 (so the sum never depends on which block came last) and resets the counter for the
// next launch (a recorded step replays this kernel).
__device__ __forceinline__ void lora_fixup(float* t, u32* counter, int splits, size_t CW, int p0, int n, int c_lo, int c_hi, int W) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (u32)splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int w = c_hi - c_lo;
    for (int e = threadIdx.x; e < n * w; e += blockDim.x) {
        const size_t at = (size_t)(p0 + e / w) * W + c_lo + e % w;
        float v = 0.f;
        for (int z = 0; z < splits; ++z) v += __ldcg(t + (size_t)(1 + z) * CW + at);
        t[at] = v;
    }
    if (threadIdx.x == 0) *counter = 0;
}

// Small shrink (steps of fewer than 64 rows: decode): t[p][c] = x[perm[p]] · A[slot][c] for the
// rows p of tile blockIdx.x and the A rows c = blockIdx.y·8 + warp < n·r, over the inputs of
// split blockIdx.z (lora_splits). grid (tiles, ceil(n·R / 8), most splits), 256 threads: a warp holds
// one A row's 16-byte vectors (8 inputs a lane), and the k-splits spread even one row's A over
// ~100 blocks, so the adapter streams from every SM instead of a few. Partial sums go through
// lora_fixup (counters[tile · gridDim.y + blockIdx.y]) when there are several splits.
extern "C" __global__ void __launch_bounds__(256) lora_shrink(const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                              const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int target,
                                                              float* __restrict__ t, u32* __restrict__ counters) {
    pdl_entry();
    const int tile = blockIdx.x;
    if (tile >= (int)G[0]) return;
    const int2 sp = (in_dim & 7) == 0 ? lora_splits(G[0], in_dim, target, 256) : make_int2(in_dim, 1);
    const int klen = sp.x, splits = sp.y;
    if ((int)blockIdx.z >= splits) return;
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int nr = n_slices * ranks[slot], W = n_slices * R;
    const int c0 = blockIdx.y * 8;
    if (n == 0 || c0 >= nr) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = c0 + warp;
    const int k0 = blockIdx.z * klen, k1 = min(in_dim, k0 + klen);
    float* part = splits == 1 ? t : t + (size_t)(1 + blockIdx.z) * C * W;
    if (c < nr) {
        const bf16_t* a = A + ((size_t)slot * W + c) * in_dim;
        for (int rs = 0; rs < n; rs += 16) {
            const int nx = min(16, n - rs);
            const float* xr[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) xr[i] = x + (size_t)perm[p0 + rs + min(i, nx - 1)] * in_dim;
            float acc[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[i] = 0.f;
            if ((in_dim & 7) == 0) {
                for (int k = k0 + lane * 8; k < k1; k += 256) {
                    float af[8];
                    bf16x8_to_f32(*reinterpret_cast<const uint4*>(a + k), af);
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        if (i < nx) {
                            const float4 u = *reinterpret_cast<const float4*>(xr[i] + k);
                            const float4 v = *reinterpret_cast<const float4*>(xr[i] + k + 4);
                            acc[i] += dot8(af, u, v);
                        }
                    }
                }
            } else {
                for (int k = k0 + lane; k < k1; k += 32) {
                    const float av = bf2f(a[k]);
#pragma unroll
                    for (int i = 0; i < 16; ++i)
                        if (i < nx) acc[i] += av * xr[i][k];
                }
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (i < nx) {
                    const float v = warp_sum(acc[i]);
                    if (lane == 0) part[(size_t)(p0 + rs + i) * W + c] = v;
                }
            }
        }
    }
    if (splits > 1) lora_fixup(t, counters + tile * gridDim.y + blockIdx.y, splits, (size_t)C * W, p0, n, c0, min(c0 + 8, nr), W);
}

// Tensor-core shrink (steps of 64 rows or more; in % 64 == 0): the tile's ≤ 64 rows × 32 A rows
// per block on mma.sync m16n8k16 (x rounded to bf16 as it is staged, A bf16, f32 accumulators),
// the inputs [z·klen, (z+1)·klen) of split z = blockIdx.z (lora_splits) in stages of 64, so each x
// row is read once per 32 A rows instead of once per A row. grid (tiles, ceil(n·R / 32), most
// splits), 128 threads; partial sums through lora_fixup.
#define LSM_BN 32
#define LSM_KC 64
#define LSM_LD (LSM_KC + 8) // bf16 row stride: 16 bytes of padding keep ldmatrix conflict-free
extern "C" __global__ void __launch_bounds__(128) lora_shrink_mma(const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                                  const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int target,
                                                                  float* __restrict__ t, u32* __restrict__ counters) {
    __shared__ __align__(16) bf16_t xs[LORA_TILE * LSM_LD];
    __shared__ __align__(16) bf16_t as[LSM_BN * LSM_LD];
    pdl_entry();
    const int tile = blockIdx.x;
    if (tile >= (int)G[0]) return;
    const int2 sp = lora_splits(G[0], in_dim, target, LSM_KC);
    const int klen = sp.x, splits = sp.y;
    if ((int)blockIdx.z >= splits) return;
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int nr = n_slices * ranks[slot], W = n_slices * R;
    const int c0 = blockIdx.y * LSM_BN;
    if (n == 0 || c0 >= nr) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int k0 = blockIdx.z * klen, k1 = min(in_dim, k0 + klen);
    const bf16_t* a0 = A + ((size_t)slot * W + c0) * in_dim;
    float acc[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[q][e] = 0.f;
    for (int kb = k0; kb < k1; kb += LSM_KC) {
        // x: 64 rows × 64 inputs as bf16 (rows past the tile are zero).
#pragma unroll
        for (int it = 0; it < LORA_TILE * LSM_KC / 4 / 128; ++it) {
            const int i = it * 128 + tid, row = i >> 4, kk = (i & 15) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row < n) v = *reinterpret_cast<const float4*>(x + (size_t)perm[p0 + row] * in_dim + kb + kk);
            *reinterpret_cast<uint2*>(&xs[row * LSM_LD + kk]) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
        }
        // A: 32 rows × 64 inputs (rows past this slot's n·r are zero).
#pragma unroll
        for (int it = 0; it < LSM_BN * LSM_KC / 8 / 128; ++it) {
            const int i = it * 128 + tid, row = i >> 3, kk = (i & 7) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (c0 + row < nr) v = *reinterpret_cast<const uint4*>(a0 + (size_t)row * in_dim + kb + kk);
            *reinterpret_cast<uint4*>(&as[row * LSM_LD + kk]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < LSM_KC / 16; ++ks) {
            u32 af[4];
            ldsm_x4(af, &xs[(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LSM_LD + ks * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int nb = 0; nb < 2; ++nb) {
                u32 bf[4];
                ldsm_x4(bf, &as[(nb * 16 + (lane & 7) + (lane >> 4) * 8) * LSM_LD + ks * 16 + ((lane >> 3) & 1) * 8]);
                mma_bf16(acc[2 * nb], af, bf[0], bf[1]);
                mma_bf16(acc[2 * nb + 1], af, bf[2], bf[3]);
            }
        }
        __syncthreads();
    }
    const int g = lane >> 2, q2 = (lane & 3) * 2;
    float* out = (splits == 1 ? t : t + (size_t)(1 + blockIdx.z) * C * W) + (size_t)p0 * W;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const int col = c0 + nt * 8 + q2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + g + h * 8;
            if (row < n) {
                if (col < nr) out[(size_t)row * W + col] = acc[nt][2 * h];
                if (col + 1 < nr) out[(size_t)row * W + col + 1] = acc[nt][2 * h + 1];
            }
        }
    }
    if (splits > 1) lora_fixup(t, counters + tile * gridDim.y + blockIdx.y, splits, (size_t)C * W, p0, n, c0, min(c0 + LSM_BN, nr), W);
}

// The embedding's shrink: t[p][k] = A[slot][k][id] with id = ids[perm[p]] (A is (S, R, vocab),
// PEFT's lora_embedding_A); ids outside the vocabulary get no delta. grid (tiles), 256 threads.
extern "C" __global__ void lora_shrink_ids(const u32* __restrict__ ids, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                           const u32* __restrict__ ranks, int R, int vocab, float* __restrict__ t) {
    pdl_entry();
    const int tile = blockIdx.x;
    if (tile >= (int)G[0]) return;
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int r = ranks[slot];
    for (int e = threadIdx.x; e < n * r; e += blockDim.x) {
        const int i = e / r, k = e % r;
        const u32 id = ids[perm[p0 + i]];
        t[(size_t)(p0 + i) * R + k] = id < (u32)vocab ? bf2f(A[((size_t)slot * R + k) * vocab + id]) : 0.f;
    }
}

// Expand with the per-slice scaling and the residual add fused:
// y[perm[p]][o] += s_j · Σ_{k<r} t[p][j·r + k] · Bᵀ[slot][k][o], j the slice of column o
// (boundaries off1, off2; pass out for slices that do not exist), t the shrink's final sums.
// grid (tiles, ceil(out / 256)), 256 threads: a lane owns 8 consecutive columns (16-byte Bᵀ
// loads, a warp's y rows 1 KiB contiguous), the 8 warps own rows w, w + 8 of each group of
// LORA_SUB rows, whose scaled coefficients sit in shared memory (LORA_SUB × n·R floats, dynamic).
// Bᵀ is held in registers LORA_KC rank steps at a time and serves every row of the tile.
extern "C" __global__ void __launch_bounds__(256, 2) lora_expand(const float* __restrict__ t, const bf16_t* __restrict__ B, const u32* __restrict__ G, int C,
                                                              const u32* __restrict__ ranks, const float* __restrict__ scal, int n_slices, int R, int b_ld,
                                                              int off1, int off2, int out, float* __restrict__ y) {
    extern __shared__ float coef[];
    pdl_entry();
    const int tile = blockIdx.x;
    if (tile >= (int)G[0]) return;
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int r = ranks[slot];
    if (n == 0 || r == 0) return;
    const int W = n_slices * R, nr = n_slices * r;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o0 = (blockIdx.y * 32 + lane) * 8;
    const bf16_t* b = B + (size_t)slot * R * b_ld;
    int jr[8];  // j·r of each of this lane's columns
#pragma unroll
    for (int e = 0; e < 8; ++e) jr[e] = ((o0 + e >= off1) + (o0 + e >= off2)) * r;
    const bool vec = (out & 7) == 0 && (b_ld & 7) == 0;
    for (int s0 = 0; s0 < n; s0 += LORA_SUB) {
        const int ns = min(LORA_SUB, n - s0);
        __syncthreads();  // the previous group's coefficients are no longer read
        for (int e = threadIdx.x; e < ns * nr; e += blockDim.x) {
            const int i = e / nr, c = e % nr;
            coef[i * W + c] = t[(size_t)(p0 + s0 + i) * W + c] * scal[slot * 3 + c / r];
        }
        __syncthreads();
        if (o0 >= out) continue;
        const int i0 = warp, i1 = warp + 8;  // this warp's rows of the group
        if (i0 >= ns) continue;
        const bool two = i1 < ns;
        float* y0 = y + (size_t)perm[p0 + s0 + i0] * out + o0;
        float* y1 = y + (size_t)perm[p0 + s0 + (two ? i1 : i0)] * out + o0;
        if (vec) {
            // Both rows' outputs are loaded before either is stored (no aliasing stall), once
            // for all rank steps.
            float a0[8], a1[8];
            {
                const float4 u0 = *reinterpret_cast<const float4*>(y0), v0 = *reinterpret_cast<const float4*>(y0 + 4);
                const float4 u1 = *reinterpret_cast<const float4*>(y1), v1 = *reinterpret_cast<const float4*>(y1 + 4);
                a0[0] = u0.x; a0[1] = u0.y; a0[2] = u0.z; a0[3] = u0.w; a0[4] = v0.x; a0[5] = v0.y; a0[6] = v0.z; a0[7] = v0.w;
                a1[0] = u1.x; a1[1] = u1.y; a1[2] = u1.z; a1[3] = u1.w; a1[4] = v1.x; a1[5] = v1.y; a1[6] = v1.z; a1[7] = v1.w;
            }
            const float* c0p = coef + i0 * W;
            const float* c1p = coef + (two ? i1 : i0) * W;
            for (int kc = 0; kc < r; kc += LORA_KC) {
                const int kn = min(LORA_KC, r - kc);
                uint4 bq[LORA_KC];
#pragma unroll
                for (int q = 0; q < LORA_KC; ++q)
                    if (q < kn) bq[q] = *reinterpret_cast<const uint4*>(b + (size_t)(kc + q) * b_ld + o0);
#pragma unroll
                for (int q = 0; q < LORA_KC; ++q) {
                    if (q < kn) {
                        float bf[8];
                        bf16x8_to_f32(bq[q], bf);
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            a0[e] += c0p[jr[e] + kc + q] * bf[e];
                            a1[e] += c1p[jr[e] + kc + q] * bf[e];
                        }
                    }
                }
            }
            *reinterpret_cast<float4*>(y0) = make_float4(a0[0], a0[1], a0[2], a0[3]);
            *reinterpret_cast<float4*>(y0 + 4) = make_float4(a0[4], a0[5], a0[6], a0[7]);
            if (two) {
                *reinterpret_cast<float4*>(y1) = make_float4(a1[0], a1[1], a1[2], a1[3]);
                *reinterpret_cast<float4*>(y1 + 4) = make_float4(a1[4], a1[5], a1[6], a1[7]);
            }
        } else {
            // Any width: one column at a time.
            for (int e = 0; e < 8 && o0 + e < out; ++e) {
                const int o = o0 + e;
                for (int i = i0; i < ns; i += 8) {
                    const float* ci = coef + i * W + jr[e];
                    float acc = 0.f;
                    for (int k = 0; k < r; ++k) acc += ci[k] * bf2f(b[(size_t)k * b_ld + o]);
                    y[(size_t)perm[p0 + s0 + i] * out + o] += acc;
                }
            }
        }
    }
}
