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
#define LORA_KC 16     // expand: rank steps of Bᵀ held in registers at a time
#define LORA_SHRINK_BLOCKS 264 // small shrink: blocks a step aims for (2 of 8 warps per SM)

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

// Split-k fix-up: called by every thread of a block once it has written its partial sums of
// rows p0..p0+n, columns [c_lo, c_hi) for its split z into region 1 + z of t. The last of the
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
// rows p of one tile and the A rows c = cy·8 + warp < n·r, over the inputs of split z (klen
// each), one such piece at a time (the kernel below loops over them), 256 threads: a warp holds
// one A row's 16-byte vectors (8 inputs a lane), and the k-splits spread even one row's A over
// ~100 blocks, so the adapter streams from every SM instead of a few. Partial sums go through
// lora_fixup (counters[tile · gy + cy]) when there are several splits.
#define LSH_ROWS 4 // x rows a warp dots with its A vectors at a time
#define LSH_KU 4   // 256-input sweeps whose A vectors a lane loads at once
__device__ __forceinline__ void lora_shrink_tile(int tile, int cy, int z, int gy, int splits, const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                              const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int klen,
                                                              float* __restrict__ t, u32* __restrict__ counters) {
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int nr = n_slices * ranks[slot], W = n_slices * R;
    const int c0 = cy * 8;
    if (n == 0 || c0 >= nr) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = c0 + warp;
    const int k0 = z * klen, k1 = min(in_dim, k0 + klen);
    float* part = splits == 1 ? t : t + (size_t)(1 + z) * C * W;
    if (c < nr) {
        const bf16_t* a = A + ((size_t)slot * W + c) * in_dim;
        for (int rs = 0; rs < n; rs += LSH_ROWS) {
            const int nx = min(LSH_ROWS, n - rs);
            const float* xr[LSH_ROWS];
#pragma unroll
            for (int i = 0; i < LSH_ROWS; ++i) xr[i] = x + (size_t)perm[p0 + rs + min(i, nx - 1)] * in_dim;
            float acc[LSH_ROWS];
#pragma unroll
            for (int i = 0; i < LSH_ROWS; ++i) acc[i] = 0.f;
            if ((in_dim & 7) == 0) {
                // LSH_KU sweeps at a time, their A vectors loaded together before any is used,
                // so a warp's merged splits cost one memory latency per LSH_KU sweeps, not one
                // per sweep.
                for (int kb = k0 + lane * 8; kb < k1; kb += 256 * LSH_KU) {
                    uint4 av[LSH_KU];
#pragma unroll
                    for (int u = 0; u < LSH_KU; ++u) av[u] = kb + u * 256 < k1 ? *reinterpret_cast<const uint4*>(a + kb + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int u = 0; u < LSH_KU; ++u) {
                        const int k = kb + u * 256;
                        if (k >= k1) break;
                        float af[8];
                        bf16x8_to_f32(av[u], af);
#pragma unroll
                        for (int i = 0; i < LSH_ROWS; ++i) {
                            if (i < nx) {
                                const float4 xu = *reinterpret_cast<const float4*>(xr[i] + k);
                                const float4 xv = *reinterpret_cast<const float4*>(xr[i] + k + 4);
                                acc[i] += dot8(af, xu, xv);
                            }
                        }
                    }
                }
            } else {
                for (int k = k0 + lane; k < k1; k += 32) {
                    const float av = bf2f(a[k]);
#pragma unroll
                    for (int i = 0; i < LSH_ROWS; ++i)
                        if (i < nx) acc[i] += av * xr[i][k];
                }
            }
#pragma unroll
            for (int i = 0; i < LSH_ROWS; ++i) {
                if (i < nx) {
                    const float v = warp_sum(acc[i]);
                    if (lane == 0) part[(size_t)(p0 + rs + i) * W + c] = v;
                }
            }
        }
    }
    if (splits > 1) lora_fixup(t, counters + tile * gy + cy, splits, (size_t)C * W, p0, n, c0, min(c0 + 8, nr), W);
}

