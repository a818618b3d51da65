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
