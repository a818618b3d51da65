//! Weight GEMMs: our single-row GEMV (W streamed through cp.async, epilogues fused) and cuBLAS
//! for more rows, with the bf16 input shadow that saves a conversion pass.

use super::lora::LoraLaunch;
use super::*;

/// Which cuBLAS bf16 GEMMs take their f32 input as a bf16 hi + lo pair (two GEMMs, the second
/// accumulating) instead of one bf16 rounding: nearly f32 input precision for twice the work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum SplitGemm {
    /// `QUIVER_CUDA_SPLIT_GEMM=0`.
    Never,
    /// The default: GEMMs over small weights (see [`CudaDevice::splits`]), where the second pass
    /// re-reads W from L2 and costs microseconds.
    Small,
    /// `QUIVER_CUDA_SPLIT_GEMM=1`.
    Always,
}

/// A weight counts as small for [`SplitGemm::Small`] up to this many bytes (read twice; at this
/// size the second read hits L2).
pub(super) const SPLIT_MAX_WEIGHT_BYTES: usize = 16 << 20;

/// Largest site rank whose delta the single-row GEMV adds itself (a lane per rank step, two
/// passes of the warp at 64).
pub(super) const GEMV_LORA_MAX_RANK: usize = 64;

/// What a single-row GEMV does with its output (`GV_PLAIN`, `GV_SILU`, `GV_ROPE` in kernels.cu).
pub(super) enum Gemv1Epilogue<'a> {
    Plain,
    /// `y[i] = silu(gate_i) · up_i` over a fused `[gate; up]` weight: `Device::silu_mul` fused.
    SiluMul,
    /// RoPE on the q and k heads of a fused qkv output at the row's position: `Device::rope_qk` fused.
    Rope { positions: &'a [u32], heads_qk: usize, table: &'a RopeTable },
}

impl CudaDevice {
    /// A single-row GEMV by a bf16 weight with `k % 8 == 0`, its epilogue fused (kernels.cu:
    /// `gemv1_body`).
    pub(super) fn gemv1(&self, w: &Weight, x: &Tensor, bias: Option<&Tensor>, y: &mut Tensor, epilogue: Gemv1Epilogue<'_>) {
        self.gemv1_with(w, x, bias, y, epilogue, None)
    }

    /// [`Self::gemv1`], adding the delta of the LoRA shrink `lora` (launched just before) to
    /// each output before the epilogue (kernels.cu: `GemvLora`).
    fn gemv1_with(&self, w: &Weight, x: &Tensor, bias: Option<&Tensor>, y: &mut Tensor, epilogue: Gemv1Epilogue<'_>, lora: Option<&LoraLaunch>) {
        let WeightData::Cuda(wb, DType::Bf16) = &w.data else { panic!("gemv1 takes a bf16 device weight") };
        let (n, k) = (w.rows, w.cols);
        debug_assert!(k.is_multiple_of(8));
        let pick = |plain, with_lora| if lora.is_some() { with_lora } else { plain };
        let (f, warps, extra, head_dim, max_pos, pos, cos, sin) = match epilogue {
            Gemv1Epilogue::Plain => (pick(self.k.gemv1_bf16, self.k.gemv1_lora_bf16), n.div_ceil(2), 0, 0, 0, 0, 0, 0),
            Gemv1Epilogue::SiluMul => (pick(self.k.gemv1_silu_bf16, self.k.gemv1_lora_silu_bf16), n / 2, n / 2, 0, 0, 0, 0, 0),
            Gemv1Epilogue::Rope { positions, heads_qk, table } => {
                let pos = self.meta_ptr(&mut self.state.lock().unwrap(), &positions[..1]);
                (pick(self.k.gemv1_rope_bf16, self.k.gemv1_lora_rope_bf16), n / 2, heads_qk, table.head_dim, table.max_pos, pos, buf(&table.cos), buf(&table.sin))
            }
        };
        let blocks = warps.div_ceil(GEMV1_WARPS_PER_BLOCK);
        let (grid, block) = ((blocks as u32, 1, 1), (32 * GEMV1_WARPS_PER_BLOCK as u32, 1, 1));
        let (xp, bp, yp) = (buf(x), bias.map(buf).unwrap_or(0), buf(y));
        match lora {
            None => launch!(self, f, grid, block; xp, wb.ptr, bp, yp, n as i32, k as i32, extra as i32, head_dim as i32, max_pos as i32, pos, cos, sin),
            Some(l) => {
                let sh = l.shape;
                launch!(self, f, grid, block; xp, wb.ptr, bp, yp, n as i32, k as i32, extra as i32, head_dim as i32, max_pos as i32, pos, cos, sin,
                    l.t, l.b, l.gp, l.ranks, l.scal, l.cap as i32, sh.n_slices as i32, sh.max_rank as i32, sh.b_ld as i32, l.off(1) as i32, l.off(2) as i32)
            }
        }
    }