extern "C" __global__ void __launch_bounds__(256, 2) lora_shrink(const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                              const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int klen,
                                                              int gy, int max_splits, float* __restrict__ t, u32* __restrict__ counters) {
    pdl_entry();
    // The split adapts to the step's tiles (G[0], the same for every block, so a recorded step
    // adapts when replayed): just enough splits for ~LORA_SHRINK_BLOCKS pieces, each reading
    // whole 256-input sweeps. One adapter's row keeps all 16 splits (its A streams from ~100
    // SMs); 16 adapters' rows take 3, so a warp reads 6 vectors a lane instead of one and the
    // fix-up sums 3 partials, not 16.
    const int tiles = G[0];
    int splits = max_splits;
    if (splits > 1) {
        const int groups = max(1, tiles * gy);
        splits = min(splits, max(1, (LORA_SHRINK_BLOCKS + groups - 1) / groups));
        klen = ((in_dim + splits - 1) / splits + 255) / 256 * 256;
        splits = (in_dim + klen - 1) / klen;
    }
    // Pieces (tile, group of 8 A rows, split), splits of one group on consecutive blocks; the
    // grid is at most one wave (lora.rs), each block looping over pieces: a grid of every
    // possible piece of a recorded step was mostly blocks that exit at once, and dispatching
    // them cost more than the work.
    const int total = tiles * gy * splits;
    for (int it = blockIdx.x; it < total; it += gridDim.x) {
        const int rest = it / splits;
        lora_shrink_tile(rest / gy, rest % gy, it % splits, gy, splits, x, A, G, C, ranks, n_slices, R, in_dim, klen, t, counters);
    }
}

