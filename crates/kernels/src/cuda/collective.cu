// Collectives of a tensor-parallel group whose ranks are devices of this process (collective.rs):
// a rank's kernel reads — and for the all-reduce writes — the other ranks' buffers directly,
// through unified addressing (the same GPU, or a peer GPU with peer access enabled).
// Up to 8 ranks; pointers are passed one by one (p0..p7, unused ones 0).

// (u64 is sample.cu's, which comes before this file in the module.)
#define TP_PTRS u64 p0, u64 p1, u64 p2, u64 p3, u64 p4, u64 p5, u64 p6, u64 p7

// These kernels (all but the `*_flags` ones at the end) are launched without programmatic
// serialization (collective.rs): what they wait for is other ranks' events, which a
// programmatic launch need not honour, so they have no pdl_entry() and start only once
// everything before them on the stream has finished.

// This rank's share `lo..hi` of an all-reduce: every element becomes ((y_0 + y_1) + y_2) + …
// in rank order, written back into every rank's buffer, so the N ranks' kernels together are a
// reduce-scatter and an all-gather in one pass and every rank holds identical bits. `lo` is a
// multiple of 4 (the buffers are 256-byte aligned), so the body moves float4s.
__device__ __forceinline__ void tp_all_reduce_body(float* const* p, int n, int lo, int hi) {
    const int stride = gridDim.x * blockDim.x;
    const int nvec = (hi - lo) >> 2;
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += stride) {
        const int i = lo + 4 * v;
        float4 s = *(const float4*)(p[0] + i);
        for (int r = 1; r < n; r++) {
            const float4 t = *(const float4*)(p[r] + i);
            s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
        }
        for (int r = 0; r < n; r++) *(float4*)(p[r] + i) = s;
    }
    for (int i = lo + 4 * nvec + blockIdx.x * blockDim.x + threadIdx.x; i < hi; i += stride) {
        float s = p[0][i];
        for (int r = 1; r < n; r++) s += p[r][i];
        for (int r = 0; r < n; r++) p[r][i] = s;
    }
}

extern "C" __global__ void tp_all_reduce(TP_PTRS, int n, int lo, int hi) {
    float* p[8] = {(float*)p0, (float*)p1, (float*)p2, (float*)p3, (float*)p4, (float*)p5, (float*)p6, (float*)p7};
    tp_all_reduce_body(p, n, lo, hi);
}

// out[i, r·cols + j] = rank r's local[i, j]: every rank's block of logit columns side by side.
__device__ __forceinline__ void tp_all_gather_cols_body(const float* const* p, int n, int rows, int cols, float* __restrict__ out) {
    const long long width = (long long)n * cols, total = (long long)rows * width;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        const long long i = k / width;
        const int c = (int)(k - i * width), r = c / cols, j = c - r * cols;
        out[k] = p[r][i * cols + j];
    }
}

extern "C" __global__ void tp_all_gather_cols(TP_PTRS, int n, int rows, int cols, float* __restrict__ out) {
    const float* p[8] = {(const float*)p0, (const float*)p1, (const float*)p2, (const float*)p3, (const float*)p4, (const float*)p5, (const float*)p6, (const float*)p7};
    tp_all_gather_cols_body(p, n, rows, cols, out);
}

// Nothing: launched plainly after a collective's final event waits, so the next kernel, which
// may be launched programmatically and then waits only for its predecessor kernel, waits for
// this one and through it for every rank's collective kernel.
extern "C" __global__ void tp_fence() {}

// ---- The same collectives ordered on the device (collective.rs, QUIVER_CUDA_TP_FLAGS=1) ----
//
// Host barriers and cross-stream event waits are what keep CUDA graphs off a tensor-parallel
// group: a graph holds neither. Here block b of every rank's collective kernel meets block b of
// the others through flags in peer memory instead: it raises its flag in every rank's signal
// buffer and waits until every rank's is raised, once before touching the buffers (every rank's
// input is written: its kernel starts only after its stream's earlier work, griddepcontrol.wait)
// and once after (no rank still reads or writes another's buffer when its kernel ends). A flag
// holds the block's epoch, which every rank's block b advances by one per call in step with the
// others, so flags never need resetting. Every call launches TP_FLAG_BLOCKS blocks whatever its
// size, so each block takes part in each call. The kernels do not let their successor start
// early (no griddepcontrol.launch_dependents): ranks sharing a GPU could otherwise fill it with
// waiting blocks while another rank still has work to reach its own collective.

