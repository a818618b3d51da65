// Logit edits before a draw (the semantics and their order are written down in
// src/logit_edits.rs, whose host reference this matches bit for bit): one block per edited row,
// in place. Every rounding is explicit (__fadd_rn, __fmul_rn, __fdiv_rn): NVRTC would otherwise
// fuse `presence + frequency * count` into one FMA, which the host does not.

#define LOGIT_EDIT_THREADS 512
#define LOGIT_EDIT_NO_MASK 0xffffffffu

// One row's header, ROW_WORDS u32 words (EditRow in src/logit_edits.rs); list offsets are in
// words of the arena that follows the headers.
struct LogitEditRow {
    u32 row;
    float repetition, presence, frequency;
    u32 bias_at, bias_len, seen_at, seen_len, counts_at, counts_len, banned_at, banned_len;
    u32 mask_at;
};

extern "C" __global__ void __launch_bounds__(LOGIT_EDIT_THREADS) logit_edits(float* __restrict__ logits, int vocab, const LogitEditRow* __restrict__ rows, const u32* __restrict__ arena) {
    pdl_entry();
    const LogitEditRow e = rows[blockIdx.x];
    float* l = logits + (size_t)e.row * vocab;
    const u32 v = (u32)vocab;
    const float NEG_INF = -__int_as_float(0x7f800000);
    // The bias in list order by one thread: a token listed twice gets both additions in order.
    if (threadIdx.x == 0) {
        for (u32 k = 0; k < e.bias_len; k++) {
            const u32 t = arena[e.bias_at + 2 * k];
            if (t < v) l[t] = __fadd_rn(l[t], __uint_as_float(arena[e.bias_at + 2 * k + 1]));
        }
    }
    __syncthreads();
    // Each token once in the seen and count lists: threads never share an element.
    for (u32 k = threadIdx.x; k < e.seen_len; k += blockDim.x) {
        const u32 t = arena[e.seen_at + k];
        if (t >= v) continue;
        const float x = l[t];
        l[t] = x > 0.f ? __fdiv_rn(x, e.repetition) : __fmul_rn(x, e.repetition);
    }
    __syncthreads();
    for (u32 k = threadIdx.x; k < e.counts_len; k += blockDim.x) {
        const u32 t = arena[e.counts_at + 2 * k];
        if (t >= v) continue;
        const float c = __uint2float_rn(arena[e.counts_at + 2 * k + 1]);
        l[t] = __fsub_rn(l[t], __fadd_rn(e.presence, __fmul_rn(e.frequency, c)));
    }
    __syncthreads();
    // Bans and the mask only write -inf, so they may overlap.
    for (u32 k = threadIdx.x; k < e.banned_len; k += blockDim.x) {
        const u32 t = arena[e.banned_at + k];
        if (t < v) l[t] = NEG_INF;
    }
    if (e.mask_at != LOGIT_EDIT_NO_MASK) {
        const u32* mask = arena + e.mask_at;
        for (u32 t = threadIdx.x; t < v; t += blockDim.x)
            if (!((mask[t >> 5] >> (t & 31)) & 1u)) l[t] = NEG_INF;
    }
}
