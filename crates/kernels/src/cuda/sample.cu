// Sampling on the device (the semantics are written down in src/sample.rs, whose host reference
// this matches): one block of SAMPLE_THREADS per token to draw. Thread t owns the contiguous ids
// [t·chunk, (t+1)·chunk), so block scans of per-thread sums give id-order prefix sums; every
// mass is a 40-bit fixed-point integer, so sums are exact and the draw does not depend on the
// order threads add in.

#define SAMPLE_THREADS 1024
#define SAMPLE_TOP_MAX 20

struct SampleSpec {
    u32 row, top_k;
    float inv_t, top_p, min_p;
    int logprobs;
    unsigned long long seed, counter;
};

struct SampleOut {
    u32 token;
    float logprob;
    u32 rank, n_top;
    u32 top_ids[SAMPLE_TOP_MAX];
    float top_lp[SAMPLE_TOP_MAX];
};

typedef unsigned long long u64;

// Float order as unsigned order (larger logit → larger key).
__device__ __forceinline__ u32 sample_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ u32 sample_bits(u64 seed, u64 counter) {
    u64 z = seed + (counter + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (u32)(z >> 40);
}

// Sum over the block, returned to every thread. `s` holds 32 entries.
template <typename T> __device__ __forceinline__ T sample_sum(T v, T* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? s[lane] : (T)0;
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) s[0] = v;
    }
    __syncthreads();
    return s[0];
}

// Exclusive prefix sum over threads in order; the block's total into *total.
template <typename T> __device__ __forceinline__ T sample_scan(T v, T* s, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) s[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        T w = lane < nw ? s[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nw) s[lane] = w; // inclusive over warps
    }
    __syncthreads();
    const T before = (warp == 0 ? (T)0 : s[warp - 1]) + inc - v;
    *total = s[(blockDim.x >> 5) - 1];
    __syncthreads();
    return before;
}

// (value, id) max with the lowest id on ties, to every thread.
__device__ __forceinline__ void sample_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    __syncthreads();
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < (int)(blockDim.x >> 5);
        v = has ? sv[lane] : -__int_as_float(0x7f800000);
        i = has ? si[lane] : 0x7fffffff;
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
        }
        if (lane == 0) sv[0] = v, si[0] = i;
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

struct SampleRow {
    const float* l;
    int b0, b1;     // this thread's ids
    float mx, inv_t;
    __device__ bool finite(float x) const { return x > -__int_as_float(0x7f800000); }
    __device__ u64 mass(float x) const { return (u64)(expf((x - mx) * inv_t) * 1099511627776.0f); }
};

// A prefix of the rank order: every finite id whose key is above `key`, and the first `j` (in id
// order) of those equal to it. `base` is this thread's count of equal keys before its ids.
struct SampleCut {
    u32 key, j, base;
};

__device__ __forceinline__ SampleCut sample_cut(const SampleRow& r, u32 key, u32 j, u32* su) {
    u32 eq = 0;
    for (int i = r.b0; i < r.b1; i++) eq += r.finite(r.l[i]) && sample_key(r.l[i]) == key;
    u32 total;
    const u32 base = sample_scan<u32>(eq, su, &total);
    return SampleCut{key, j, base};
}

// Walks this thread's ids calling f(id, x) for the ones inside the cut.
template <typename F> __device__ __forceinline__ void sample_each_kept(const SampleRow& r, const SampleCut& c, F f) {
    u32 eq = c.base;
    for (int i = r.b0; i < r.b1; i++) {
        const float x = r.l[i];
        if (!r.finite(x)) continue;
        const u32 k = sample_key(x);
        if (k > c.key || (k == c.key && eq++ < c.j)) f(i, x);
    }
}

// Radix select over the rank order, 8 bits a pass from the top: the key at which the running
// weight (count when by_mass is false, else mass) of the ids inside `within` reaches `want`, and
// how much of that key's weight is still needed. hist has 256 entries.
__device__ void sample_select(const SampleRow& r, const SampleCut& within, bool by_mass, u64 want, u64* hist, u64* sh, u32* key_out, u64* rem_out) {
    u32 prefix = 0, mask = 0;
    u64 rem = want;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        sample_each_kept(r, within, [&](int, float x) {
            const u32 k = sample_key(x);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], by_mass ? r.mass(x) : 1ull);
        });
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l holds digits 255 − 8l … 248 − 8l (descending), their sum scanned across lanes.
            const int lane = threadIdx.x;
            u64 s = 0;
            for (int q = 0; q < 8; q++) s += hist[255 - 8 * lane - q];
            u64 inc = s;
            for (int o = 1; o < 32; o <<= 1) {
                const u64 n = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += n;
            }
            u64 above = inc - s;
            const bool here = above < rem && rem <= inc;
            const unsigned ballot = __ballot_sync(0xffffffffu, here);
            // Rounding can leave no lane (rem beyond the total): take the last non-empty digit.
            const int owner = ballot ? __ffs(ballot) - 1 : 31;
            if (lane == owner) {
                int d = 255 - 8 * lane;
                for (int q = 0; q < 8; q++, d--) {
                    if (above + hist[d] >= rem || q == 7) break;
                    above += hist[d];
                }
                sh[0] = (u64)d;
                sh[1] = rem - above;
            }
        }
        __syncthreads();
        prefix |= (u32)sh[0] << shift;
        mask |= 255u << shift;
        rem = sh[1];
        __syncthreads();
    }
    *key_out = prefix;
    *rem_out = rem;
}

