//! The q/k-norm and mixture-of-experts ops against the CPU device (f32) on random inputs, for any
//! device: outputs poisoned with NaN, router logits on a coarse grid so that exact ties (which
//! the routing must give to the lower expert) are common, row counts that leave partial tiles
//! and experts with several tiles. Shared by `cuda_kernels.rs` and `opencl_kernels.rs`.

use super::*;
use quiver_kernels::moe::HostRouting;
use quiver_kernels::{MoeRouting, QkNorm, RouterSpec};

/// q/k RMSNorm per head (Qwen3) and over the whole projections (OLMoE); the whole row is
/// compared, so a touched v part fails too.
pub fn qk_norm_matches_cpu(g: &dyn Device) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("qk_norm");
    for &(rows, nh, nkv, hd, whole) in &[(1, 1, 1, 2, false), (7, 16, 4, 128, false), (3, 9, 3, 64, true), (33, 32, 4, 128, true), (5, 6, 2, 80, false)] {
        let (qg, kg) = if whole { (nh * hd, nkv * hd) } else { (hd, hd) };
        let width = (nh + 2 * nkv) * hd;
        let (x, wq, wk) = (r.vec(rows * width, 3.0), r.vec(qg, 1.0), r.vec(kg, 1.0));
        let norm = |d: &dyn Device| QkNorm { q: d.tensor_from(&wq), k: d.tensor_from(&wk), q_group: qg, k_group: kg, eps: 1e-6 };
        let (nc, ng) = (norm(&c), norm(g));
        let (mut xc, mut xg) = (c.tensor_from(&x), g.tensor_from(&x));
        c.qk_norm(&mut xc, rows, nh, nkv, hd, &nc);
        g.qk_norm(&mut xg, rows, nh, nkv, hd, &ng);
        check(&format!("qk_norm rows={rows} heads={nh}/{nkv} hd={hd} whole={whole}"), &host(g, &xg, rows * width), &xc.as_cpu()[..rows * width], 1e-5);
    }
}

/// Router logits on a grid of 1/8 in [-2, 2]: many exact ties, and distinct logits far enough
/// apart that no exp rounding can reorder them.
fn grid_logits(r: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (r.below(33) as f32 - 16.0) / 8.0).collect()
}

/// Routing of `m` rows (`spec`) as the device computes it and as the CPU does, each read back
/// with `read`: the same experts in the same choice order, the same grouping (offsets, row_of,
/// pos_of: the CPU's stable order), weights equal to f32 rounding. The device's buffers hold an
/// earlier routing of other logits first, so a value it leaves unwritten fails.
pub fn moe_routing_matches_cpu(g: &dyn Device, read: &dyn Fn(&MoeRouting) -> HostRouting) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("moe routing");
    for &(m, e, k, renorm) in &[(1, 8, 2, true), (13, 60, 4, false), (300, 128, 8, true), (5, 4, 4, false), (40, 64, 8, false), (7, 1, 1, true), (97, 1024, 3, true)] {
        let spec = RouterSpec { num_experts: e, top_k: k, renormalize: renorm };
        let mut rg = g.alloc_routing(m, spec);
        g.moe_route(&g.tensor_from(&grid_logits(&mut r, m * e)), m, &mut rg);
        let logits = grid_logits(&mut r, m * e);
        g.moe_route(&g.tensor_from(&logits), m, &mut rg);
        let mut rc = c.alloc_routing(m, spec);
        c.moe_route(&c.tensor_from(&logits), m, &mut rc);
        let (got, want) = (read(&rg), rc.as_host().unwrap());
        let n = m * k;
        let what = format!("routing m={m} experts={e} top{k} renorm={renorm}");
        assert_eq!(got.expert[..n], want.expert[..n], "{what}: chosen experts");
        assert_eq!(got.offsets[..=e], want.offsets[..=e], "{what}: offsets");
        assert_eq!(got.row_of[..n], want.row_of[..n], "{what}: row_of");
        assert_eq!(got.pos_of[..n], want.pos_of[..n], "{what}: pos_of");
        let worst = got.weight[..n].iter().zip(&want.weight[..n]).map(|(a, b)| ((a - b) / b).abs()).fold(0.0f32, f32::max);
        eprintln!("{what}: identical choices and grouping, weights within {worst:.1e}");
        assert!(worst <= 2e-6, "{what}: router weight off by {worst:e} (relative)");
    }
}