#define TP_FLAG_BLOCKS 32
#define TP_SIGS u64 s0, u64 s1, u64 s2, u64 s3, u64 s4, u64 s5, u64 s6, u64 s7
// A rank's signal buffer: [TP_FLAG_BLOCKS][2 phases][8 ranks] u32; its epochs [TP_FLAG_BLOCKS].

__device__ __forceinline__ void tp_st_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 tp_ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Block blockIdx.x of every rank meets here (phase 0 before the buffers, 1 after). A rank that
// never arrives (its thread failed) traps the waiting kernels after ~2^36 cycles instead of
// hanging the GPU.
__device__ __forceinline__ void tp_meet(u32* const* sig, u32 e, int me, int n, int phase) {
    __threadfence_system(); // this block's writes to peer buffers before its flag (phase 1)
    __syncthreads();
    if ((int)threadIdx.x < n) {
        const int at = (blockIdx.x * 2 + phase) * 8;
        tp_st_release(sig[threadIdx.x] + at + me, e);
        const long long t0 = clock64();
        // Signed distance: epochs wrap after 2^32 calls (days of serving), flags stay within
        // one call of each other.
        while ((int)(tp_ld_acquire(sig[me] + at + threadIdx.x) - e) < 0) {
            if (clock64() - t0 > (1ll << 36)) __trap();
        }
        __threadfence_system();
    }
    __syncthreads();
}

// A device-ordered call's start: its stream's earlier work done, the block's epoch for this
// call, and every rank's block b arrived. Returns the epoch, for tp_end.
__device__ __forceinline__ u32 tp_begin(u32* const* sig, const u32* epoch, int me, int n) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    __shared__ u32 e;
    if (threadIdx.x == 0) e = epoch[blockIdx.x] + 1;
    __syncthreads();
    const u32 ep = e;
    tp_meet(sig, ep, me, n, 0);
    return ep;
}

// Its end: every rank's block b done with the buffers, then the epoch advanced.
__device__ __forceinline__ void tp_end(u32* const* sig, u32* epoch, u32 e, int me, int n) {
    tp_meet(sig, e, me, n, 1);
    if (threadIdx.x == 0) epoch[blockIdx.x] = e;
}

#define TP_SIG_ARRAY u32* sig[8] = {(u32*)s0, (u32*)s1, (u32*)s2, (u32*)s3, (u32*)s4, (u32*)s5, (u32*)s6, (u32*)s7}

extern "C" __global__ void tp_all_reduce_flags(TP_PTRS, TP_SIGS, u32* __restrict__ epoch, int me, int n, int lo, int hi) {
    float* p[8] = {(float*)p0, (float*)p1, (float*)p2, (float*)p3, (float*)p4, (float*)p5, (float*)p6, (float*)p7};
    TP_SIG_ARRAY;
    const u32 e = tp_begin(sig, epoch, me, n);
    if (lo < hi) tp_all_reduce_body(p, n, lo, hi);
    tp_end(sig, epoch, e, me, n);
}

extern "C" __global__ void tp_all_gather_cols_flags(TP_PTRS, TP_SIGS, u32* __restrict__ epoch, int me, int n, int rows, int cols, float* __restrict__ out) {
    const float* p[8] = {(const float*)p0, (const float*)p1, (const float*)p2, (const float*)p3, (const float*)p4, (const float*)p5, (const float*)p6, (const float*)p7};
    TP_SIG_ARRAY;
    const u32 e = tp_begin(sig, epoch, me, n);
    tp_all_gather_cols_body(p, n, rows, cols, out);
    tp_end(sig, epoch, e, me, n);
}