__device__ float sample_key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(const float* __restrict__ logits, int vocab, const SampleSpec* __restrict__ specs, SampleOut* __restrict__ outs) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u32 su[32];
    __shared__ u64 sm[32];
    __shared__ u64 hist[256];
    __shared__ u64 sh[2];
    __shared__ float sf[32];
    pdl_entry();
    const SampleSpec sp = specs[blockIdx.x];
    SampleOut* out = outs + blockIdx.x;
    const float NEG_INF = -__int_as_float(0x7f800000);
    SampleRow r;
    r.l = logits + (size_t)sp.row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    r.b0 = min(vocab, (int)threadIdx.x * chunk);
    r.b1 = min(vocab, r.b0 + chunk);
    float mv = NEG_INF;
    int mi = 0x7fffffff;
    for (int i = r.b0; i < r.b1; i++)
        if (r.l[i] > mv) mv = r.l[i], mi = i;
    sample_argmax(mv, mi, sv, si);
    if (mi == 0x7fffffff) mi = 0;
    int token = mi;
    if (sp.inv_t != 0.f && mv != NEG_INF) {
        r.mx = mv;
        r.inv_t = sp.inv_t;
        const u32 top_k = sp.top_k == 0 ? (u32)vocab : sp.top_k;
        // Everything finite: a cut below every finite key.
        SampleCut cut{sample_key(NEG_INF), 0, 0};
        if (top_k < (u32)vocab || sp.min_p > 0.f || sp.top_p < 1.f) {
            u32 n_fin = 0, n_minp = 0;
            for (int i = r.b0; i < r.b1; i++) {
                const float x = r.l[i];
                n_fin += r.finite(x);
                n_minp += r.finite(x) && expf((x - mv) * sp.inv_t) >= sp.min_p;
            }
            n_fin = sample_sum<u32>(n_fin, su);
            u32 keep = min(top_k, n_fin);
            if (sp.min_p > 0.f) keep = min(keep, sample_sum<u32>(n_minp, su));
            if (keep < n_fin) {
                u32 k;
                u64 rem;
                sample_select(r, cut, false, keep, hist, sh, &k, &rem);
                cut = sample_cut(r, k, (u32)rem, su);
            }
            if (sp.top_p < 1.f) {
                u64 m = 0;
                sample_each_kept(r, cut, [&](int, float x) { m += r.mass(x); });
                const u64 total = sample_sum<u64>(m, sm);
                u64 target = (u64)ceil((double)sp.top_p * (double)total);
                target = target < 1 ? 1 : (target > total ? total : target);
                u32 k;
                u64 rem;
                sample_select(r, cut, true, target, hist, sh, &k, &rem);
                // The ids of key k inside the current cut, and how many of them the mass needs.
                const u64 qk = r.mass(sample_key_value(k));
                u32 eq_in = 0;
                sample_each_kept(r, cut, [&](int, float x) { eq_in += sample_key(x) == k; });
                eq_in = sample_sum<u32>(eq_in, su);
                u64 j = qk ? (rem + qk - 1) / qk : 1;
                j = j < 1 ? 1 : (j > eq_in ? eq_in : j);
                cut = sample_cut(r, k, (u32)j, su);
            }
        }
        u64 m = 0;
        sample_each_kept(r, cut, [&](int, float x) { m += r.mass(x); });
        u64 s;
        const u64 before = sample_scan<u64>(m, sm, &s);
        const u32 u = sample_bits(sp.seed, sp.counter);
        const u64 rr = (s >> 24) * (u64)u + (((s & 0xFFFFFFull) * (u64)u) >> 24);
        if (threadIdx.x == 0) si[0] = mi;
        __syncthreads();
        if (before <= rr && rr < before + m) {
            u64 acc = before;
            bool found = false;
            sample_each_kept(r, cut, [&](int i, float x) {
                if (found) return;
                acc += r.mass(x);
                if (acc > rr) found = true, si[0] = i;
            });
        }
        __syncthreads();
        token = si[0];
        __syncthreads();
    }
    if (threadIdx.x == 0) out->token = (u32)token, out->n_top = 0;
    if (sp.logprobs < 0) return;
    // log-softmax of the raw row, the token's rank, and the best alternatives one pass each.
    float e = 0.f;
    u32 gt = 0;
    const float lt = r.l[token];
    for (int i = r.b0; i < r.b1; i++) {
        e += expf(r.l[i] - mv);
        gt += r.l[i] > lt;
    }
    const float lse = mv + logf(sample_sum<float>(e, sf));
    gt = sample_sum<u32>(gt, su);
    const int n = min(min(sp.logprobs, SAMPLE_TOP_MAX), vocab);
    float pv = __int_as_float(0x7f800000);
    int pi = -1;
    for (int t = 0; t < n; t++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = r.b0; i < r.b1; i++) {
            const float x = r.l[i];
            const bool after = x < pv || (x == pv && i > pi);
            if (after && (x > bv || bi == 0x7fffffff)) bv = x, bi = i;
        }
        sample_argmax(bv, bi, sv, si);
        if (threadIdx.x == 0) out->top_ids[t] = (u32)bi, out->top_lp[t] = bv - lse;
        pv = bv;
        pi = bi;
    }
    if (threadIdx.x == 0) out->logprob = lt - lse, out->rank = 1 + gt, out->n_top = n;
}

// A step's input ids may name the last launch's draws (`DRAWN | i`, src/sample.rs): the token of
// spec i. They are replaced in the step's staged ids, behind the draw on the stream, before the
// embedding reads them: the next step is queued before its tokens have reached the host.
extern "C" __global__ void resolve_drawn(u32* __restrict__ ids, int n, const SampleOut* __restrict__ outs) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32 t = ids[i];
    if (t & 0x80000000u) ids[i] = outs[t & 0x7fffffffu].token;
}
