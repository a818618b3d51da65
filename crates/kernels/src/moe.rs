//! Data the mixture-of-experts and q/k-norm ops of [`crate::Device`] work on: stacked expert
//! weights, a layer's routing (each row's top-k experts, and the rows grouped by expert), and
//! the q/k RMSNorm weights of Qwen3 and OLMoE attention.
//!
//! # How an MoE layer runs (see `quiver_model::moe`)
//! 1. router logits `[m, E]` by an f32 GEMM; [`crate::Device::moe_route`]: softmax in f32, the
//!    top k per row (ties to the lower expert), optionally renormalised over the k, then the
//!    `m·k` (row, choice) pairs grouped by expert, in row order within an expert;
//! 2. [`crate::Device::moe_gather`]: the grouped rows of the layer input, `[m·k, hidden]`;
//! 3. [`crate::Device::moe_matmul`] by the experts' fused `[gate; up]`, SiLU·mul, and again by
//!    their `down`: each expert's rows are one GEMM against that expert's weight;
//! 4. [`crate::Device::moe_combine`]: each row's output is the router-weighted sum of its k
//!    expert outputs, in the order of its choices (top-1 first).
//!
//! Nothing about a row depends on the other rows of the batch: the CPU GEMM computes every
//! element with one chain over k whatever rows share the call, and the combine order is the
//! row's own. So MoE keeps the CPU's batch invariance.

use crate::{DType, Weight, WeightData};

/// `E` weights of one shape `[rows, cols]` (an expert's fused gate/up or its down), loaded
/// through [`crate::Device::load_experts`].
pub struct ExpertWeights {
    pub num_experts: usize,
    /// Output width of one expert.
    pub rows: usize,
    /// Input width.
    pub cols: usize,
    pub data: ExpertData,
}

pub enum ExpertData {
    /// One device-loaded weight per expert (the CPU: each in its own panels).
    PerExpert(Vec<Weight>),
    /// All experts in one `[E, rows, cols]` buffer in device memory.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DevBuf, DType),
    /// All experts in one `[E, rows, cols]` buffer in an OpenCL device's memory.
    OpenCl(crate::opencl::ClBuf, DType),
}

impl ExpertWeights {
    pub fn dtype(&self) -> DType {
        match &self.data {
            ExpertData::PerExpert(w) => w.first().map_or(DType::F32, Weight::dtype),
            #[cfg(feature = "cuda")]
            ExpertData::Cuda(_, d) => *d,
            ExpertData::OpenCl(_, d) => *d,
        }
    }
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            ExpertData::PerExpert(w) => w.iter().map(Weight::size_bytes).sum(),
            #[cfg(feature = "cuda")]
            ExpertData::Cuda(b, _) => b.bytes(),
            ExpertData::OpenCl(b, _) => b.bytes(),
        }
    }
}

/// What a device stacks into one `[E, rows, cols]` buffer: the experts' dtype (the first's), the
/// bytes of one expert, and each expert's bytes in order. Panics on an expert of another shape or
/// dtype, or one that is not a host weight.
pub fn expert_stack(experts: &[Weight], rows: usize, cols: usize) -> (DType, usize, Vec<&[u8]>) {
    let dtype = experts.first().map_or(DType::Bf16, Weight::dtype);
    let per = rows * cols * if dtype == DType::Bf16 { 2 } else { 4 };
    let bytes = experts
        .iter()
        .enumerate()
        .map(|(i, w)| {
            assert_eq!((w.rows, w.cols), (rows, cols), "expert {i} is [{}, {}], expected [{rows}, {cols}]", w.rows, w.cols);
            match (&w.data, dtype) {
                (WeightData::Bf16(v), DType::Bf16) => bytemuck::cast_slice(&v[..]),
                (WeightData::F32(v), DType::F32) => bytemuck::cast_slice(&v[..]),
                _ => panic!("load_experts: expert {i} is not a host weight of the first expert's dtype"),
            }
        })
        .collect();
    (dtype, per, bytes)
}

