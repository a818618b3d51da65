//! Mixture-of-experts and q/k-norm ops on OpenCL (kernels in `moe.cl`; the grouped GEMM in
//! `gemm.cl` and, for bf16 experts on a DPAS set, `dpas.cl`). Routing and grouping stay on the
//! device: one kernel for each row's top-k, one single work-group kernel for the grouping (a
//! stable counting sort, so the routing equals the CPU device's) and the tile list the grouped
//! GEMM reads; no host round trip in a step. Experts are stacked in one `[E, out, in]` buffer,
//! and each work-group row of the grouped GEMM takes one tile of at most `MOE_TILE_M` rows of one
//! expert through the dense GEMM's own tiles, so a routed row gets the arithmetic of the dense
//! GEMM and nothing about it depends on its batch-mates.

use super::*;
use crate::moe::{expert_stack, ExpertData, ExpertWeights, HostRouting, MoeRouting, QkLayout, QkNorm, RouterSpec, RoutingData};

/// Expert ids staged per pass of `moe_group` (`MOE_CHUNK` in moe.cl).
const GROUP_CHUNK: usize = 256;

/// Local memory `moe_group` uses: a cursor per expert and the staged ids.
pub(super) const GROUP_LOCAL_BYTES: usize = (crate::moe::MAX_EXPERTS + GROUP_CHUNK) * 4;

/// One layer's routing in device memory: the arrays of [`HostRouting`] and the tile list of the
/// grouped GEMM (`[count, (start, rows, expert)…]`), each its own buffer.
pub struct ClRouting {
    expert: ClBuf,
    weight: ClBuf,
    offsets: ClBuf,
    row_of: ClBuf,
    pos_of: ClBuf,
    tiles: ClBuf,
}

/// Tiles of at most `tile_m` rows of one expert over `pairs` grouped rows, at most: every tile
/// holds a row, and each expert ends at most one partial tile.
fn max_tiles(pairs: usize, experts: usize, tile_m: usize) -> usize {
    pairs.min(pairs.div_ceil(tile_m) + experts)
}

fn routing(route: &MoeRouting) -> &ClRouting {
    match &route.data {
        RoutingData::OpenCl(r) => r,
        _ => panic!("OpenCL MoE op given routing of another device (allocate it with Device::alloc_routing)"),
    }
}

impl OpenClDevice {
    pub(super) fn qk_norm_impl(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
        if rows == 0 {
            return;
        }
        let QkLayout { q_out, groups, width, .. } = norm.layout(n_heads, n_kv_heads, head_dim);
        self.launch(
            "qk_norm",
            &[rows * ROW_WG, groups],
            Some(&[ROW_WG, 1]),
            &[Arg::Mem(mem(qkv)), Arg::Mem(mem(&norm.q)), Arg::Mem(mem(&norm.k)), Arg::I32(width as i32), Arg::I32(q_out as i32), Arg::I32(norm.q_group as i32), Arg::I32(norm.k_group as i32), Arg::F32(norm.eps)],
        );
    }

    pub(super) fn load_experts_impl(&self, rows: usize, cols: usize, experts: Vec<Weight>) -> ExpertWeights {
        let (dtype, per, stack) = expert_stack(&experts, rows, cols);
        let mut b = self.zeroed(stack.len() * per);
        for (i, bytes) in stack.iter().enumerate() {
            self.write(&mut b, i * per, bytes);
        }
        ExpertWeights { num_experts: stack.len(), rows, cols, data: ExpertData::OpenCl(b, dtype) }
    }

    pub(super) fn alloc_routing_impl(&self, max_rows: usize, spec: RouterSpec) -> MoeRouting {
        let pairs = max_rows * spec.top_k;
        let words = |n: usize| self.zeroed(n * 4);
        let r = ClRouting {
            expert: words(pairs),
            weight: words(pairs),
            offsets: words(spec.num_experts + 1),
            row_of: words(pairs),
            pos_of: words(pairs),
            tiles: words(1 + 3 * max_tiles(pairs, spec.num_experts, self.tiles.moe_tile_m)),
        };
        MoeRouting { max_rows, spec, rows: 0, data: RoutingData::OpenCl(r) }
    }

