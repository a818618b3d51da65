// Mixture-of-experts and q/k-norm kernels (host side in moe.rs), portable OpenCL C 1.2; the
// experts' grouped GEMM is beside the weight GEMM it shares its tiles with (gemm.cl, dpas.cl).
//
// Routing layout (moe.rs: ClRouting), one buffer per array: pair i = r·k + j is row r's j-th
// choice (best first); `expert` and `weight` per pair; the pairs grouped by expert, expert e's at
// positions offsets[e] .. offsets[e+1], in (row, choice) order within an expert (the CPU's stable
// counting sort, so the whole routing equals the CPU device's); `row_of` per grouped position,
// `pos_of` per pair; `tiles` = [count, then (start, rows, expert) per tile]: runs of at most
// MOE_TILE_M positions of one expert, one work-group row of the grouped GEMM each.
//
// Every value of a row comes from that row alone (routing per row, the GEMM's chain over k per
// element, the combine in the row's own choice order), so the device keeps its batch invariance.

#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 1024
#endif
#ifndef MOE_TILE_M
#define MOE_TILE_M 32
#endif
// Expert ids staged in local memory per pass of the grouping.
#define MOE_CHUNK 256

// RMSNorm in place over groups of the q and k parts of a fused qkv row: work-group (row, group),
// groups [0, q_out/qg) are q's, then k's (Qwen3: one per head; OLMoE: the whole projection).
__kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void qk_norm(__global float* qkv, __global const float* wq, __global const float* wk, int width, int q_out, int qg, int kg, float eps) {
    __local float sh[ROW_WG];
    const int g = get_group_id(1), nq = q_out / qg;
    const bool is_q = g < nq;
    __global float* x = qkv + (size_t)get_group_id(0) * width + (is_q ? (size_t)g * qg : (size_t)q_out + (size_t)(g - nq) * kg);
    row_rms_norm(x, is_q ? wq : wk, x, is_q ? qg : kg, eps, sh);
}

// Softmax over each row's E router logits in f32, its top k (ties to the lower expert), optionally
// renormalised over the k: the CPU's HostRouting::route. One work-item per row; a probability is
// recomputed where it is compared (the same value each time) rather than held for all E experts.
__kernel void moe_topk(__global const float* logits, __global u32* expert, __global float* weight, int m, int E, int k, int renorm) {
    const int r = get_global_id(0);
    if (r >= m) return;
    __global const float* l = logits + (size_t)r * E;
    float mx = -INFINITY;
    for (int x = 0; x < E; x++) mx = fmax(mx, l[x]);
    float sum = 0.f;
    for (int x = 0; x < E; x++) sum += exp(l[x] - mx);
    __global u32* ids = expert + (size_t)r * k;
    __global float* ws = weight + (size_t)r * k;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bp = 0.f;
        for (int x = 0; x < E; x++) {
            bool taken = false;
            for (int t = 0; t < j; t++) taken |= ids[t] == (u32)x;
            if (taken) continue;
            const float p = exp(l[x] - mx) / sum;
            if (best < 0 || p > bp) {
                best = x;
                bp = p;
            }
        }
        ids[j] = (u32)best;
        ws[j] = bp;
    }
    if (renorm) {
        float s = 0.f;
        for (int j = 0; j < k; j++) s += ws[j];
        for (int j = 0; j < k; j++) ws[j] /= s;
    }
}

// Groups the n pairs by expert, stable in pair order, and lists the GEMM's tiles: one work-group
// of ROW_WG. Each work-item owns experts lid, lid + ROW_WG, ... and scans the pairs (staged
// MOE_CHUNK at a time in local memory) twice: once counting its experts' pairs, once placing
// them; work-item 0 turns the counts into offsets and tiles in between. No atomics, so the
// positions are the CPU's counting sort exactly.
__kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void moe_group(__global const u32* expert, __global u32* offsets, __global u32* row_of, __global u32* pos_of, __global u32* tiles, int n, int E, int k) {
    __local u32 cursor[MOE_MAX_EXPERTS];
    __local u32 ids[MOE_CHUNK];
    const int lid = get_local_id(0);
    for (int e = lid; e < E; e += ROW_WG) cursor[e] = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int base = 0; base < n; base += MOE_CHUNK) {
            const int len = min(MOE_CHUNK, n - base);
            barrier(CLK_LOCAL_MEM_FENCE); // the previous chunk's readers are done
            for (int i = lid; i < len; i += ROW_WG) ids[i] = expert[base + i];
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int e = lid; e < E; e += ROW_WG) {
                u32 c = cursor[e];
                for (int i = 0; i < len; i++) {
                    if (ids[i] != (u32)e) continue;
                    if (pass == 1) {
                        pos_of[base + i] = c;
                        row_of[c] = (u32)((base + i) / k);
                    }
                    c++;
                }
                cursor[e] = c;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (pass == 0 && lid == 0) {
            u32 off = 0, t = 0;
            for (int e = 0; e < E; e++) {
                const u32 count = cursor[e];
                offsets[e] = off;
                cursor[e] = off;
                for (u32 s = 0; s < count; s += MOE_TILE_M) {
                    tiles[1 + 3 * t] = off + s;
                    tiles[2 + 3 * t] = min((u32)MOE_TILE_M, count - s);
                    tiles[3 + 3 * t] = (u32)e;
                    t++;
                }
                off += count;
            }
            offsets[E] = off;
            tiles[0] = t;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

// out[r] = Σ_j weight[r·k + j] · y[pos_of[r·k + j]], the row's choices in order. Work-item
// (element, row).
__kernel void moe_combine(__global const float* y, __global const float* weight, __global const u32* pos_of, __global float* out, int dim, int k, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= dim || r >= rows) return;
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc += weight[r * k + j] * y[(size_t)pos_of[r * k + j] * dim + i];
    out[(size_t)r * dim + i] = acc;
}

// out[r] += sigmoid(gate[r]) · x[r] (Qwen2-MoE's shared expert). Work-item (element, row).
__kernel void add_sigmoid_gated(__global float* out, __global const float* x, __global const float* gate, int dim, int rows) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= dim || r >= rows) return;
    const float s = 1.f / (1.f + exp(-gate[r]));
    out[(size_t)r * dim + i] += s * x[(size_t)r * dim + i];
}