// Tensor-core shrink (steps of 64 rows or more; in % 64 == 0): the tile's ≤ 64 rows × 32 A rows
// per block on mma.sync m16n8k16 (x rounded to bf16 as it is staged, A bf16, f32 accumulators),
// the inputs [z·klen, (z+1)·klen) of split z in stages of 64, so each x row is read
// once per 32 A rows instead of once per A row; pieces (tile, 32 A rows, split), 128 threads;
// partial sums through lora_fixup.
#define LSM_BN 32
#define LSM_KC 64
#define LSM_LD (LSM_KC + 8) // bf16 row stride: 16 bytes of padding keep ldmatrix conflict-free
__device__ __forceinline__ void lora_shrink_mma_tile(int tile, int cy, int z, int gy, int splits, const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                                  const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int klen,
                                                                  float* __restrict__ t, u32* __restrict__ counters) {
    __shared__ __align__(16) bf16_t xs[LORA_TILE * LSM_LD];
    __shared__ __align__(16) bf16_t as[LSM_BN * LSM_LD];
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int nr = n_slices * ranks[slot], W = n_slices * R;
    const int c0 = cy * LSM_BN;
    if (n == 0 || c0 >= nr) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int k0 = z * klen, k1 = min(in_dim, k0 + klen);
    const bf16_t* a0 = A + ((size_t)slot * W + c0) * in_dim;
    float* part = (splits == 1 ? t : t + (size_t)(1 + z) * C * W) + (size_t)p0 * W;
    if (n <= 4) {
        // A tile of a few rows (decode rows of many adapters): staging 64 rows for the tensor
        // cores would wait on shared memory for one real row. Instead a warp dots its 8 A rows
        // with the ≤ 4 x rows straight from global memory: 8 independent 16-byte A loads a lane
        // in flight, A still read once.
        const int cw = c0 + warp * 8;
        if (cw < nr) {
            float acc[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
            for (int k = k0 + lane * 8; k < k1; k += 256) {
                float4 xu[4], xv[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float* xr = x + (size_t)perm[p0 + min(i, n - 1)] * in_dim + k;
                    xu[i] = *reinterpret_cast<const float4*>(xr);
                    xv[i] = *reinterpret_cast<const float4*>(xr + 4);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cw + j < nr) {
                        float af[8];
                        bf16x8_to_f32(*reinterpret_cast<const uint4*>(a0 + (size_t)(warp * 8 + j) * in_dim + k), af);
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[j][i] += dot8(af, xu[i], xv[i]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float v = warp_sum(acc[j][i]);
                    if (lane == 0 && i < n && cw + j < nr) part[(size_t)i * W + cw + j] = v;
                }
            }
        }
        if (splits > 1) lora_fixup(t, counters + tile * gy + cy, splits, (size_t)C * W, p0, n, c0, min(c0 + LSM_BN, nr), W);
        return;
    }
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
    float* out = part;
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
    if (splits > 1) lora_fixup(t, counters + tile * gy + cy, splits, (size_t)C * W, p0, n, c0, min(c0 + LSM_BN, nr), W);
}

extern "C" __global__ void __launch_bounds__(128) lora_shrink_mma(const float* __restrict__ x, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                                                  const u32* __restrict__ ranks, int n_slices, int R, int in_dim, int klen,
                                                                  int gy, int splits, float* __restrict__ t, u32* __restrict__ counters) {
    pdl_entry();
    // Pieces (tile, group of 32 A rows, split) over a grid of at most one wave, as lora_shrink.
    // The shared staging is reused piece after piece: the barrier at the end of each stage
    // loop orders the last reads before the next piece's writes.
    const int total = (int)G[0] * gy * splits;
    for (int it = blockIdx.x; it < total; it += gridDim.x) {
        const int rest = it / splits;
        lora_shrink_mma_tile(rest / gy, rest % gy, it % splits, gy, splits, x, A, G, C, ranks, n_slices, R, in_dim, klen, t, counters);
    }
}

// The embedding's shrink: t[p][k] = A[slot][k][id] with id = ids[perm[p]] (A is (S, R, vocab),
// PEFT's lora_embedding_A); ids outside the vocabulary get no delta. grid (tiles), 256 threads.
__device__ __forceinline__ void lora_shrink_ids_tile(int tile, const u32* __restrict__ ids, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                           const u32* __restrict__ ranks, int R, int vocab, float* __restrict__ t) {
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int r = ranks[slot];
    for (int e = threadIdx.x; e < n * r; e += blockDim.x) {
        const int i = e / r, k = e % r;
        const u32 id = ids[perm[p0 + i]];
        t[(size_t)(p0 + i) * R + k] = id < (u32)vocab ? bf2f(A[((size_t)slot * R + k) * vocab + id]) : 0.f;
    }
}

extern "C" __global__ void lora_shrink_ids(const u32* __restrict__ ids, const bf16_t* __restrict__ A, const u32* __restrict__ G, int C,
                                           const u32* __restrict__ ranks, int R, int vocab, float* __restrict__ t) {
    pdl_entry();
    for (int tile = blockIdx.x; tile < (int)G[0]; tile += gridDim.x) {
        lora_shrink_ids_tile(tile, ids, A, G, C, ranks, R, vocab, t);
    }
}

// Expand with the per-slice scaling and the residual add fused:
// y[perm[p]][o] += s_j · Σ_{k<r} t[p][j·r + k] · Bᵀ[slot][k][o], j the slice of column o
// (boundaries off1, off2; pass out for slices that do not exist), t the shrink's final sums.
// grid (item blocks, ceil(out / LEX_COLS)), LEX_THREADS threads, for each work item (below):
// a lane owns 8 consecutive columns (16-byte Bᵀ loads, a warp's y rows 1 KiB contiguous) for
// each of the item's zrows rows of its tile (lora.rs: expand_rows), two rows at a time, so every warp works even when
// the tile is one decode row (warps split over rows, as before, left 7 of 8 idle there and
// starved the memory system of loads in flight), and a long tile still spreads over many
// blocks. The scaled coefficients of the block's rows sit in shared memory (zrows × n·R
// floats, dynamic); Bᵀ is held in registers LORA_KC rank steps at a time, loaded once for all
// of the block's rows when the rank fits one such chunk.
#define LEX_THREADS 128
#define LEX_COLS (LEX_THREADS * 8)
__device__ __forceinline__ void lora_expand_item(int tile, int s0, int zrows, const float* __restrict__ t, const bf16_t* __restrict__ B, const u32* __restrict__ G, int C,
                                                                  const u32* __restrict__ ranks, const float* __restrict__ scal, int n_slices, int R, int b_ld,
                                                                  int off1, int off2, int out, float* __restrict__ y) {
    extern __shared__ float coef[];
    const u32* perm = G + 1;
    const int p0 = G[1 + C + tile], n = G[1 + 2 * C + tile], slot = G[1 + 3 * C + tile];
    const int r = ranks[slot];
    if (s0 >= n || r == 0) return;
    const int W = n_slices * R, nr = n_slices * r;
    const int o0 = (blockIdx.y * LEX_THREADS + threadIdx.x) * 8;
    const bool live = o0 < out;
    const bf16_t* b = B + (size_t)slot * R * b_ld;
    int jr[8];  // j·r of each of this lane's columns
#pragma unroll
    for (int e = 0; e < 8; ++e) jr[e] = ((o0 + e >= off1) + (o0 + e >= off2)) * r;
    const bool vec = (out & 7) == 0 && (b_ld & 7) == 0;
    const int chunks = (r + LORA_KC - 1) / LORA_KC;
    uint4 bq[LORA_KC];
#define LEX_LOAD_B(kc)                                                                       \
    _Pragma("unroll") for (int q = 0; q < LORA_KC; ++q) if (q < r - (kc)) bq[q] = *reinterpret_cast<const uint4*>(b + (size_t)((kc) + q) * b_ld + o0);
    if (vec && live && chunks == 1) {
        LEX_LOAD_B(0)
    }
    {
        // This block's rows of the tile: zrows of them from s0.
        const int ns = min(zrows, n - s0);
        for (int e = threadIdx.x; e < ns * nr; e += blockDim.x) {
            const int i = e / nr, c = e % nr;
            coef[i * W + c] = t[(size_t)(p0 + s0 + i) * W + c] * scal[slot * 3 + c / r];
        }
        __syncthreads();
        if (!live) return;
        if (vec) {
            for (int i = 0; i < ns; i += 2) {
                // Both rows' outputs are loaded before either is stored (no aliasing stall), once
                // for all rank steps.
                const bool two = i + 1 < ns;
                float* y0 = y + (size_t)perm[p0 + s0 + i] * out + o0;
                float* y1 = y + (size_t)perm[p0 + s0 + (two ? i + 1 : i)] * out + o0;
                float a0[8], a1[8];
                {
                    const float4 u0 = *reinterpret_cast<const float4*>(y0), v0 = *reinterpret_cast<const float4*>(y0 + 4);
                    const float4 u1 = *reinterpret_cast<const float4*>(y1), v1 = *reinterpret_cast<const float4*>(y1 + 4);
                    a0[0] = u0.x; a0[1] = u0.y; a0[2] = u0.z; a0[3] = u0.w; a0[4] = v0.x; a0[5] = v0.y; a0[6] = v0.z; a0[7] = v0.w;
                    a1[0] = u1.x; a1[1] = u1.y; a1[2] = u1.z; a1[3] = u1.w; a1[4] = v1.x; a1[5] = v1.y; a1[6] = v1.z; a1[7] = v1.w;
                }
                const float* c0p = coef + i * W;
                const float* c1p = coef + (two ? i + 1 : i) * W;
                for (int ch = 0; ch < chunks; ++ch) {
                    const int kc = ch * LORA_KC;
                    if (chunks > 1) {
                        LEX_LOAD_B(kc)
                    }
#pragma unroll
                    for (int q = 0; q < LORA_KC; ++q) {
                        if (q < r - kc) {
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
            }
        } else {
            // Any width: one column at a time.
            for (int e = 0; e < 8 && o0 + e < out; ++e) {
                const int o = o0 + e;
                for (int i = 0; i < ns; ++i) {
                    const float* ci = coef + i * W + jr[e];
                    float acc = 0.f;
                    for (int k = 0; k < r; ++k) acc += ci[k] * bf2f(b[(size_t)k * b_ld + o]);
                    y[(size_t)perm[p0 + s0 + i] * out + o] += acc;
                }
            }
        }
    }
#undef LEX_LOAD_B
}

// Work items are (tile, zrows rows of it), numbered tile by tile; block x takes items x,
// x + gridDim.x, … A recorded step launches a fixed number of item blocks (lora.rs), not one
// per possible tile and row group: blocks with nothing to do still cost their dispatch, and
// 256 possible tiles × 16 row groups × 28 column blocks of empty blocks measured slower than
// the work itself.
__device__ __forceinline__ int lora_item_tile(const u32* G, int C, int item, int zrows, int* s0) {
    // Every warp finds the item's tile itself, 32 tiles a round: item counts of 32 tiles at
    // once, an inclusive scan by shuffles, the first lane whose sum passes the item (a serial
    // walk cost one dependent load per tile, ~3 µs an item over a 2048-row prefill's 32 tiles).
    const int tiles = G[0], lane = threadIdx.x & 31;
    int base = 0;
    for (int t0 = 0; t0 < tiles; t0 += 32) {
        const int c = t0 + lane < tiles ? ((int)G[1 + 2 * C + t0 + lane] + zrows - 1) / zrows : 0;
        int incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (item < base + total) {
            const int l = __ffs(__ballot_sync(0xffffffffu, item < base + incl)) - 1;
            *s0 = (item - base - __shfl_sync(0xffffffffu, incl - c, l)) * zrows;
            return t0 + l;
        }
        base += total;
    }
    return -1;
}

extern "C" __global__ void __launch_bounds__(LEX_THREADS) lora_expand(const float* __restrict__ t, const bf16_t* __restrict__ B, const u32* __restrict__ G, int C,
                                                                  const u32* __restrict__ ranks, const float* __restrict__ scal, int n_slices, int R, int b_ld,
                                                                  int off1, int off2, int out, int zrows, float* __restrict__ y) {
    pdl_entry();
    for (int item = blockIdx.x;; item += gridDim.x) {
        int s0 = 0;
        const int tile = lora_item_tile(G, C, item, zrows, &s0);
        if (tile < 0) break;
        __syncthreads(); // the previous item's coefficients are no longer read
        lora_expand_item(tile, s0, zrows, t, B, G, C, ranks, scal, n_slices, R, b_ld, off1, off2, out, y);
    }
}
