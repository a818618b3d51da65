//! A LoRA site's expand inside its projection's epilogue (kernels `rope_qk_lora` and
//! `silu_mul_lora` in `lora_epilogue.cu`), for qkv and gate_up when the RMSNorm before them has
//! computed their shrink (`lora_ahead.rs`).
//!
//! Why: in a decode step every LoRA launch of its own costs a few microseconds of latency on
//! the step's critical path, or a fork and a join of the side stream that end the programmatic
//! overlap between the kernels around them; session 22 measured +10.5% of step time at 16 rows
//! with one rank-16 adapter on an 8B model (H100), against well under 1% of the step's bytes.
//! With the shrink in the norm and the expand in the RoPE / SiLU·mul that follows the GEMM
//! anyway, qkv's and gate_up's deltas cost no launch at all: only their bytes (the slot's Bᵀ
//! per row, from L2 when rows share an adapter) inside kernels that were already per row.
//! It is the default on sm_90 (the norm's shrink from two rows; `QUIVER_CUDA_LORA_EPILOGUE=0`
//! puts every site's delta beside its GEMM again, `lora_rows.rs` / `lora.rs`); o_proj and
//! down_proj keep their delta beside the GEMM (`lora_rows.rs`).
//!
//! With `QUIVER_CUDA_LORA_EPILOGUE=2` o_proj's and down_proj's deltas launch nothing either. Their
//! epilogue is `Residual`: the caller adds the output into the residual next, through the norm
//! before the next projection (or `add_rms_norm` / `add_inplace`). So the projection runs its GEMM
//! alone and leaves a [`Deferred`] record; the next norm's kernel (`rms_norm_lora2_*` in
//! lora_ahead.cu) computes that site's shrink from the site's input rows and adds its expand into
//! the residual with the GEMM output, then norms and computes the next site's shrink as before.
//! Any other consumer, or a norm the fused kernel does not fit, first adds the deferred delta
//! with the one-launch kernel (`lora_rows.rs`), so a deferral never outlives the op after it.

use super::lora::LoraSite;
use super::*;
use crate::lora::LoraCall;

/// A Residual site's delta not yet added: its input rows, its site, and the residual it goes to.
#[derive(Clone, Copy)]
pub(super) struct Deferred {
    resid: u64,
    rows: usize,
    pub(super) x: u64,
    pub(super) site: LoraSite,
    /// The one-launch delta kernel for this site and row count, for a consumer that does not
    /// fuse it.
    rows_kernel: sys::CUfunction,
}

impl Deferred {
    /// Whether the norm of `rows` rows of width `dim` over the residual `resid`, reading the
    /// groups at `gp`, can add this delta in its kernel.
    pub(super) fn fits_norm(&self, resid: u64, rows: usize, dim: usize, gp: u64) -> bool {
        self.resid == resid && self.rows == rows && self.site.shape.out_dim() == dim && self.site.gp == gp
    }
}

/// Threads per block (`LEP_THREADS`).
const THREADS: usize = 128;
/// Widest shrink the kernels hold (`LEP_MAX_W`).
const MAX_WIDTH: usize = 192;

impl CudaDevice {
    /// Whether `epilogue` over `call`'s output can add the delta itself from a shrink computed
    /// ahead: RoPE over whole heads of a width of 16s, or SiLU·mul of an 8-aligned half;
    /// 16-byte Bᵀ rows; the delta covering the whole output.
    pub(super) fn lora_epilogue_fits(&self, call: &LoraCall<'_>, epilogue: &Epilogue<'_>, w: &Weight) -> bool {
        let sh = call.shape();
        if self.lora_epilogue == 0 || sh.out_dim() != w.rows || !sh.b_ld.is_multiple_of(8) || sh.shrink_width() > MAX_WIDTH {
            return false;
        }
        match epilogue {
            Epilogue::RopeQk { n_heads, n_kv_heads, table, .. } => {
                let hd = table.head_dim;
                table.rotary_dim == hd && hd.is_multiple_of(16) && (n_heads + 2 * n_kv_heads) * hd == w.rows && (n_kv_heads * hd).is_multiple_of(8)
            }
            Epilogue::SiluMul { .. } => w.rows.is_multiple_of(16),
            _ => false,
        }
    }

