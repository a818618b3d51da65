// Prefill attention on tensor cores (attention.rs). Appended after gemv.cu in the one NVRTC module
// (module.rs KERNELS_SRC): the cp.async helpers are gemv.cu's; its mma / ldmatrix helpers serve
// lora.cu's tensor-core shrink too.

// ---- prefill attention on tensor cores ----------------------------------------------------------
// Flash-attention style: a block takes FA_BM consecutive query rows of one sequence (16 per warp)
// and one head, stages K/V tiles of FA_BN keys from the paged cache (bf16, straight from the block
// table) in shared memory, computes S = Q·Kᵀ and O += P·V with mma.sync m16n8k16 (bf16 operands,
// f32 accumulation) and keeps the softmax online in f32 (exp2 with log2 e folded into Q's scale).
// Q and P are rounded to bf16 for the tensor cores, as flash attention does. Causal per row: key t
// is visible to a row at position p iff t <= p (rows of a sequence have ascending positions).
// `tiles` holds (first row, row count, sequence) per block. HD is head_dim rounded up to a multiple
// of 32 (padding dims are zero in Q, K and V). K/V tiles are double-buffered: the next tile's
// cp.async copies are in flight while the current one is multiplied. Dynamic shared memory:
// fa_smem_bytes(HD) (over the default 48 KB for HD = 128: the host raises the limit).
#define FA_BM 64
#define FA_BN 64
#define FA_THREADS 128

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// d += a · b for one m16n8k16 tile (a row-major 16×16, b column-major 16×8, bf16; d f32).
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int HD>
__device__ __forceinline__ void flash_prefill(const float* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                              const u32* __restrict__ tiles, const u32* __restrict__ positions,
                                              const u32* __restrict__ block_tables, int bt_stride, float* __restrict__ out,
                                              bf16_t* __restrict__ outb, int ldb, int n_heads, int n_kv, int hd, int block_size, float scale) {
    constexpr int LD = HD + 8; // row stride in bf16: 16 bytes of padding make ldmatrix conflict-free
    constexpr int NS = FA_BN / 8, NO = HD / 8, KQ = HD / 16;
    extern __shared__ __align__(16) bf16_t fa_smem[]; // [2 buffers][K, V][FA_BN][LD]
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int tile = gridDim.x - 1 - blockIdx.x; // longest contexts first: less tail
    const int h = blockIdx.y;
    const int row0 = tiles[3 * tile], nrows = tiles[3 * tile + 1], seq = tiles[3 * tile + 2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int width = (n_heads + 2 * n_kv) * hd, kvw = n_kv * hd;
    const int kvh = h / (n_heads / n_kv);
    const u32* table = block_tables + (size_t)seq * bt_stride;
    const int maxpos = (int)positions[row0 + nrows - 1];

    // Copies K/V tile `it` into buffer `b` (zeros past the context and in padding dims).
    auto load_tile = [&](int it, int b) {
        bf16_t* ks = fa_smem + b * 2 * FA_BN * LD;
        bf16_t* vs = ks + FA_BN * LD;
        constexpr int CH = HD / 8; // 16-byte chunks per row
#pragma unroll
        for (int i = tid; i < FA_BN * CH; i += FA_THREADS) {
            const int j = i / CH, d = (i - j * CH) * 8, t = it * FA_BN + j;
            const bool valid = t <= maxpos && d < hd;
            size_t off = 0;
            if (valid) off = ((size_t)table[t / block_size] * block_size + t % block_size) * kvw + kvh * hd + d;
            if ((hd & 7) == 0) {
                cp_async16_zfill(&ks[j * LD + d], kc + off, valid);
                cp_async16_zfill(&vs[j * LD + d], vc + off, valid);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    const bool in = valid && d + e < hd;
                    ks[j * LD + d + e] = in ? kc[off + e] : (bf16_t)0;
                    vs[j * LD + d + e] = in ? vc[off + e] : (bf16_t)0;
                }
            }
        }
    };
    load_tile(0, 0);
    cp_async_commit();

    // Q (scaled by scale · log2 e) → bf16, staged in buffer 1, then into A fragments.
    {
        bf16_t* qs = fa_smem + 2 * FA_BN * LD;
        const float qscale = scale * 1.4426950408889634f;
        for (int i = tid; i < FA_BM * HD; i += FA_THREADS) {
            const int r = i / HD, d = i - r * HD;
            const float v = (r < nrows && d < hd) ? qkv[(size_t)(row0 + r) * width + h * hd + d] * qscale : 0.f;
            qs[r * LD + d] = f2bf(v);
        }
    }
    __syncthreads();
    u32 qf[KQ][4];
#pragma unroll
    for (int kk = 0; kk < KQ; kk++)
        ldsm_x4(qf[kk], &fa_smem[2 * FA_BN * LD + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 + (lane >> 4) * 8]);

    // This thread's two rows of the warp's 16 (mma C layout: rows lane/4 and lane/4 + 8).
    const int rA = warp * 16 + (lane >> 2), rB = rA + 8;
    const int posA = rA < nrows ? (int)positions[row0 + rA] : -1;
    const int posB = rB < nrows ? (int)positions[row0 + rB] : -1;
    const int wlast = min(warp * 16 + 15, nrows - 1);
    const int wmax = warp * 16 < nrows ? (int)positions[row0 + wlast] : -1;
    const int c2 = (lane & 3) * 2;

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float mA = NEG_INF, mB = NEG_INF, lA = 0.f, lB = 0.f;

    const int ntiles = maxpos / FA_BN + 1;
    for (int it = 0; it < ntiles; it++) {
        const int t0 = it * FA_BN;
        __syncthreads(); // every warp is done with the buffer the next tile goes into (or with Q)
        if (it + 1 < ntiles) load_tile(it + 1, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>(); // this thread's copies of tile `it` have landed
        __syncthreads();    // ... and everyone's
        const bf16_t* ks = fa_smem + (it & 1) * 2 * FA_BN * LD;
        const bf16_t* vs = ks + FA_BN * LD;
        if (t0 > wmax) continue; // every row of this warp is before the tile

        // S = Q · Kᵀ (16 rows × FA_BN keys per warp).
        float s[NS][4];
#pragma unroll
        for (int j = 0; j < NS; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KQ; kk++) {
#pragma unroll
            for (int jj = 0; jj < NS / 2; jj++) {
                u32 b[4];
                ldsm_x4(b, &ks[(jj * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8]);
                mma_bf16(s[2 * jj], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * jj + 1], qf[kk], b[2], b[3]);
            }
        }
        // Causal mask, online softmax (each row's max and sum over the 4 lanes that hold it).
        float mxA = mA, mxB = mB;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            const int t = t0 + j * 8 + c2;
            if (t > posA) s[j][0] = NEG_INF;
            if (t + 1 > posA) s[j][1] = NEG_INF;
            if (t > posB) s[j][2] = NEG_INF;
            if (t + 1 > posB) s[j][3] = NEG_INF;
            mxA = fmaxf(mxA, fmaxf(s[j][0], s[j][1]));
            mxB = fmaxf(mxB, fmaxf(s[j][2], s[j][3]));
        }
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
        const float uA = mxA == NEG_INF ? 0.f : mxA, uB = mxB == NEG_INF ? 0.f : mxB;
        const float cA = exp2f(mA - uA), cB = exp2f(mB - uB);
        float sumA = 0.f, sumB = 0.f;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            s[j][0] = exp2f(s[j][0] - uA);
            s[j][1] = exp2f(s[j][1] - uA);
            s[j][2] = exp2f(s[j][2] - uB);
            s[j][3] = exp2f(s[j][3] - uB);
            sumA += s[j][0] + s[j][1];
            sumB += s[j][2] + s[j][3];
        }
        lA = lA * cA + sumA;
        lB = lB * cB + sumB;
        mA = mxA;
        mB = mxB;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            o[j][0] *= cA;
            o[j][1] *= cA;
            o[j][2] *= cB;
            o[j][3] *= cB;
        }
        // O += P · V: the S accumulators are already in the A-fragment layout.
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                        pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < NO / 2; np++) {
                u32 b[4];
                ldsm_x4_t(b, &vs[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + np * 16 + (lane >> 4) * 8]);
                mma_bf16(o[2 * np], a, b[0], b[1]);
                mma_bf16(o[2 * np + 1], a, b[2], b[3]);
            }
        }
    }
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    // Row r's output from the accumulator half `hi` (0: rows lane/4, 1: rows lane/4 + 8).
    auto store = [&](int r, float l, int hi) {
        if (r >= nrows) return;
        const size_t at = (size_t)(row0 + r) * n_heads * hd + h * hd;
        float* orow = out + at;
        bf16_t* brow = outb ? outb + (size_t)(row0 + r) * ldb + h * hd : nullptr;
        const float inv = 1.f / l;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            const int d = j * 8 + c2;
            const float v0 = o[j][2 * hi] * inv, v1 = o[j][2 * hi + 1] * inv;
            if (d < hd) orow[d] = v0;
            if (d + 1 < hd) orow[d + 1] = v1;
            if (brow && d < hd) brow[d] = f2bf(v0);
            if (brow && d + 1 < hd) brow[d + 1] = f2bf(v1);
        }
    };
    store(rA, lA, 0);
    store(rB, lB, 1);
}

#define FLASH_PREFILL(HD)                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_##HD(                                                            \
        const float* qkv, const bf16_t* kc, const bf16_t* vc, const u32* tiles, const u32* positions, const u32* block_tables, int bt_stride,   \
        float* out, bf16_t* outb, int ldb, int n_heads, int n_kv, int hd, int block_size, float scale) {                                                  \
        pdl_entry();                                                                                                                             \
        flash_prefill<HD>(qkv, kc, vc, tiles, positions, block_tables, bt_stride, out, outb, ldb, n_heads, n_kv, hd, block_size, scale);             \
    }
FLASH_PREFILL(32) FLASH_PREFILL(64) FLASH_PREFILL(96) FLASH_PREFILL(128)
