// LoRA tails (lora_tail.rs, docs/lora-in-the-gemm.md): a site's B of the first slots kept beside
// the base weight's rows, so one GEMM over the weight's columns and the tail adds the delta.

// Writes slot `slot`'s B into the tail: for output row o (slice j_o: the last slice whose offset
// is ≤ o) and tail column c = j·R + i of the slot's n·R, Bᵀ[slot][i][o] when j == j_o, else 0.
// Bᵀ is the pool's `(S, R, b_ld)` bf16; the tail's row o starts at tail + o·ld, the slot's
// columns at slot·n·R. One thread a (row, column); rows along y in chunks of the grid.
extern "C" __global__ void lora_tail_scatter(const bf16_t* __restrict__ bt, int b_ld, int R, int n_slices, int off1, int off2, int out_dim,
                                             bf16_t* __restrict__ tail, long ld, int slot) {
    pdl_entry();
    const int nr = n_slices * R;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= nr) return;
    const int j = c / R, i = c - j * R;
    const bf16_t* src = bt + ((size_t)slot * R + i) * b_ld;
    for (int o = blockIdx.y; o < out_dim; o += gridDim.y) {
        const int jo = (n_slices > 2 && o >= off2) ? 2 : (n_slices > 1 && o >= off1) ? 1 : 0;
        tail[(size_t)o * ld + (size_t)slot * nr + c] = j == jo ? src[o] : f2bf(0.f);
    }
}

// A multi-row step's t̂ beside x (lora_tail.rs `lora_tail_rows`): one block a row r of the step
// (its position in the packed groups G: pos at [1 + 4C + r], slot at [1 + 5C + r]; a base row has
// no position). The row's shrink t comes from the norm before the site (t_ahead, [pos][W],
// packed by the slot's rank, unscaled) or is computed here from x (f32 [rows][k], a warp an A
// row); then every tail column c < tail_cols of the row's bf16 copy of x (rows ldx apart, the
// tail from column k) gets s_j · t[j·rank + i] where c is column j·R + i of the row's slot, and 0
// everywhere else, so the GEMM over k + tail_cols adds exactly the row's delta.
#define TAIL_MAX_W 192 // n·R at most: 3 slices of rank 64
extern "C" __global__ void lora_tail_shrink(const float* __restrict__ x, int k, const float* __restrict__ t_ahead, int W, const bf16_t* __restrict__ A,
                                            const u32* __restrict__ G, int C, const u32* __restrict__ ranks, const float* __restrict__ scal, int n_slices,
                                            int R, int slots, bf16_t* __restrict__ xb, long ldx, int tail_cols) {
    pdl_entry();
    __shared__ float tv[TAIL_MAX_W];
    const int r = blockIdx.x;
    const u32 pos = G[1 + 4 * C + r];
    const int slot = pos == 0xffffffffu ? -1 : (int)G[1 + 5 * C + r];
    const int rank = slot >= 0 && slot < slots ? (int)ranks[slot] : 0;
    const int nr = n_slices * rank, NR = n_slices * R;
    if (t_ahead) {
        for (int j = threadIdx.x; j < nr; j += blockDim.x) tv[j] = t_ahead[(size_t)pos * W + j];
    } else {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        const float* xr = x + (size_t)r * k;
        for (int j = warp; j < nr; j += nw) {
            const bf16_t* a = A + ((size_t)slot * NR + j) * k;
            float s = 0.f;
            if ((k & 7) == 0) {
                const uint4* a4 = reinterpret_cast<const uint4*>(a);
                const float4* x4 = reinterpret_cast<const float4*>(xr);
                for (int i = lane; i < k / 8; i += 32) {
                    const uint4 p = __ldg(a4 + i);
                    const float4 u = x4[2 * i], v = x4[2 * i + 1];
                    s += __uint_as_float(p.x << 16) * u.x + __uint_as_float(p.x & 0xffff0000u) * u.y + __uint_as_float(p.y << 16) * u.z +
                         __uint_as_float(p.y & 0xffff0000u) * u.w + __uint_as_float(p.z << 16) * v.x + __uint_as_float(p.z & 0xffff0000u) * v.y +
                         __uint_as_float(p.w << 16) * v.z + __uint_as_float(p.w & 0xffff0000u) * v.w;
                }
            } else {
                for (int i = lane; i < k; i += 32) s += bf2f(a[i]) * xr[i];
            }
            s = warp_sum(s);
            if (lane == 0) tv[j] = s;
        }
    }
    __syncthreads();
    bf16_t* out = xb + (size_t)r * ldx + k;
    for (int c = threadIdx.x; c < tail_cols; c += blockDim.x) {
        float v = 0.f;
        if (rank > 0 && c / NR == slot) {
            const int rem = c - slot * NR, j = rem / R, i = rem - j * R;
            if (i < rank) v = tv[j * rank + i] * scal[slot * 3 + j];
        }
        out[c] = f2bf(v);
    }
}