/// How router probabilities become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterSpec {
    pub num_experts: usize,
    pub top_k: usize,
    /// Divide the k chosen probabilities by their sum (Mixtral, Qwen3-MoE's `norm_topk_prob`);
    /// otherwise they stay softmax probabilities over all experts (Qwen2-MoE, OLMoE).
    pub renormalize: bool,
}

/// One layer's routing of up to `max_rows` rows, in the device's memory. Reused across layers
/// and steps (allocated with the workspace, so a step does not allocate).
pub struct MoeRouting {
    pub max_rows: usize,
    pub spec: RouterSpec,
    /// Rows routed by the last [`crate::Device::moe_route`].
    pub rows: usize,
    pub data: RoutingData,
}

pub enum RoutingData {
    Host(HostRouting),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::moe::DevRouting),
    OpenCl(crate::opencl::ClRouting),
}

/// Routing in host memory. Pair `(r, j)` is row r's j-th choice (best first), index `r·k + j`.
#[derive(Default)]
pub struct HostRouting {
    /// Expert of each pair, `[m·k]`.
    pub expert: Vec<u32>,
    /// Router weight of each pair, `[m·k]`.
    pub weight: Vec<f32>,
    /// Grouped order: expert e's pairs sit at positions `offsets[e]..offsets[e + 1]`, `[E + 1]`.
    pub offsets: Vec<u32>,
    /// Source row of each grouped position, `[m·k]`.
    pub row_of: Vec<u32>,
    /// Grouped position of each pair, `[m·k]`.
    pub pos_of: Vec<u32>,
}

impl MoeRouting {
    /// Host routing for up to `max_rows` rows (the default of [`crate::Device::alloc_routing`]).
    pub fn host(max_rows: usize, spec: RouterSpec) -> Self {
        let n = max_rows * spec.top_k;
        MoeRouting {
            max_rows,
            spec,
            rows: 0,
            data: RoutingData::Host(HostRouting {
                expert: vec![0; n],
                weight: vec![0.0; n],
                offsets: vec![0; spec.num_experts + 1],
                row_of: vec![0; n],
                pos_of: vec![0; n],
            }),
        }
    }
    /// The host copy, when the routing lives on the host.
    pub fn as_host(&self) -> Option<&HostRouting> {
        match &self.data {
            RoutingData::Host(h) => Some(h),
            _ => None,
        }
    }
}

impl HostRouting {
    /// Routes `m` rows of router logits `[m, E]` as `spec` says, grouping the pairs by expert.
    /// Softmax and normalisation in f32 as transformers does (`softmax(dtype=float)`, top-k,
    /// `/= sum`); exp is libm's, the max subtracted first.
    pub fn route(&mut self, logits: &[f32], m: usize, spec: RouterSpec) {
        let (e, k) = (spec.num_experts, spec.top_k);
        let mut probs = [0.0f32; MAX_EXPERTS];
        for r in 0..m {
            let row = &logits[r * e..(r + 1) * e];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for (p, &l) in probs.iter_mut().zip(row) {
                *p = (l - max).exp();
                sum += *p;
            }
            for p in &mut probs[..e] {
                *p /= sum;
            }
            let (ids, ws) = (&mut self.expert[r * k..(r + 1) * k], &mut self.weight[r * k..(r + 1) * k]);
            for j in 0..k {
                // The largest probability not chosen yet; ties go to the lower expert.
                let mut best = usize::MAX;
                for x in 0..e {
                    if ids[..j].contains(&(x as u32)) {
                        continue;
                    }
                    if best == usize::MAX || probs[x] > probs[best] {
                        best = x;
                    }
                }
                ids[j] = best as u32;
                ws[j] = probs[best];
            }
            if spec.renormalize {
                let s: f32 = ws.iter().sum();
                ws.iter_mut().for_each(|w| *w /= s);
            }
        }
        // Counting sort by expert, stable in (row, choice) order.
        let n = m * k;
        self.offsets[..=e].fill(0);
        for &x in &self.expert[..n] {
            self.offsets[x as usize + 1] += 1;
        }
        for x in 0..e {
            self.offsets[x + 1] += self.offsets[x];
        }
        // `offsets[x]` is expert x's cursor while the pairs are placed.
        for i in 0..n {
            let x = self.expert[i] as usize;
            let p = self.offsets[x] as usize;
            self.offsets[x] += 1;
            self.pos_of[i] = p as u32;
            self.row_of[p] = (i / k) as u32;
        }
        // The cursors ended at the next expert's start: shift back.
        for x in (1..=e).rev() {
            self.offsets[x] = self.offsets[x - 1];
        }
        self.offsets[0] = 0;
    }
}

