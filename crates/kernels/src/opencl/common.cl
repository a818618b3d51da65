// Prepended to every Quiver OpenCL program (OpenCL C 1.2, no extensions): bf16 as raw 16-bit
// patterns, the row-wise reduction and RMSNorm the norms share. Per-step metadata (token ids, positions,
// block tables, LoRA tiles) lives in one staged buffer; a kernel takes it with the word offset
// of each slice it reads (`meta + off`).

// No implicit contraction of a * b + c into fma: OpenCL leaves it to the compiler, and Intel's CPU
// runtime contracted in its vector work-item path but not in its scalar one, so a row's bits
// depended on how many rows shared a launch (a MoE combine broke batch invariance). Kernels
// that want an fma call fma().
#pragma OPENCL FP_CONTRACT OFF

typedef unsigned int u32;

inline float bf2f(ushort h) { return as_float(((uint)h) << 16); }

// Round to nearest even, NaN stays NaN (the CPU's half::bf16::from_f32).
inline ushort f2bf(float f) {
    uint u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}

// Sum of `v` over a work-group of ROW_WG work-items in a fixed tree order (so a row's result
// never depends on anything but the row). `sh` holds ROW_WG floats; every work-item gets the sum.
#ifndef ROW_WG
#define ROW_WG 64
#endif
inline float group_sum(float v, __local float* sh) {
    const int lid = get_local_id(0);
    sh[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = ROW_WG / 2; s > 0; s >>= 1) {
        if (lid < s) sh[lid] += sh[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = sh[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// out = rmsnorm(x) · w over one row of `dim` by the work-group; the sum of squares in a fixed
// order. `out` may be `x`: each work-item writes only the elements it read, after the sum.
inline void row_rms_norm(__global const float* x, __global const float* w, __global float* out, int dim, float eps, __local float* sh) {
    const int lid = get_local_id(0);
    float s = 0.f;
    for (int i = lid; i < dim; i += ROW_WG) s = fma(x[i], x[i], s);
    const float inv = rsqrt(group_sum(s, sh) / dim + eps);
    for (int i = lid; i < dim; i += ROW_WG) out[i] = (x[i] * inv) * w[i];
}
