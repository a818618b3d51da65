// Collectives of a tensor-parallel group whose ranks are devices of this process (collective.rs):
// a rank's kernel reads — and for the all-reduce writes — the other ranks' buffers directly,
// through unified addressing (the same GPU, or a peer GPU with peer access enabled).
// Up to 8 ranks; pointers are passed one by one (p0..p7, unused ones 0).

// (u64 is sample.cu's, which comes before this file in the module.)
#define TP_PTRS u64 p0, u64 p1, u64 p2, u64 p3, u64 p4, u64 p5, u64 p6, u64 p7

// These kernels are launched without programmatic serialization (collective.rs): what they wait
// for is other ranks' events, which a programmatic launch need not honour, so they have no
// pdl_entry() and start only once everything before them on the stream has finished.

// This rank's share `lo..hi` of an all-reduce: every element becomes ((y_0 + y_1) + y_2) + …
// in rank order, written back into every rank's buffer, so the N ranks' kernels together are a
// reduce-scatter and an all-gather in one pass and every rank holds identical bits. `lo` is a
// multiple of 4 (the buffers are 256-byte aligned), so the body moves float4s.
extern "C" __global__ void tp_all_reduce(TP_PTRS, int n, int lo, int hi) {
    float* p[8] = {(float*)p0, (float*)p1, (float*)p2, (float*)p3, (float*)p4, (float*)p5, (float*)p6, (float*)p7};
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

// out[i, r·cols + j] = rank r's local[i, j]: every rank's block of logit columns side by side.
extern "C" __global__ void tp_all_gather_cols(TP_PTRS, int n, int rows, int cols, float* __restrict__ out) {
    const float* p[8] = {(const float*)p0, (const float*)p1, (const float*)p2, (const float*)p3, (const float*)p4, (const float*)p5, (const float*)p6, (const float*)p7};
    const long long width = (long long)n * cols, total = (long long)rows * width;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        const long long i = k / width;
        const int c = (int)(k - i * width), r = c / cols, j = c - r * cols;
        out[k] = p[r][i * cols + j];
    }
}

// Nothing: launched plainly after a collective's final event waits, so the next kernel, which
// may be launched programmatically and then waits only for its predecessor kernel, waits for
// this one and through it for every rank's collective kernel.
extern "C" __global__ void tp_fence() {}
