// LoRA on MoE experts (`Device::lora_experts` on CUDA; host side in lora_experts.rs). Appended
// after lora.cu and moe.cu by NVRTC (one module), so LORA_TILE and the helpers are in scope.
//
// An expert site's rows are the routing's n = m·k grouped positions (the rows of the experts'
// grouped GEMM input and output). lora_expert_group builds, from the device routing and the
// token rows' adapter slots staged with the batch, packed groups in lora.cu's layout at capacity
// C = n: tiles of at most LORA_TILE positions sharing one key slot·E + expert (the expert site's
// slot), perm listing each tile's positions. lora_shrink / lora_shrink_mma and lora_expand then
// run over them unchanged: they read x and write y at perm[p], the routed position itself, and
// the combine that follows scales the delta by the router weight as it scales the expert's own
// output. Positions of base rows are in no tile.
//
// Everything the launches depend on is the pair count n, so a recorded step replays right
// whatever the routing and the adapters: the grouping is one block, and the shrink and expand
// grids are fixed and loop over the tiles G[0] says there are.

#define LEG_THREADS 1024
#define LEG_NO_SLOT 0xffffffffu // pack_tiles' NO_POSITION: a base row in the staged row-slot table

// Inclusive scans of a and b over the 32 lanes of a warp (shuffles).
__device__ __forceinline__ void leg_warp_scan2(u32& a, u32& b, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
            a += x;
            b += y;
        }
    }
}

// One block of LEG_THREADS. expert[i], pos_of[i]: pair i = r·k + j's expert and grouped position
// (moe_group); row_slot[r]: token row r's adapter slot or LEG_NO_SLOT; keys = S·E key counters
// in dynamic shared memory. Writes G[0] (tiles), perm (G + 1), tile start / length / key
// (G + 1 + C·{1,2,3}). The order of positions within a key follows atomics, which changes no
// result: every position's shrink and expand are its own.
extern "C" __global__ void __launch_bounds__(LEG_THREADS) lora_expert_group(const u32* __restrict__ expert, const u32* __restrict__ pos_of, const u32* __restrict__ row_slot,
                                                                          u32* __restrict__ G, int n, int k, int E, int keys) {
    pdl_entry();
    extern __shared__ u32 cnt[];
    __shared__ u32 warp_rows[LEG_THREADS / 32], warp_tiles[LEG_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int C = n;
    for (int i = tid; i < keys; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const u32 w = row_slot[i / k];
        const u32 key = w * (u32)E + expert[i];
        if (w != LEG_NO_SLOT && key < (u32)keys) atomicAdd(&cnt[key], 1u);
    }
    __syncthreads();
    // Each thread owns a run of keys: its positions and tiles, then an exclusive scan of both
    // over the block (warp scans by shuffles, then the warps' totals scanned by warp 0).
    const int per = (keys + blockDim.x - 1) / blockDim.x;
    const int lo = min(keys, tid * per), hi = min(keys, lo + per);
    u32 rows = 0, tiles = 0;
    for (int key = lo; key < hi; ++key) {
        rows += cnt[key];
        tiles += (cnt[key] + LORA_TILE - 1) / LORA_TILE;
    }
    u32 ir = rows, it = tiles;
    leg_warp_scan2(ir, it, lane);
    if (lane == 31) {
        warp_rows[warp] = ir;
        warp_tiles[warp] = it;
    }
    __syncthreads();
    if (warp == 0) {
        u32 r = lane < nw ? warp_rows[lane] : 0, t = lane < nw ? warp_tiles[lane] : 0;
        leg_warp_scan2(r, t, lane);
        if (lane < nw) {
            warp_rows[lane] = r;
            warp_tiles[lane] = t;
        }
    }
    __syncthreads();
    u32 row0 = ir - rows + (warp > 0 ? warp_rows[warp - 1] : 0u);
    u32 tile0 = it - tiles + (warp > 0 ? warp_tiles[warp - 1] : 0u);
    for (int key = lo; key < hi; ++key) {
        const u32 c = cnt[key];
        for (u32 s = 0; s < c; s += LORA_TILE) {
            G[1 + C + tile0] = row0 + s;
            G[1 + 2 * C + tile0] = min((u32)LORA_TILE, c - s);
            G[1 + 3 * C + tile0] = (u32)key;
            ++tile0;
        }
        cnt[key] = row0; // from here on, the key's cursor
        row0 += c;
    }
    // The last thread's keys end the scan: its tile0 is now the number of tiles.
    if (tid == blockDim.x - 1) G[0] = tile0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const u32 w = row_slot[i / k];
        const u32 key = w * (u32)E + expert[i];
        if (w != LEG_NO_SLOT && key < (u32)keys) G[1 + atomicAdd(&cnt[key], 1u)] = pos_of[i];
    }
}
