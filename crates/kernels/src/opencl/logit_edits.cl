// Logit edits before a draw (the semantics and their order are written down in
// src/logit_edits.rs, whose host reference this matches): one work-group of ROW_WG work-items
// (common.cl) per edited row, in place. Contraction is off, so `presence + frequency * count`
// is rounded twice as on the host; the program is built with correctly rounded division where
// the device offers it (`logit_edits.rs`), else a division may differ in the last place.

#pragma OPENCL FP_CONTRACT OFF

#define LOGIT_EDIT_ROW_WORDS 13
#define LOGIT_EDIT_NO_MASK 0xffffffffu

// `edits` holds one header of LOGIT_EDIT_ROW_WORDS words per row (EditRow in
// src/logit_edits.rs: row, repetition, presence, frequency, then (at, len) of the bias, seen,
// count and banned lists, then the mask's offset), then the arena the offsets point into.
__kernel void logit_edits(__global float* logits, int vocab, __global const uint* edits, int rows) {
    const uint r = get_group_id(0);
    const uint lid = get_local_id(0);
    __global const uint* h = edits + r * LOGIT_EDIT_ROW_WORDS;
    __global const uint* arena = edits + rows * LOGIT_EDIT_ROW_WORDS;
    __global float* l = logits + (size_t)h[0] * vocab;
    const uint v = (uint)vocab;
    const float rep = as_float(h[1]), presence = as_float(h[2]), frequency = as_float(h[3]);
    // The bias in list order by one work-item: a token listed twice gets both additions in order.
    if (lid == 0) {
        for (uint k = 0; k < h[5]; k++) {
            const uint t = arena[h[4] + 2 * k];
            if (t < v) l[t] = l[t] + as_float(arena[h[4] + 2 * k + 1]);
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    // Each token once in the seen and count lists: work-items never share an element.
    for (uint k = lid; k < h[7]; k += ROW_WG) {
        const uint t = arena[h[6] + k];
        if (t >= v) continue;
        const float x = l[t];
        l[t] = x > 0.f ? x / rep : x * rep;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (uint k = lid; k < h[9]; k += ROW_WG) {
        const uint t = arena[h[8] + 2 * k];
        if (t >= v) continue;
        const float pen = presence + frequency * (float)arena[h[8] + 2 * k + 1];
        l[t] = l[t] - pen;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    // Bans and the mask only write -inf, so they may overlap.
    for (uint k = lid; k < h[11]; k += ROW_WG) {
        const uint t = arena[h[10] + k];
        if (t < v) l[t] = -INFINITY;
    }
    if (h[12] != LOGIT_EDIT_NO_MASK) {
        __global const uint* mask = arena + h[12];
        for (uint t = lid; t < v; t += ROW_WG)
            if (!((mask[t >> 5] >> (t & 31)) & 1u)) l[t] = -INFINITY;
    }
}
