//! Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): weights, activation
//! buffers, and the block's forward as a sequence of device ops (see `quiver_kernels::moe`).
//!
//! A layer's rows are routed in f32 (router GEMM on an f32 weight whatever the model dtype,
//! softmax, top-k, optional renormalisation), grouped by expert, run through each expert's fused
//! gate/up GEMM, SiLU·mul and down GEMM over that expert's rows only, and summed back per row
//! with the router weights. Qwen2-MoE adds a dense shared expert scaled by a sigmoid gate.

use crate::config::MoeConfig;
use quiver_kernels::{Device, ExpertWeights, MoeRouting, RouterSpec, Tensor, Weight};
use quiver_lora::{ExpertSite, LoraHook};

/// A layer's MLP.
pub enum Mlp {
    /// `[2·intermediate, hidden]` (gate rows first) and `[hidden, intermediate]`.
    Dense { gate_up: Weight, down: Weight },
    Moe(Box<MoeWeights>),
}

pub struct MoeWeights {
    /// `[experts, hidden]`, f32.
    pub router: Weight,
    /// Per expert `[2·expert_intermediate, hidden]`, gate rows first.
    pub gate_up: ExpertWeights,
    /// Per expert `[hidden, expert_intermediate]`.
    pub down: ExpertWeights,
    pub shared: Option<SharedExpert>,
}

/// Qwen2-MoE's shared expert: a dense MLP whose output is scaled by `sigmoid(x · gateᵀ)`.
pub struct SharedExpert {
    pub gate_up: Weight,
    pub down: Weight,
    /// `[1, hidden]`, f32.
    pub gate: Weight,
}

/// Activation buffers of the MoE layers, for up to `tokens` rows (grown with the workspace).
pub struct MoeWorkspace {
    pub(crate) logits: Tensor,
    pub(crate) route: MoeRouting,
    /// Grouped rows: input, fused gate/up, activation, expert output.
    pub(crate) xp: Tensor,
    pub(crate) gu: Tensor,
    pub(crate) act: Tensor,
    pub(crate) yp: Tensor,
    /// Shared expert: fused gate/up, activation, output, gate logit.
    pub(crate) sgu: Tensor,
    pub(crate) sact: Tensor,
    pub(crate) sout: Tensor,
    pub(crate) sgate: Tensor,
}

pub(crate) fn router_spec(c: &MoeConfig) -> RouterSpec {
    RouterSpec { num_experts: c.num_experts, top_k: c.top_k, renormalize: c.norm_topk_prob }
}

impl MoeWorkspace {
    pub(crate) fn new(d: &dyn Device, c: &MoeConfig, hidden: usize, tokens: usize) -> Self {
        let (k, ie) = (c.top_k, c.expert_intermediate);
        let is = c.shared_expert_intermediate.unwrap_or(0);
        MoeWorkspace {
            logits: d.alloc(tokens * c.num_experts),
            route: d.alloc_routing(tokens, router_spec(c)),
            xp: d.alloc(tokens * k * hidden),
            gu: d.alloc(tokens * k * 2 * ie),
            act: d.alloc(tokens * k * ie),
            yp: d.alloc(tokens * k * hidden),
            sgu: d.alloc(tokens * 2 * is),
            sact: d.alloc(tokens * is),
            sout: d.alloc(if is > 0 { tokens * hidden } else { 0 }),
            sgate: d.alloc(if is > 0 { tokens } else { 0 }),
        }
    }
}

/// `out = MoE(xn)` for `m` rows of width `hidden`. With `lora` (the hook and this layer), each
/// routed row's adapter delta is added to its expert's gate/up and down outputs right after
/// that expert's GEMM, so the router weight scales it in the combine as it scales the base
/// output (PEFT wraps each expert's linears); the shared expert gets its delta like a dense MLP.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(d: &dyn Device, w: &MoeWeights, c: &MoeConfig, xn: &Tensor, m: usize, hidden: usize, ws: &mut MoeWorkspace, out: &mut Tensor, lora: Option<(&dyn LoraHook, usize)>) {
    let (k, ie) = (c.top_k, c.expert_intermediate);
    d.matmul(xn, m, &w.router, None, &mut ws.logits);
    d.moe_route(&ws.logits, m, &mut ws.route);
    d.moe_gather(xn, hidden, &ws.route, &mut ws.xp);
    d.moe_matmul(&ws.xp, &ws.route, &w.gate_up, &mut ws.gu);
    if let Some((h, l)) = lora {
        h.experts(d, l, ExpertSite::GateUp, &ws.route, &ws.xp, &mut ws.gu);
    }
    d.silu_mul(&ws.gu, m * k, ie, &mut ws.act);
    d.moe_matmul(&ws.act, &ws.route, &w.down, &mut ws.yp);
    if let Some((h, l)) = lora {
        h.experts(d, l, ExpertSite::Down, &ws.route, &ws.act, &mut ws.yp);
    }
    d.moe_combine(&ws.yp, &ws.route, hidden, out);
    if let Some(s) = &w.shared {
        let is = s.down.cols;
        debug_assert_eq!(s.gate_up.rows, 2 * is);
        match lora {
            Some((h, l)) => {
                d.matmul(xn, m, &s.gate_up, None, &mut ws.sgu);
                h.shared_expert(d, l, ExpertSite::GateUp, xn, m, &mut ws.sgu);
                d.silu_mul(&ws.sgu, m, is, &mut ws.sact);
            }
            None => d.matmul_silu_mul(xn, m, &s.gate_up, &mut ws.sgu, &mut ws.sact),
        }
        d.matmul(&ws.sact, m, &s.down, None, &mut ws.sout);
        if let Some((h, l)) = lora {
            h.shared_expert(d, l, ExpertSite::Down, &ws.sact, m, &mut ws.sout);
        }
        d.matmul(xn, m, &s.gate, None, &mut ws.sgate);
        d.add_sigmoid_gated(out, &ws.sout, &ws.sgate, m, hidden);
    }
}
