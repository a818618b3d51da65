//! Weight GEMMs: our single-row GEMV (W streamed through cp.async, epilogues fused) and cuBLAS
//! for more rows, with the bf16 input shadow that saves a conversion pass.

use super::lora::{GemvLoraArgs, DELTA_BESIDE_MAX_ROWS};
use super::lora_ahead::LoraAhead;
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

/// Where an op writes the bf16 copy of a GEMM input it produces (`shadow_for`): the address
/// (0: none) and the copy's row stride in elements.
#[derive(Clone, Copy)]
pub(super) struct Shadow {
    pub ptr: u64,
    pub ld: usize,
}

/// A weight counts as small for [`SplitGemm::Small`] up to this many bytes (read twice; at this
/// size the second read hits L2).
pub(super) const SPLIT_MAX_WEIGHT_BYTES: usize = 16 << 20;

/// Largest site rank whose delta the single-row GEMV adds itself (a lane per rank step, two
/// passes of the warp at 64).
pub(super) const GEMV_LORA_MAX_RANK: usize = 64;

/// Blocks per SM per round of the single-row GEMV with LoRA (see `gemv1_lora_grid`): what fits
/// at once (88 registers and 32 KiB of shared memory a block). Capping its registers so that six
/// fit, as for the plain GEMV, measured no faster on the H200 (session 14). The default of
/// `QUIVER_CUDA_GEMV_LORA_BLOCKS`, which may ask for fewer.
pub(super) const GEMV_LORA_BLOCKS_PER_SM: usize = 5;

/// What a single-row GEMV does with its output (`GV_PLAIN`, `GV_SILU`, `GV_ROPE` in gemv.cu).
pub(super) enum Gemv1Epilogue<'a> {
    Plain,
    /// `y[i] = silu(gate_i) · up_i` over a fused `[gate; up]` weight: `Device::silu_mul` fused.
    SiluMul,
    /// RoPE on the q and k heads of a fused qkv output at the row's position: `Device::rope_qk` fused.
    Rope { positions: &'a [u32], heads_qk: usize, table: &'a RopeTable },
}

impl CudaDevice {
    /// A single-row GEMV by a bf16 weight with `k % 8 == 0`, its epilogue fused (gemv.cu:
    /// `gemv1_body`).
    pub(super) fn gemv1(&self, w: &Weight, x: &Tensor, bias: Option<&Tensor>, y: &mut Tensor, epilogue: Gemv1Epilogue<'_>) {
        self.gemv1_with(w, x, bias, y, epilogue, None)
    }

    /// Blocks of a single-row GEMV computing a LoRA delta over `w` with `epilogue`.
    pub(super) fn gemv1_lora_blocks(&self, w: &Weight, epilogue: &Epilogue<'_>) -> usize {
        let warps = match epilogue {
            Epilogue::Plain | Epilogue::Residual { .. } => w.rows.div_ceil(2),
            _ => w.rows / 2,
        };
        self.gemv1_lora_grid(warps.div_ceil(GEMV1_WARPS_PER_BLOCK))
    }

    /// The grid for `blocks` blocks' worth of output pairs of the single-row GEMV with LoRA:
    /// whole rounds of at most `gemv_lora_blocks_per_sm` blocks per SM, every warp looping over
    /// the same number of pairs (an uneven last round would cost a whole round). An 8B step's
    /// projections come out at 1 (o, down), 2 (qkv) and 6 (gate_up) pairs per warp: a block's
    /// LoRA work (its ticket, waiting for t, leaving) is shared by the pairs of its warps, and
    /// as many warps as the plain GEMV keep W in flight.
    fn gemv1_lora_grid(&self, blocks: usize) -> usize {
        let rounds = blocks.div_ceil(self.gemv_lora_blocks_per_sm * self.sms).max(1);
        blocks.div_ceil(rounds)
    }