    /// The base projection of `m` rows, then `epilogue` with `call`'s delta from the shrink `t`
    /// computed ahead (where [`Self::lora_epilogue_fits`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_lora_epilogue(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, call: &LoraCall<'_>, t: u64, epilogue: Epilogue<'_>, y: &mut Tensor) {
        self.matmul_impl(x, m, w, bias, y);
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, call) else {
            drop(st);
            return epilogue.run(self, y, m, w);
        };
        let sh = site.shape;
        let (cap, n_slices, r, b_ld, off1, off2) = (site.cap as i32, sh.n_slices as i32, sh.max_rank as i32, sh.b_ld as i32, site.off(1) as i32, site.off(2) as i32);
        match epilogue {
            Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => {
                let (hd, heads_qk) = (table.head_dim, n_heads + n_kv_heads);
                let units = heads_qk * hd / 16 + n_kv_heads * hd / 8;
                let pp = self.meta_ptr(&mut st, &positions[..m]);
                launch!(self, self.k.rope_qk_lora, (units.div_ceil(THREADS) as u32, m as u32, 1), (THREADS as u32, 1, 1);
                    buf(y), pp, buf(&table.cos), buf(&table.sin), heads_qk as i32, hd as i32, (hd / 2) as i32, w.rows as i32, table.max_pos as i32,
                    t, site.b, site.gp, cap, site.ranks, site.scal, n_slices, r, b_ld, off1, off2);
                self.mark("rope + lora expand");
            }
            Epilogue::SiluMul { out } => {
                let inter = w.rows / 2;
                let ob = self.shadow_for(&mut st, m, inter);
                launch!(self, self.k.silu_mul_lora, ((inter / 8).div_ceil(THREADS) as u32, m as u32, 1), (THREADS as u32, 1, 1);
                    buf(y), buf(out), ob.ptr, inter as i32, ob.ld as i32, t, site.b, site.gp, cap, site.ranks, site.scal, n_slices, r, b_ld, off1, off2);
                self.set_shadow(&mut st, ob, buf(out), m * inter);
                self.mark("silu_mul + lora expand");
            }
            _ => unreachable!("checked by lora_epilogue_fits"),
        }
    }
}

impl CudaDevice {
    /// Leaves `call`'s delta over the `m` rows of `x` for the next norm to add into `resid`
    /// (see the module docs); false, with nothing recorded, where that does not apply: a
    /// single-slice site of rank ≤ 64 whose input splits into the norm's cluster, in a step the
    /// one-launch kernel takes.
    pub(super) fn defer_lora(&self, call: &LoraCall<'_>, x: &Tensor, m: usize, resid: &Tensor) -> bool {
        let sh = call.shape();
        // The norm's cluster splits the inputs 8 ways, each lane holding at most 8 16-byte
        // chunks of its block's slice (`LAH_PREV_CPL`): in_dim ≤ 16384.
        if self.lora_epilogue != 2 || sh.n_slices != 1 || sh.max_rank > 64 || !sh.in_dim.is_multiple_of(64) || sh.in_dim > 16384 || !sh.b_ld.is_multiple_of(4) || !sh.out_dim().is_multiple_of(64) {
            return false;
        }
        let Some(rows_kernel) = self.lora_rows_kernel(call, m) else { return false };
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, call) else { return false };
        assert!(st.lora_deferred.is_none(), "a deferred LoRA delta was not consumed before the next projection");
        st.lora_deferred = Some(Deferred { resid: buf(resid), rows: m, x: buf(x), site, rows_kernel });
        true
    }

    /// Adds a deferred delta into its residual with the one-launch kernel.
    pub(super) fn launch_lora_deferred(&self, d: Option<Deferred>) {
        if let Some(d) = d {
            self.lora_rows_launch_at(d.rows_kernel, &d.site, d.x, d.rows, d.resid, true);
        }
    }

    /// [`Self::launch_lora_deferred`] of whatever is deferred (ops that read the residual).
    pub(super) fn flush_lora_deferred(&self) {
        let d = self.state.lock().unwrap().lora_deferred.take();
        self.launch_lora_deferred(d);
    }
}
