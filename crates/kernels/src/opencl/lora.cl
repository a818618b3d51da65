// LoRA kernels (`Device::lora_apply` on OpenCL; host side in lora.rs), portable OpenCL C 1.2.
//
// Rows are read and written in place through the packed groups staged with the batch
// (quiver_kernels::lora::pack_tiles) at G = meta + g_off: G[0] = tiles, perm = G + 1, and for tile
// i at G + 1 + C·k (k = 1 start, 2 length, 3 slot), C the grouping's row capacity, a tile at most
// LORA_TILE rows of one slot (segments of a prefill and chunks of a decode permutation alike).
//
// Pool layout (kernels/src/lora.rs): A (S, n·R, in) f32, slice j of a rank-r site at rows
// [j·r, j·r + r); Bᵀ (S, R, b_ld) f32; the table buffer holds ranks [entry][slot] (u32) and then
// scalings [entry][slot][3] (f32 bits). Every kernel contracts over exactly the slot's rank r, so
// mixed ranks cost what their ranks do and a slot's zeroed tail is never read.
//
// The shrink writes t = x·Aᵀ unscaled as [C][n·R]; the expand scales per slice and adds into
// the base output (the residual add fused). Each output element is one work-item's fma chain in
// a fixed order: a row's delta never depends on the rows it shares the call with.

#ifndef LORA_TILE
#define LORA_TILE 16
#endif

#define TILE_START(G, C, i) ((int)(G)[1 + (C) + (i)])
#define TILE_LEN(G, C, i) ((int)(G)[1 + 2 * (C) + (i)])
#define TILE_SLOT(G, C, i) ((int)(G)[1 + 3 * (C) + (i)])

// t[p][c] = x[perm[p]] · A[slot][c] for c < n·r. Work-item (row of the tile, c, tile).
__kernel void lora_shrink(__global const float* x, __global const float* A, __global const u32* meta, int g_off, int C,
                          __global const u32* table, int ranks_off, int n_slices, int R, int in_dim, __global float* t) {
    const int i = get_global_id(0), c = get_global_id(1), tile = get_global_id(2);
    __global const u32* G = meta + g_off;
    if (tile >= (int)G[0] || i >= TILE_LEN(G, C, tile)) return;
    const int slot = TILE_SLOT(G, C, tile), p = TILE_START(G, C, tile) + i;
    const int W = n_slices * R;
    if (c >= n_slices * (int)table[ranks_off + slot]) return;
    __global const float* a = A + ((size_t)slot * W + c) * in_dim;
    __global const float* xr = x + (size_t)G[1 + p] * in_dim;
    float acc = 0.f;
    for (int k = 0; k < in_dim; k++) acc = fma(xr[k], a[k], acc);
    t[(size_t)p * W + c] = acc;
}

// The embedding's shrink: t[p][k] = A[slot][k][id], id = ids[perm[p]] (A is (S, R, vocab), PEFT's
// lora_embedding_A); ids outside the vocabulary get no delta. Work-item (k, row of the tile, tile).
__kernel void lora_shrink_ids(__global const u32* meta, int ids_off, __global const float* A, int g_off, int C,
                              __global const u32* table, int ranks_off, int R, int vocab, __global float* t) {
    const int k = get_global_id(0), i = get_global_id(1), tile = get_global_id(2);
    __global const u32* G = meta + g_off;
    if (tile >= (int)G[0] || i >= TILE_LEN(G, C, tile)) return;
    const int slot = TILE_SLOT(G, C, tile), p = TILE_START(G, C, tile) + i;
    if (k >= (int)table[ranks_off + slot]) return;
    const u32 id = meta[ids_off + G[1 + p]];
    t[(size_t)p * R + k] = id < (u32)vocab ? A[((size_t)slot * R + k) * vocab + id] : 0.f;
}

// y[perm[p]][o] += s_j · Σ_{k<r} t[p][j·r + k] · Bᵀ[slot][k][o], j the slice of column o
// (boundaries off1, off2; `out` for slices that do not exist). Work-item (o, row of the tile, tile).
__kernel void lora_expand(__global const float* t, __global const float* B, __global const u32* meta, int g_off, int C,
                          __global const u32* table, int ranks_off, int scal_off, int n_slices, int R, int b_ld,
                          int off1, int off2, int out, __global float* y) {
    const int o = get_global_id(0), i = get_global_id(1), tile = get_global_id(2);
    __global const u32* G = meta + g_off;
    if (o >= out || tile >= (int)G[0] || i >= TILE_LEN(G, C, tile)) return;
    const int slot = TILE_SLOT(G, C, tile), p = TILE_START(G, C, tile) + i;
    const int r = (int)table[ranks_off + slot];
    if (r == 0) return;
    const int j = (o >= off1) + (o >= off2);
    __global const float* tp = t + (size_t)p * n_slices * R + j * r;
    __global const float* b = B + (size_t)slot * R * b_ld + o;
    float acc = 0.f;
    for (int k = 0; k < r; k++) acc = fma(tp[k], b[(size_t)k * b_ld], acc);
    y[(size_t)G[1 + p] * out + o] += as_float(table[scal_off + slot * 3 + j]) * acc;
}