    /// [`Self::gemv1`], computing the LoRA delta `lora` itself (shrink and expand) and adding it
    /// to each output before the epilogue (gemv.cu: `GemvLora`).
    fn gemv1_with(&self, w: &Weight, x: &Tensor, bias: Option<&Tensor>, y: &mut Tensor, epilogue: Gemv1Epilogue<'_>, lora: Option<&GemvLoraArgs>) {
        let WeightData::Cuda(wb, DType::Bf16, ldw) = &w.data else { panic!("gemv1 takes a bf16 device weight") };
        let (n, k, ldw) = (w.rows, w.cols, *ldw);
        debug_assert!(k.is_multiple_of(8) && ldw.is_multiple_of(8));
        let pick = |plain, with_lora| if lora.is_some() { with_lora } else { plain };
        let (f, warps, extra, head_dim, max_pos, pos, cos, sin) = match epilogue {
            Gemv1Epilogue::Plain => (pick(self.k.gemv1_bf16, self.k.gemv1_lora_bf16), n.div_ceil(2), 0, 0, 0, 0, 0, 0),
            Gemv1Epilogue::SiluMul => (pick(self.k.gemv1_silu_bf16, self.k.gemv1_lora_silu_bf16), n / 2, n / 2, 0, 0, 0, 0, 0),
            Gemv1Epilogue::Rope { positions, heads_qk, table } => {
                let pos = self.meta_ptr(&mut self.state.lock().unwrap(), &positions[..1]);
                (pick(self.k.gemv1_rope_bf16, self.k.gemv1_lora_rope_bf16), n / 2, heads_qk, table.head_dim, table.max_pos, pos, buf(&table.cos), buf(&table.sin))
            }
        };
        let mut blocks = warps.div_ceil(GEMV1_WARPS_PER_BLOCK);
        // A shrink computed in the kernel takes the looping grid (its per-block work paid once
        // per block); one computed ahead leaves nothing per block, so the plain grid (a pair per
        // warp, blocks scheduled as others finish) balances the weight stream as without LoRA.
        if lora.is_some_and(|l| !l.ahead) {
            blocks = self.gemv1_lora_grid(blocks);
        }
        let (grid, block) = ((blocks as u32, 1, 1), (32 * GEMV1_WARPS_PER_BLOCK as u32, 1, 1));
        let (xp, bp, yp) = (buf(x), bias.map(buf).unwrap_or(0), buf(y));
        match lora {
            None => launch!(self, f, grid, block; xp, wb.ptr, bp, yp, n as i32, k as i32, ldw as i32, extra as i32, head_dim as i32, max_pos as i32, pos, cos, sin),
            Some(l) => {
                let (s, sh) = (&l.site, &l.site.shape);
                launch!(self, f, grid, block; xp, wb.ptr, bp, yp, n as i32, k as i32, ldw as i32, extra as i32, head_dim as i32, max_pos as i32, pos, cos, sin,
                    l.t, s.a, s.b, s.gp, s.ranks, s.scal, l.ctr, s.cap as i32, sh.n_slices as i32, sh.max_rank as i32, sh.b_ld as i32,
                    s.off(1) as i32, s.off(2) as i32, l.gy as i32, l.splits as i32, l.kc as i32, l.ahead as i32)
            }
        }
    }

