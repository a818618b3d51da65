//! CUDA side of the mixture-of-experts and q/k-norm ops (kernels in `moe.cu`): routing and
//! grouping on the device (no host round trip, so MoE decode steps can be recorded as graphs:
//! every launch's shape depends on the row count only), experts stacked in one `[E, out, in]`
//! buffer, and a grouped GEMM over tiles of at most 8 positions of one expert, each warp reading
//! its output columns' weights once per tile with 16-byte loads. The grouped GEMM is FMA code,
//! not tensor cores: decode streams the experts' bytes; prefill is compute-bound there (see
//! BENCHMARKS.md for where it stands).

use super::{buf, grid1, row_threads, CudaDevice, DevBuf};
use crate::moe::{expert_stack, ExpertData, ExpertWeights, MoeRouting, QkLayout, QkNorm, RouterSpec, RoutingData};
use crate::{DType, Tensor, Weight};
use anyhow::Result;
use cudarc::driver::{result, sys};
use std::ffi::c_void;

/// Positions per tile (`MOE_TILE_M`) and output columns per block (`MOE_WARPS` ×
/// `MOE_COLS_PER_WARP`) of `moe.cu`.
const TILE_M: usize = 8;
const COLS_PER_BLOCK: usize = 32;
const MATMUL_THREADS: u32 = 256;

pub(super) struct MoeKernels {
    qk_norm: sys::CUfunction,
    topk: sys::CUfunction,
    group: sys::CUfunction,
    gather: sys::CUfunction,
    matmul_bf16: sys::CUfunction,
    matmul_f32: sys::CUfunction,
    combine: sys::CUfunction,
    sigmoid_gated: sys::CUfunction,
}

impl MoeKernels {
    pub(super) fn load(f: &dyn Fn(&str) -> Result<sys::CUfunction>) -> Result<Self> {
        Ok(MoeKernels {
            qk_norm: f("qk_norm")?,
            topk: f("moe_topk")?,
            group: f("moe_group")?,
            gather: f("moe_gather")?,
            matmul_bf16: f("moe_matmul_bf16")?,
            matmul_f32: f("moe_matmul_f32")?,
            combine: f("moe_combine")?,
            sigmoid_gated: f("add_sigmoid_gated")?,
        })
    }
}

/// One layer's routing in device memory: the arrays of [`crate::moe::HostRouting`] plus the
/// per-expert cursors and the tile list of the grouped GEMM, in one allocation.
pub struct DevRouting {
    _buf: DevBuf,
    expert: u64,
    weight: u64,
    offsets: u64,
    cursor: u64,
    row_of: u64,
    pos_of: u64,
    tiles: u64,
    tiles_n: u64,
}

/// Tiles of the grouped GEMM for `pairs` positions over `e` experts, at most.
fn max_tiles(pairs: usize, e: usize) -> usize {
    pairs.div_ceil(TILE_M) + e
}

/// Device addresses of the routing's per-pair expert and grouped position, `[m·k]` each.
pub(super) fn routing_pairs(route: &MoeRouting) -> (u64, u64) {
    let d = dev(route);
    (d.expert, d.pos_of)
}

fn dev(route: &MoeRouting) -> &DevRouting {
    match &route.data {
        RoutingData::Cuda(d) => d,
        _ => panic!("CUDA MoE op given routing of another device (allocate it with Device::alloc_routing)"),
    }
}

impl CudaDevice {
    pub(super) fn moe_qk_norm(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
        self.bind();
        if rows == 0 {
            return;
        }
        let QkLayout { q_out, groups, width, .. } = norm.layout(n_heads, n_kv_heads, head_dim);
        launch!(self, self.moe_k.qk_norm, (rows as u32, groups as u32, 1), row_threads(norm.q_group.max(norm.k_group));
            buf(qkv), buf(&norm.q), buf(&norm.k), width as i32, q_out as i32, norm.q_group as i32, norm.k_group as i32, norm.eps);
        self.mark("qk_norm");
    }

    pub(super) fn moe_load_experts(&self, rows: usize, cols: usize, experts: Vec<Weight>) -> ExpertWeights {
        self.bind();
        let (dtype, per, stack) = expert_stack(&experts, rows, cols);
        let b = DevBuf::zeroed(&self.ctx, stack.len() * per).unwrap_or_else(|e| panic!("experts on {}: {e:#}", self.name));
        for (i, bytes) in stack.iter().enumerate() {
            self.htod(b.ptr + (i * per) as u64, bytes);
        }
        ExpertWeights { num_experts: stack.len(), rows, cols, data: ExpertData::Cuda(b, dtype) }
    }