/// Most experts a router may have (a stack buffer of probabilities per row).
pub const MAX_EXPERTS: usize = 1024;

/// q/k RMSNorm before RoPE: the q part of a fused qkv row in groups of `q_group` values, each
/// scaled by `q` (length `q_group`), the k part likewise. Qwen3 normalises every head
/// (`q_group = k_group = head_dim`); OLMoE the whole q and the whole k projection.
pub struct QkNorm {
    pub q: crate::Tensor,
    pub k: crate::Tensor,
    pub q_group: usize,
    pub k_group: usize,
    pub eps: f32,
}

/// Where the q/k-norm groups lie in a fused `[q | k | v]` row.
pub struct QkLayout {
    /// Widths of the q part and of the k (and v) part.
    pub q_out: usize,
    pub kv_out: usize,
    /// Groups normalised per row: q's, then k's.
    pub groups: usize,
    /// The whole row.
    pub width: usize,
}

impl QkNorm {
    /// The layout of a row of `n_heads` q and `n_kv_heads` k/v heads; panics when the groups do
    /// not divide the q and k parts.
    pub fn layout(&self, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> QkLayout {
        let (q_out, kv_out) = (n_heads * head_dim, n_kv_heads * head_dim);
        assert!(q_out.is_multiple_of(self.q_group) && kv_out.is_multiple_of(self.k_group), "qk_norm groups {} / {} do not divide q {q_out} / k {kv_out}", self.q_group, self.k_group);
        QkLayout { q_out, kv_out, groups: q_out / self.q_group + kv_out / self.k_group, width: q_out + 2 * kv_out }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Top-k with ties to the lower expert, renormalisation, and a stable grouping: every pair
    /// sits in its expert's range, rows in order within it, `row_of`/`pos_of` inverse.
    #[test]
    fn routing_picks_top_k_and_groups_pairs_by_expert_in_row_order() {
        let spec = RouterSpec { num_experts: 4, top_k: 2, renormalize: true };
        let logits = [0.0, 2.0, 1.0, -1.0, /* row 1 */ 3.0, 3.0, 0.0, 0.0, /* row 2 */ 0.0, 0.0, 0.0, 5.0];
        let mut h = HostRouting { expert: vec![0; 6], weight: vec![0.0; 6], offsets: vec![0; 5], row_of: vec![0; 6], pos_of: vec![0; 6] };
        h.route(&logits, 3, spec);
        assert_eq!(h.expert, [1, 2, 0, 1, 3, 0]);
        for r in 0..3 {
            let s: f32 = h.weight[2 * r..2 * r + 2].iter().sum();
            assert!((s - 1.0).abs() < 1e-6, "row {r} weights sum to {s}");
        }
        assert!((h.weight[0] / h.weight[1] - 1f32.exp()).abs() < 1e-5, "softmax ratio e^(2-1)");
        assert_eq!(h.offsets, [0, 2, 4, 5, 6]);
        assert_eq!(h.row_of, [1, 2, 0, 1, 0, 2]);
        for i in 0..6 {
            assert_eq!(h.row_of[h.pos_of[i] as usize] as usize, i / 2, "pair {i}");
            let e = h.expert[i] as usize;
            assert!((h.offsets[e]..h.offsets[e + 1]).contains(&h.pos_of[i]), "pair {i} outside expert {e}'s range");
        }
        let plain = RouterSpec { renormalize: false, ..spec };
        h.route(&logits, 3, plain);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|l| (l - 2.0).exp()).sum();
        assert!((h.weight[0] - 1.0 / z).abs() < 1e-6, "without renormalisation the weight is the softmax probability");
    }
}