    /// `Device::matmul_lora`: at one row (a bf16 weight the single-row GEMV takes, a delta of
    /// one row and at most [`GEMV_LORA_MAX_RANK`]) one GEMV that computes the delta too, its
    /// epilogue still fused: one launch for the site instead of four (GEMV, shrink, expand,
    /// epilogue). Otherwise the shrink beside the GEMM, then the expand and the epilogue.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_lora_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, lora: Option<&LoraCall<'_>>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        let Some(call) = lora else { return crate::epilogue_after_matmul(self, x, m, w, bias, epilogue, y) };
        let ahead = self.take_lora_ahead(call, m);
        let sh = call.shape();
        let fold = self.gemv1_fits(m, w)
            && call.groups.rows == 1
            && sh.out_dim() == w.rows
            && sh.max_rank <= GEMV_LORA_MAX_RANK
            && !matches!(epilogue, Epilogue::RopeQk { table, .. } if table.rotary_dim != table.head_dim)
            && !(self.lora_side.is_some()
                && match self.lora_row1 {
                    lora::Row1Lora::Fold => false,
                    lora::Row1Lora::BesideResidual => matches!(epilogue, Epilogue::Residual { .. }),
                    lora::Row1Lora::Beside => true,
                });
        if let Some(a) = ahead {
            let t = a.t;
            if !fold {
                // With the site's LoRA tail (`QUIVER_CUDA_LORA_TAIL=rows|ahead`): t̂ beside x,
                // the delta in the GEMM.
                if let Some(tail) = self.lora_tail_rows_fits(call, m, w, true) {
                    return self.lora_tail_rows(call, x, m, w, bias, epilogue, y, tail, Some(a));
                }
                // The norm computed the shrink: the expand in the epilogue where it takes it,
                // else right after the GEMM, then the epilogue.
                if self.lora_epilogue_fits(call, &epilogue, w) {
                    return self.matmul_lora_epilogue(x, m, w, bias, call, t, epilogue, y);
                }
                self.matmul_impl(x, m, w, bias, y);
                self.lora_expand_ahead(call, t, buf(y));
                return epilogue.run(self, y, m, w);
            }
        }
        let fused = match (fold, ahead) {
            (true, Some(a)) => Some(self.lora_gemv_args_ahead(call, a.t)),
            (true, None) => self.lora_gemv_args(call, self.gemv1_lora_blocks(w, &epilogue)),
            (false, _) => None,
        };
        let Some(fused) = fused else { return self.matmul_lora_rows(x, m, w, bias, call, epilogue, y) };
        self.bind();
        let shrink = fused.as_ref();
        match epilogue {
            Epilogue::Plain | Epilogue::Residual { .. } => self.gemv1_with(w, x, bias, y, Gemv1Epilogue::Plain, shrink),
            Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => {
                self.gemv1_with(w, x, bias, y, Gemv1Epilogue::Rope { positions, heads_qk: n_heads + n_kv_heads, table }, shrink)
            }
            Epilogue::SiluMul { out } => self.gemv1_with(w, x, None, out, Gemv1Epilogue::SiluMul, shrink),
        }
        self.mark("matmul gemv + lora");
    }

    /// `Device::matmul_lora` over more rows (or weights the single-row GEMV does not take).
    /// With a side stream and at most [`DELTA_BESIDE_MAX_ROWS`] rows the whole delta runs
    /// beside the GEMM (shrink and expand both need only x): into the residual for
    /// `Epilogue::Residual`, or into a zeroed delta buffer that the fused RoPE / SiLU·mul adds;
    /// so the step's critical path carries no LoRA kernel at all. Otherwise the shrink runs
    /// beside the GEMM and the expand adds into its output after it.
    #[allow(clippy::too_many_arguments)]
    fn matmul_lora_rows(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, call: &LoraCall<'_>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        let recording = self.recording.load(std::sync::atomic::Ordering::Relaxed);
        if !recording && call.groups.adapter_rows == 0 {
            return crate::epilogue_after_matmul(self, x, m, w, bias, epilogue, y);
        }
        if self.lora_gemm_fits(call, m, w) {
            self.lora_gemm_project(call, x, m, w, bias, y);
            return epilogue.run(self, y, m, w);
        }
        if let Some(tail) = self.lora_tail_rows_fits(call, m, w, false) {
            return self.lora_tail_rows(call, x, m, w, bias, epilogue, y, tail, None);
        }
        // A long eager step of short runs (opt-in): the kernels' grouped shrink into the tail.
        if let Some(tail) = self.lora_tail_eager_fits(call, m, w) {
            let t = self.lora_shrink_launch(call, LoraX::Dense(x)).map(|l| LoraAhead { t: l.t, placed: None });
            return self.lora_tail_rows(call, x, m, w, bias, epilogue, y, tail, t);
        }
        let out = call.shape().out_dim();
        let beside_all = self.lora_side.is_some() && call.groups.rows <= DELTA_BESIDE_MAX_ROWS && out == w.rows;
        // The whole delta in one launch where the site fits it (`lora_rows.rs`).
        let rows_kernel = self.lora_rows_kernel(call, m);
        match epilogue {
            // The delta goes in with the next norm (lora_epilogue.rs).
            Epilogue::Residual { resid } if self.defer_lora(call, x, m, resid) => self.matmul_impl(x, m, w, bias, y),
            Epilogue::Residual { resid } if beside_all => {
                let target = buf(resid);
                self.beside(|| match rows_kernel {
                    Some(f) => self.lora_rows_launch(f, call, x, m, target, true),
                    None => {
                        if let Some(l) = self.lora_shrink_launch(call, LoraX::Dense(x)) {
                            self.lora_expand_launch(&l, target);
                        }
                    }
                });
                self.matmul_impl(x, m, w, bias, y);
                self.join_side();
            }
            Epilogue::RopeQk { .. } | Epilogue::SiluMul { .. } if beside_all => {
                let (delta, _) = self.beside(|| match rows_kernel {
                    Some(f) => {
                        let d = self.lora_delta(m, out);
                        self.lora_rows_launch(f, call, x, m, d, false);
                        d
                    }
                    None => {
                        let d = self.lora_delta_zeroed(m, out);
                        if let Some(l) = self.lora_shrink_launch(call, LoraX::Dense(x)) {
                            self.lora_expand_launch(&l, d);
                        }
                        d
                    }
                });
                self.matmul_impl(x, m, w, bias, y);
                self.join_side();
                match epilogue {
                    Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => self.rope_qk_plus(y, delta, m, positions, n_heads, n_kv_heads, table),
                    Epilogue::SiluMul { out } => self.silu_mul_plus(y, delta, m, w.rows / 2, out),
                    _ => unreachable!(),
                }
            }
            _ if rows_kernel.is_some() && out == w.rows => {
                // No side stream (or a fused epilogue it does not take): the delta after the GEMM.
                self.matmul_impl(x, m, w, bias, y);
                self.lora_rows_launch(rows_kernel.unwrap(), call, x, m, buf(y), true);
                epilogue.run(self, y, m, w);
            }
            _ => {
                let (shrink, beside) = self.beside(|| self.lora_shrink_launch(call, LoraX::Dense(x)));
                self.matmul_impl(x, m, w, bias, y);
                if let Some(l) = shrink {
                    if beside {
                        self.join_side();
                    }
                    self.lora_expand_launch(&l, buf(y));
                }
                epilogue.run(self, y, m, w);
            }
        }
    }

    /// Whether a fused single-row GEMV applies: one row, a bf16 weight, `k % 8 == 0`.
    pub(super) fn gemv1_fits(&self, m: usize, w: &Weight) -> bool {
        self.fuse_epilogues && m == 1 && w.cols.is_multiple_of(8) && matches!(w.data, WeightData::Cuda(_, DType::Bf16, ld) if ld.is_multiple_of(8))
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

    /// Where an op producing a `rows × cols` GEMM input `out` also writes its bf16 copy (null
    /// when the consuming matmul will not be a plain cuBLAS bf16 GEMM: single rows take the GEMV;
    /// the split mode converts itself), and that copy's row stride. Call `set_shadow` after
    /// launching the producer.
    pub(super) fn shadow_for(&self, st: &mut State, rows: usize, cols: usize) -> Shadow {
        let ld = cols + self.input_room.load(std::sync::atomic::Ordering::Relaxed);
        if rows <= GEMV_MAX_M || self.split_gemm == SplitGemm::Always {
            return Shadow { ptr: 0, ld };
        }
        self.grow(&mut st.xbf, rows * ld * 2);
        Shadow { ptr: st.xbf.ptr, ld }
    }

    /// The bf16 copy of a GEMM's `m × k` input `x` in the input scratch: the producer's copy
    /// (rows as far apart as it wrote them) if nothing has run since it was written, else
    /// converted now (rows as far apart as a producer would write them).
    pub(super) fn bf16_input(&self, x: &Tensor, m: usize, k: usize) -> blas::Mat {
        let mut st = self.state.lock().unwrap();
        let touches = self.touches.load(std::sync::atomic::Ordering::Relaxed);
        match st.shadow.take() {
            Some((p, len, n, ld)) if (p, len, n) == (buf(x), m * k, touches) => blas::Mat { ptr: st.xbf.ptr, ld },
            _ => {
                // With the same room after each row as a producer leaves (LoRA's tail goes there).
                let ld = k + self.input_room.load(std::sync::atomic::Ordering::Relaxed);
                self.grow(&mut st.xbf, m * ld * 2);
                launch!(self, self.k.f32_to_bf16, grid1(m * k, 256), (256, 1, 1); buf(x), st.xbf.ptr, k as i64, ld as i64, (m * k) as i64);
                self.mark("matmul input to bf16");
                blas::Mat { ptr: st.xbf.ptr, ld }
            }
        }
    }

    pub(super) fn set_shadow(&self, st: &mut State, ob: Shadow, out: u64, len: usize) {
        st.shadow = (ob.ptr != 0).then(|| (out, len, self.touches.load(std::sync::atomic::Ordering::Relaxed), ob.ld));
    }

    pub(super) fn matmul_impl(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        self.matmul_input(x, m, w, bias, y);
    }

    /// [`Self::matmul_impl`], returning where a bf16 GEMM found x in bf16 (the LoRA GEMMs that
    /// follow read it there), None for the GEMVs and f32 weights.
    pub(super) fn matmul_input(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) -> Option<blas::Mat> {
        self.bind();
        if m == 0 {
            return None;
        }
        let (k, n) = (w.cols, w.rows);
        let WeightData::Cuda(wb, dtype, ldw) = &w.data else { panic!("CUDA matmul given a host weight (load it with Device::load_weight)") };
        let wm = blas::Mat { ptr: wb.ptr, ld: *ldw };
        let input = match dtype {
            DType::Bf16 if m <= GEMV_MAX_M => {
                if k.is_multiple_of(8) && ldw.is_multiple_of(8) {
                    self.gemv1(w, x, bias, y, Gemv1Epilogue::Plain);
                } else {
                    let bp = bias.map(buf).unwrap_or(0);
                    launch!(self, self.k.gemv_bf16_any_k, (n.div_ceil(8) as u32, 1, 1), (256, 1, 1); buf(x), wb.ptr, bp, buf(y), n as i32, k as i32, *ldw as i32);
                }
                self.mark("matmul gemv");
                return None;
            }
            DType::Bf16 if self.splits(n, k) => {
                let mut st = self.state.lock().unwrap();
                self.grow(&mut st.xbf, m * k * 4);
                let (hi, lo) = (st.xbf.ptr, st.xbf.ptr + (m * k * 2) as u64);
                launch!(self, self.k.f32_to_bf16_split, grid1(m * k, 256), (256, 1, 1); buf(x), hi, lo, (m * k) as i64);
                self.mark("matmul input to bf16");
                self.touch();
                let (xh, xl) = (blas::Mat { ptr: hi, ld: k }, blas::Mat { ptr: lo, ld: k });
                let e1 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wm, xh, buf(y), false);
                let e2 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wm, xl, buf(y), true);
                e1.and(e2).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                Some(xh)
            }
            DType::Bf16 => {
                let xb = self.bf16_input(x, m, k);
                self.touch();
                self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wm, xb, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                Some(xb)
            }
            DType::F32 => {
                self.touch();
                self.blas.gemm_xwt(blas::Operand::F32, m, n, k, wm, blas::Mat { ptr: buf(x), ld: k }, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                None
            }
        };
        self.mark("matmul cublas");
        if let Some(b) = bias {
            launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
            self.mark("bias");
        }
        input
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

    /// `Device::rope_qk`, first adding `delta` (a `rows × width` buffer, 0 for none) to every
    /// column: a LoRA delta computed beside the projection.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_qk_plus(&self, qkv: &mut Tensor, delta: u64, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, t: &RopeTable) {
        self.bind();
        if rows == 0 {
            return;
        }
        assert_eq!(t.rotary_dim, t.head_dim, "partial rotary dims are not supported on CUDA");
        let width = (n_heads + 2 * n_kv_heads) * t.head_dim;
        let mut st = self.state.lock().unwrap();
        let pp = self.meta_ptr(&mut st, &positions[..rows]);
        launch!(self, self.k.rope_qk, (rows as u32, 1, 1), row_threads((n_heads + n_kv_heads) * t.rotary_dim / 2);
            buf(qkv), delta, pp, buf(&t.cos), buf(&t.sin), (n_heads + n_kv_heads) as i32, t.head_dim as i32, (t.rotary_dim / 2) as i32, width as i32, t.max_pos as i32);
        self.mark("rope");
    }

    /// `Device::silu_mul`, first adding `delta` (`rows × 2·inter`, 0 for none) to gate and up.
    pub(super) fn silu_mul_plus(&self, gate_up: &Tensor, delta: u64, rows: usize, inter: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, inter);
        let items = if inter.is_multiple_of(4) { rows * inter / 4 } else { rows * inter };
        launch!(self, self.k.silu_mul, grid1(items, 256), (256, 1, 1); buf(gate_up), delta, buf(out), ob.ptr, inter as i32, ob.ld as i32, (rows * inter) as i64);
        self.set_shadow(&mut st, ob, buf(out), rows * inter);
        self.mark("silu_mul");
    }
}