    /// `Device::matmul_lora`: at one row (a bf16 weight the single-row GEMV takes, a delta of
    /// one row and at most [`GEMV_LORA_MAX_RANK`]) the shrink, then the GEMV adding the delta
    /// with its epilogue still fused: two launches for the site instead of four (GEMV, shrink,
    /// expand, epilogue). Otherwise the ops one after another.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_lora_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, lora: Option<&LoraCall<'_>>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        let Some(call) = lora else { return crate::epilogue_after_matmul(self, x, m, w, bias, epilogue, y) };
        let sh = call.shape();
        let fold = self.gemv1_fits(m, w)
            && call.groups.rows == 1
            && sh.out_dim() == w.rows
            && sh.max_rank <= GEMV_LORA_MAX_RANK
            && !matches!(epilogue, Epilogue::RopeQk { table, .. } if table.rotary_dim != table.head_dim);
        if !fold {
            // The shrink beside the GEMM (both read only x), the expand after both.
            let shrink = self.lora_shrink_launch(call, LoraX::Dense(x), true);
            self.matmul_impl(x, m, w, bias, y);
            if let Some(l) = shrink {
                self.lora_expand_launch(&l, y);
            }
            return epilogue.run(self, y, m, w);
        }
        self.bind();
        let shrink = self.lora_shrink_launch(call, LoraX::Dense(x), false);
        match epilogue {
            Epilogue::Plain => self.gemv1_with(w, x, bias, y, Gemv1Epilogue::Plain, shrink.as_ref()),
            Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => {
                self.gemv1_with(w, x, bias, y, Gemv1Epilogue::Rope { positions, heads_qk: n_heads + n_kv_heads, table }, shrink.as_ref())
            }
            Epilogue::SiluMul { out } => self.gemv1_with(w, x, None, out, Gemv1Epilogue::SiluMul, shrink.as_ref()),
        }
        self.mark("matmul gemv + lora");
    }

    /// Whether a fused single-row GEMV applies: one row, a bf16 weight, `k % 8 == 0`.
    pub(super) fn gemv1_fits(&self, m: usize, w: &Weight) -> bool {
        self.fuse_epilogues && m == 1 && w.cols.is_multiple_of(8) && matches!(w.data, WeightData::Cuda(_, DType::Bf16))
    }

    /// Whether a multi-row bf16 GEMM over an `n × k` weight takes the hi + lo split of its input.
    /// Over small weights it does: every GEMM of a model like SmolLM2 (hidden 576) is a few
    /// microseconds of launch-bound work on an H200, and its input rounded once to bf16 at every
    /// GEMM of 30 layers moved logprobs by up to 0.14 against f32 (0.06–0.08 with the split).
    /// Over big ones (every Llama-8B projection) it does not: there the second pass would cost
    /// throughput. The choice depends on the weight only, never on the batch, so a row is
    /// computed the same way whatever shares its step (the single-row GEMV reads f32 input
    /// anyway).
    pub(super) fn splits(&self, n: usize, k: usize) -> bool {
        match self.split_gemm {
            SplitGemm::Always => true,
            SplitGemm::Never => false,
            SplitGemm::Small => 2 * n * k <= SPLIT_MAX_WEIGHT_BYTES,
        }
    }

    /// Where an op producing a `rows × cols` GEMM input `out` also writes its bf16 copy, or null
    /// when the consuming matmul will not be a plain cuBLAS bf16 GEMM (single rows take the GEMV;
    /// the split mode converts itself). Call `set_shadow` after launching the producer.
    pub(super) fn shadow_for(&self, st: &mut State, rows: usize, cols: usize) -> u64 {
        if rows <= GEMV_MAX_M || self.split_gemm == SplitGemm::Always {
            return 0;
        }
        self.grow(&mut st.xbf, rows * cols * 2);
        st.xbf.ptr
    }

    pub(super) fn set_shadow(&self, st: &mut State, outb: u64, out: u64, len: usize) {
        st.shadow = (outb != 0).then(|| (out, len, self.touches.load(std::sync::atomic::Ordering::Relaxed)));
    }

    pub(super) fn matmul_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        self.bind();
        if m == 0 {
            return;
        }
        let (k, n) = (w.cols, w.rows);
        let WeightData::Cuda(wb, dtype) = &w.data else { panic!("CUDA matmul given a host weight (load it with Device::load_weight)") };
        match dtype {
            DType::Bf16 if m <= GEMV_MAX_M => {
                if k.is_multiple_of(8) {
                    self.gemv1(w, x, bias, y, Gemv1Epilogue::Plain);
                } else {
                    let bp = bias.map(buf).unwrap_or(0);
                    launch!(self, self.k.gemv_bf16_any_k, (n.div_ceil(8) as u32, 1, 1), (256, 1, 1); buf(x), wb.ptr, bp, buf(y), n as i32, k as i32);
                }
                self.mark("matmul gemv");
                return;
            }
            DType::Bf16 if self.splits(n, k) => {
                let mut st = self.state.lock().unwrap();
                self.grow(&mut st.xbf, m * k * 4);
                let (hi, lo) = (st.xbf.ptr, st.xbf.ptr + (m * k * 2) as u64);
                launch!(self, self.k.f32_to_bf16_split, grid1(m * k, 256), (256, 1, 1); buf(x), hi, lo, (m * k) as i64);
                self.mark("matmul input to bf16");
                self.touch();
                let e1 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, hi, buf(y), false);
                let e2 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, lo, buf(y), true);
                e1.and(e2).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
            DType::Bf16 => {
                let mut st = self.state.lock().unwrap();
                let touches = self.touches.load(std::sync::atomic::Ordering::Relaxed);
                if st.shadow.take() != Some((buf(x), m * k, touches)) {
                    self.grow(&mut st.xbf, m * k * 2);
                    launch!(self, self.k.f32_to_bf16, grid1(m * k, 256), (256, 1, 1); buf(x), st.xbf.ptr, (m * k) as i64);
                    self.mark("matmul input to bf16");
                }
                self.touch();
                self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, st.xbf.ptr, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
            DType::F32 => {
                self.touch();
                self.blas.gemm_xwt(blas::Operand::F32, m, n, k, wb.ptr, buf(x), buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
        }
        self.mark("matmul cublas");
        if let Some(b) = bias {
            launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
            self.mark("bias");
        }
    }

    pub(super) fn matmul_silu_mul_impl(&self, x: &Tensor, m: usize, w: &Weight, gate_up: &mut Tensor, out: &mut Tensor) {
        self.bind();
        if !self.gemv1_fits(m, w) {
            self.matmul_impl(x, m, w, None, gate_up);
            return self.silu_mul(gate_up, m, w.rows / 2, out);
        }
        self.gemv1(w, x, None, out, Gemv1Epilogue::SiluMul);
        self.mark("matmul gemv + silu_mul");
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_rope_qk_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, qkv: &mut Tensor, positions: &[u32], n_heads: usize, n_kv_heads: usize, table: &RopeTable) {
        self.bind();
        if !self.gemv1_fits(m, w) || table.rotary_dim != table.head_dim {
            self.matmul_impl(x, m, w, bias, qkv);
            return self.rope_qk(qkv, m, positions, n_heads, n_kv_heads, table);
        }
        self.gemv1(w, x, bias, qkv, Gemv1Epilogue::Rope { positions, heads_qk: n_heads + n_kv_heads, table });
        self.mark("matmul gemv + rope");
    }

}