/// A whole MoE block on both devices: routing, gather, the grouped GEMMs over bf16 and f32
/// experts, SiLU·mul, combine; then the shared expert's sigmoid-gated add. With
/// `batch_invariant`, one row routed and run alone must give the bits it got in the batch.
pub fn moe_block_matches_cpu(g: &dyn Device, bf16_tol: f64, batch_invariant: bool) {
    let c = CpuDevice::new();
    let mut r = Rng::fresh("moe");
    // (rows, experts, top-k, hidden, expert intermediate, renormalise): decode; partial tiles;
    // 128 experts over 800 pairs; every expert taking every row (k = E); experts with 50+ rows
    // (several tiles, several GEMM tiles per tile); widths off every tile and DPAS step.
    for &(m, e, k, h, ie, renorm) in &[(1, 8, 2, 64, 32, true), (13, 16, 4, 96, 40, false), (100, 128, 8, 256, 96, true), (3, 4, 4, 33, 17, false), (70, 4, 3, 64, 48, true)] {
        let spec = RouterSpec { num_experts: e, top_k: k, renormalize: renorm };
        let logits = grid_logits(&mut r, m * e);
        let x = r.vec(m * h, 1.0);
        let gu: Vec<Vec<f32>> = (0..e).map(|_| r.vec(2 * ie * h, 0.3)).collect();
        let dn: Vec<Vec<f32>> = (0..e).map(|_| r.vec(h * ie, 0.3)).collect();
        let alone = r.below(m);
        let (base, gates) = (r.vec(m * h, 1.0), r.vec(m, 4.0));
        for dtype in [DType::Bf16, DType::F32] {
            let run = |d: &dyn Device| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
                let experts = |rows, cols, ws: &[Vec<f32>]| d.load_experts(rows, cols, ws.iter().map(|w| Weight::from_f32(rows, cols, w.clone(), dtype)).collect());
                let (wgu, wdn) = (experts(2 * ie, h, &gu), experts(h, ie, &dn));
                let mut route = d.alloc_routing(m + 3, spec);
                let block = |rows: usize, logits: &[f32], x: &[f32], route: &mut MoeRouting| {
                    d.moe_route(&d.tensor_from(logits), rows, route);
                    let (mut xp, mut gup, mut act, mut yp, mut out) = (poisoned(d, rows * k * h), poisoned(d, rows * k * 2 * ie), poisoned(d, rows * k * ie), poisoned(d, rows * k * h), poisoned(d, rows * h));
                    d.moe_gather(&d.tensor_from(x), h, route, &mut xp);
                    d.moe_matmul(&xp, route, &wgu, &mut gup);
                    d.silu_mul(&gup, rows * k, ie, &mut act);
                    d.moe_matmul(&act, route, &wdn, &mut yp);
                    d.moe_combine(&yp, route, h, &mut out);
                    host(d, &out, rows * h)
                };
                let moe = block(m, &logits, &x, &mut route);
                let one = block(1, &logits[alone * e..(alone + 1) * e], &x[alone * h..(alone + 1) * h], &mut route);
                let mut gated = d.tensor_from(&base);
                d.add_sigmoid_gated(&mut gated, &d.tensor_from(&x), &d.tensor_from(&gates), m, h);
                (moe, one, host(d, &gated, m * h))
            };
            let (mc, _, sc) = run(&c);
            let (mg, one, sg) = run(g);
            let tol = if dtype == DType::Bf16 { bf16_tol } else { 1e-5 };
            let what = format!("moe block m={m} experts={e} top{k} h={h} inter={ie} renorm={renorm} {dtype:?}");
            check(&what, &mg, &mc, tol);
            check(&format!("sigmoid-gated add m={m} h={h}"), &sg, &sc, 1e-5);
            if batch_invariant {
                let in_batch = &mg[alone * h..(alone + 1) * h];
                assert!(one.iter().zip(in_batch).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: row {alone} alone differs from the same row in the batch");
            }
        }
    }
}