    pub(super) fn moe_alloc_routing(&self, max_rows: usize, spec: RouterSpec) -> MoeRouting {
        self.bind();
        let pairs = max_rows * spec.top_k;
        let e = spec.num_experts;
        let tiles = max_tiles(pairs, e);
        // expert, weight, row_of, pos_of: one word per pair; offsets E + 1; cursors E; tiles 3
        // words each; the tile count one.
        let words = 4 * pairs + (e + 1) + e + 3 * tiles + 1;
        let b = DevBuf::zeroed(&self.ctx, words * 4).unwrap_or_else(|e| panic!("MoE routing on {}: {e:#}", self.name));
        let mut at = b.ptr;
        let mut take = |n: usize| {
            let p = at;
            at += (n * 4) as u64;
            p
        };
        // Expert LoRA runs over every routed position: the LoRA scratch a step reserves holds
        // top-k rows per token row.
        {
            let mut g = self.lora_geom.lock().unwrap();
            g.pairs_per_row = g.pairs_per_row.max(spec.top_k);
        }
        let d = DevRouting {
            expert: take(pairs),
            weight: take(pairs),
            row_of: take(pairs),
            pos_of: take(pairs),
            offsets: take(e + 1),
            cursor: take(e),
            tiles: take(3 * tiles),
            tiles_n: take(1),
            _buf: b,
        };
        MoeRouting { max_rows, spec, rows: 0, data: RoutingData::Cuda(d) }
    }

    pub(super) fn moe_route_rows(&self, logits: &Tensor, m: usize, route: &mut MoeRouting) {
        self.bind();
        assert!(m <= route.max_rows, "MoE routing of {m} rows in buffers for {}", route.max_rows);
        route.rows = m;
        if m == 0 {
            return;
        }
        let spec = route.spec;
        let d = dev(route);
        assert!(spec.num_experts <= 1024, "MoE routing over {} experts: the CUDA top-k takes at most 1024", spec.num_experts);
        launch!(self, self.moe_k.topk, grid1(m, 4), (128, 1, 1); buf(logits), d.expert, d.weight, m as i32, spec.num_experts as i32, spec.top_k as i32, spec.renormalize as i32);
        launch!(self, self.moe_k.group, (1, 1, 1), (1024, 1, 1), smem = (spec.num_experts * 4) as u32;
            d.expert, d.offsets, d.cursor, d.row_of, d.pos_of, d.tiles, d.tiles_n, (m * spec.top_k) as i32, spec.num_experts as i32, spec.top_k as i32);
        self.mark("moe route");
    }

    pub(super) fn moe_gather_rows(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
        self.bind();
        let n = route.rows * route.spec.top_k;
        if n == 0 {
            return;
        }
        launch!(self, self.moe_k.gather, (n as u32, 1, 1), row_threads(dim); buf(x), dev(route).row_of, buf(out), dim as i32);
        self.mark("moe gather");
    }

    pub(super) fn moe_grouped_matmul(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
        self.bind();
        let pairs = route.rows * route.spec.top_k;
        if pairs == 0 {
            return;
        }
        let ExpertData::Cuda(wb, dtype) = &w.data else { panic!("CUDA MoE matmul given host experts (load them with Device::load_experts)") };
        let f = if *dtype == DType::Bf16 { self.moe_k.matmul_bf16 } else { self.moe_k.matmul_f32 };
        let d = dev(route);
        let grid = (max_tiles(pairs, route.spec.num_experts) as u32, w.rows.div_ceil(COLS_PER_BLOCK) as u32, 1);
        // 16-byte loads of weights and activation rows where every row starts 16-byte aligned.
        let per_load = if *dtype == DType::Bf16 { 8 } else { 4 };
        let vec = w.cols % per_load == 0 && buf(x) % 16 == 0 && wb.ptr % 16 == 0;
        launch!(self, f, grid, (MATMUL_THREADS, 1, 1); buf(x), wb.ptr, d.tiles, d.tiles_n, buf(y), w.rows as i32, w.cols as i32, vec as i32);
        self.mark("moe matmul");
    }

    pub(super) fn moe_combine_rows(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
        self.bind();
        if route.rows == 0 {
            return;
        }
        let d = dev(route);
        launch!(self, self.moe_k.combine, (route.rows as u32, 1, 1), row_threads(dim); buf(y), d.weight, d.pos_of, buf(out), dim as i32, route.spec.top_k as i32);
        self.mark("moe combine");
    }

    /// The last routing of `route` read back to the host, after the work queued before it
    /// (tests compare it with the CPU's; the order within an expert is the device's own).
    pub fn read_routing(&self, route: &MoeRouting) -> crate::moe::HostRouting {
        self.bind();
        self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
        let d = dev(route);
        let (n, e) = (route.rows * route.spec.top_k, route.spec.num_experts);
        let words = |ptr: u64, len: usize| -> Vec<u32> {
            let mut v = vec![0u32; len];
            if len > 0 {
                // SAFETY: the routing buffer holds at least `len` words at `ptr`; a blocking copy.
                unsafe { result::memcpy_dtoh_sync(&mut v, ptr) }.unwrap_or_else(|err| panic!("routing read-back on {}: {err:?}", self.name));
            }
            v
        };
        crate::moe::HostRouting {
            expert: words(d.expert, n),
            weight: words(d.weight, n).into_iter().map(f32::from_bits).collect(),
            offsets: words(d.offsets, e + 1),
            row_of: words(d.row_of, n),
            pos_of: words(d.pos_of, n),
        }
    }

    pub(super) fn moe_add_sigmoid_gated(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
        self.bind();
        if rows == 0 {
            return;
        }
        launch!(self, self.moe_k.sigmoid_gated, grid1(rows * dim, 256), (256, 1, 1); buf(out), buf(x), buf(gate), dim as i32, (rows * dim) as i64);
        self.mark("sigmoid gated add");
    }
}
