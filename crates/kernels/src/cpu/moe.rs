//! CPU side of the MoE and q/k-norm ops (see `crate::moe`): routing on the host, rows gathered
//! per expert, the experts' GEMMs in one parallel region through the panel kernel
//! ([`super::panel::matmul_grouped`]), and the router-weighted combine, every one row-wise.

use super::{amx, for_rows, panel};
use crate::moe::{ExpertData, ExpertWeights, HostRouting, MoeRouting, QkLayout, QkNorm, RoutingData};
use crate::{Tensor, WeightData};

fn host(route: &MoeRouting) -> &HostRouting {
    route.as_host().expect("CPU MoE op given routing in device memory")
}

/// RMSNorm of `x` in place, scaled by `w`: the arithmetic of the out-of-place row norm (every
/// value is read for the sum before any is written).
fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for (v, &wv) in x.iter_mut().zip(w) {
        *v = (*v * inv) * wv;
    }
}

pub(super) fn qk_norm(qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
    let QkLayout { q_out, kv_out, width, .. } = norm.layout(n_heads, n_kv_heads, head_dim);
    let (qw, kw) = (&norm.q.as_cpu()[..norm.q_group], &norm.k.as_cpu()[..norm.k_group]);
    let qkv = &mut qkv.as_cpu_mut()[..rows * width];
    let eps = norm.eps;
    for_rows(qkv, width, |_, row| {
        let (q, rest) = row.split_at_mut(q_out);
        q.chunks_mut(norm.q_group).for_each(|g| rms_norm_inplace(g, qw, eps));
        rest[..kv_out].chunks_mut(norm.k_group).for_each(|g| rms_norm_inplace(g, kw, eps));
    });
}

pub(super) fn route(logits: &Tensor, m: usize, route: &mut MoeRouting) {
    assert!(m <= route.max_rows, "MoE routing of {m} rows in buffers for {}", route.max_rows);
    let spec = route.spec;
    let RoutingData::Host(h) = &mut route.data else { panic!("CPU MoE op given routing in device memory") };
    h.route(&logits.as_cpu()[..m * spec.num_experts], m, spec);
    route.rows = m;
}

pub(super) fn gather(x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
    let h = host(route);
    let n = route.rows * route.spec.top_k;
    let x = x.as_cpu();
    let out = &mut out.as_cpu_mut()[..n * dim];
    for_rows(out, dim, |p, o| {
        let r = h.row_of[p] as usize;
        o.copy_from_slice(&x[r * dim..(r + 1) * dim]);
    });
}

pub(super) fn matmul(x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
    let h = host(route);
    let n = route.rows * route.spec.top_k;
    let ExpertData::PerExpert(ws) = &w.data else { panic!("CPU MoE matmul given experts in device memory") };
    assert_eq!(ws.len(), route.spec.num_experts, "MoE matmul: {} experts, routing over {}", ws.len(), route.spec.num_experts);
    let offsets = &h.offsets[..=route.spec.num_experts];
    let x = &x.as_cpu()[..n * w.cols];
    let y = &mut y.as_cpu_mut()[..n * w.rows];
    if ws.iter().all(|e| matches!(e.data, WeightData::Panels(_))) {
        let panel_of = |e: usize| match &ws[e].data {
            WeightData::Panels(p) => p,
            _ => unreachable!("checked above"),
        };
        return panel::matmul_grouped(x, y, offsets, &panel_of);
    }
    // AMX tiles (opt-in mode): one product per expert over its rows, same kernel at every M.
    for (e, wt) in ws.iter().enumerate() {
        let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
        if r1 == r0 {
            continue;
        }
        let (xs, ys) = (&x[r0 * w.cols..r1 * w.cols], &mut y[r0 * w.rows..r1 * w.rows]);
        match &wt.data {
            WeightData::Tiled(t) => amx::matmul(xs, r1 - r0, t, ys),
            WeightData::Panels(p) => panel::matmul(xs, r1 - r0, p, ys),
            _ => panic!("CPU MoE matmul given an expert weight not loaded through Device::load_experts"),
        }
    }
}

pub(super) fn combine(y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
    let h = host(route);
    let (m, k) = (route.rows, route.spec.top_k);
    let y = y.as_cpu();
    let out = &mut out.as_cpu_mut()[..m * dim];
    for_rows(out, dim, |r, o| {
        o.fill(0.0);
        for j in 0..k {
            let (wt, p) = (h.weight[r * k + j], h.pos_of[r * k + j] as usize);
            for (a, &b) in o.iter_mut().zip(&y[p * dim..(p + 1) * dim]) {
                *a += wt * b;
            }
        }
    });
}

pub(super) fn add_sigmoid_gated(out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
    let (x, g) = (x.as_cpu(), gate.as_cpu());
    let out = &mut out.as_cpu_mut()[..rows * dim];
    for_rows(out, dim, |r, o| {
        let s = 1.0 / (1.0 + (-g[r]).exp());
        for (a, &b) in o.iter_mut().zip(&x[r * dim..(r + 1) * dim]) {
            *a += s * b;
        }
    });
}