    pub(super) fn route_impl(&self, logits: &Tensor, m: usize, route: &mut MoeRouting) {
        assert!(m <= route.max_rows, "MoE routing of {m} rows in buffers for {}", route.max_rows);
        route.rows = m;
        if m == 0 {
            return;
        }
        let spec = route.spec;
        let r = routing(route);
        let (e, k) = (spec.num_experts as i32, spec.top_k as i32);
        self.launch("moe_topk", &[m], None, &[Arg::Mem(mem(logits)), Arg::Mem(r.expert.mem()), Arg::Mem(r.weight.mem()), Arg::I32(m as i32), Arg::I32(e), Arg::I32(k), Arg::I32(spec.renormalize as i32)]);
        self.launch(
            "moe_group",
            &[ROW_WG],
            Some(&[ROW_WG]),
            &[Arg::Mem(r.expert.mem()), Arg::Mem(r.offsets.mem()), Arg::Mem(r.row_of.mem()), Arg::Mem(r.pos_of.mem()), Arg::Mem(r.tiles.mem()), Arg::I32(m as i32 * k), Arg::I32(e), Arg::I32(k)],
        );
    }

    /// `out[p] = x[row_of[p]]`: the dense row gather with the routing's `row_of` as its rows.
    pub(super) fn gather_impl(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
        let n = route.rows * route.spec.top_k;
        if n == 0 {
            return;
        }
        let r = routing(route);
        self.launch("gather_rows", &[dim, n], None, &[Arg::Mem(mem(x)), Arg::Mem(r.row_of.mem()), Arg::I32(0), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::I32(n as i32)]);
    }

    pub(super) fn grouped_matmul_impl(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
        let pairs = route.rows * route.spec.top_k;
        if pairs == 0 {
            return;
        }
        assert_eq!(w.num_experts, route.spec.num_experts, "MoE matmul: {} experts, routing over {}", w.num_experts, route.spec.num_experts);
        let ExpertData::OpenCl(wb, dtype) = &w.data else { panic!("OpenCL MoE matmul given experts of another device (load them with Device::load_experts)") };
        let (n, k) = (w.rows, w.cols);
        let tiles = max_tiles(pairs, w.num_experts, self.tiles.moe_tile_m);
        let args = [Arg::Mem(mem(x)), Arg::Mem(wb.mem()), Arg::Mem(routing(route).tiles.mem()), Arg::Mem(mem(y)), Arg::I32(n as i32), Arg::I32(k as i32)];
        let t = &self.tiles;
        if let (Some(lanes), DType::Bf16) = (self.dpas_lanes(), dtype) {
            if gemm::dpas_fits(k) {
                return self.launch("dpas_moe_gemm_bf16", &[n.div_ceil(lanes * t.dpas_nt) * lanes, tiles], Some(&[lanes, 1]), &args);
            }
        }
        let name = if *dtype == DType::Bf16 { "moe_gemm_bf16" } else { "moe_gemm_f32" };
        self.launch(name, &[n, tiles * t.gemm_t], Some(&[t.gemm_t, t.gemm_t]), &args);
    }

    pub(super) fn combine_impl(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
        let m = route.rows;
        if m == 0 {
            return;
        }
        let r = routing(route);
        self.launch(
            "moe_combine",
            &[dim, m],
            None,
            &[Arg::Mem(mem(y)), Arg::Mem(r.weight.mem()), Arg::Mem(r.pos_of.mem()), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::I32(route.spec.top_k as i32), Arg::I32(m as i32)],
        );
    }

    pub(super) fn add_sigmoid_gated_impl(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
        if rows == 0 {
            return;
        }
        self.launch("add_sigmoid_gated", &[dim, rows], None, &[Arg::Mem(mem(out)), Arg::Mem(mem(x)), Arg::Mem(mem(gate)), Arg::I32(dim as i32), Arg::I32(rows as i32)]);
    }

    /// The last routing of `route` read back to the host (tests compare it with the CPU's).
    pub fn read_routing(&self, route: &MoeRouting) -> HostRouting {
        let r = routing(route);
        let (n, e) = (route.rows * route.spec.top_k, route.spec.num_experts);
        let words = |b: &ClBuf, len: usize| -> Vec<u32> {
            let mut v = vec![0u32; len];
            if len > 0 {
                // SAFETY: the buffer holds at least `len` words; blocking, so `v` is written on return.
                unsafe { self.queue.enqueue_read_buffer(&b.buf, CL_BLOCKING, 0, bytemuck::cast_slice_mut(&mut v), &[]) }.unwrap_or_else(|err| self.fail("routing read-back", err));
            }
            v
        };
        HostRouting {
            expert: words(&r.expert, n),
            weight: words(&r.weight, n).into_iter().map(f32::from_bits).collect(),
            offsets: words(&r.offsets, e + 1),
            row_of: words(&r.row_of, n),
            pos_of: words(&r.pos_of, n),
        }
    }
}
