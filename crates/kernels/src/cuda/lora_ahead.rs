//! A LoRA site's shrink computed ahead, in the RMSNorm that makes the site's input
//! (`Device::rms_norm_before_lora`, kernel `rms_norm_shrink` in `lora_ahead.cu`).
//!
//! qkv's and gate_up's inputs are RMSNorm outputs. In a decode step the norm is one small
//! launch per row anyway; computing the site's shrink `t = xn·Aᵀ` in it (a cluster of blocks per
//! row, each owning a slice of the row) leaves the projection nothing to wait for: the expand
//! runs right after the GEMM, and at one row (`QUIVER_CUDA_LORA_AHEAD=1`; by default one-row
//! steps keep the GEMV's own shrink, which measured 1-4 points cheaper) the GEMV adds `s·t·Bᵀ`
//! in its epilogue straight away, no shrink pieces, no flag to wait on. The norm records which call it computed
//! the shrink for; `matmul_lora` takes it only if that same call comes next with nothing queued
//! in between, and otherwise computes its shrink itself, so a mismatch costs time, never
//! correctness.

use super::lora::{dev_buf, LoraLaunch};
use super::lora_tail::TailStep;
use super::*;

/// Steps of at most this many rows compute the shrink in the norm (decode steps: the GEMM of a
/// longer step is long enough to hide a shrink beside it, and prefill takes GEMMs).
pub(super) const AHEAD_MAX_ROWS: usize = 128;
/// Blocks per row, one cluster (`LAH_CL` in lora_ahead.cu).
const CLUSTER: u32 = 8;
/// Threads per block (`LAH_THREADS`).
const THREADS: u32 = 256;
/// Widest shrink the kernel holds (`LAH_MAX_W`: three slices of rank 64).
const MAX_WIDTH: usize = 192;

/// Which call the norm computed a shrink for, and what was queued last then.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Ahead {
    a: u64,
    entry: usize,
    /// Host address and length of the packed groups.
    groups: (usize, usize),
    rows: usize,
    touches: u64,
}

impl Ahead {
    fn of(call: &LoraCall<'_>, rows: usize, touches: u64) -> Ahead {
        let g = call.groups.packed;
        Ahead { a: dev_buf(&call.buffers.a).ptr, entry: call.entry, groups: (g.as_ptr() as usize, g.len()), rows, touches }
    }
}

/// The shrink a norm computed for the projection after it (`take_lora_ahead`): `t`'s device
/// address, and the tail step whose t̂ it also placed beside its bf16 copy (at that copy's
/// address), if it did (`lora_tail.rs`, `QUIVER_CUDA_LORA_TAIL=ahead|rows`).
#[derive(Clone, Copy, Debug)]
pub(super) struct LoraAhead {
    pub(super) t: u64,
    pub(super) placed: Option<(TailStep, u64)>,
}

impl CudaDevice {
    /// Which `rms_norm_shrink` kernel (by index) serves a norm of `rows` rows of width `dim`
    /// feeding `call`, or `None` when the shrink stays with the projection.
    fn lora_ahead_kernel(&self, rows: usize, dim: usize, call: &LoraCall<'_>) -> Option<usize> {
        let sh = call.shape();
        let cl = CLUSTER as usize;
        if self.lora_ahead_min_rows.is_none_or(|min| rows < min) || rows > AHEAD_MAX_ROWS || call.groups.rows != rows || sh.in_dim != dim || !dim.is_multiple_of(8 * cl) || sh.shrink_width() > MAX_WIDTH {
            return None;
        }
        match (dim / cl).div_ceil(256) {
            1 => Some(0),
            2 => Some(1),
            3 | 4 => Some(2),
            _ => None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_before_lora_impl(&self, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor, next: &LoraCall<'_>) {
        let plain = |x: &mut Tensor, out: &mut Tensor| match delta {
            Some(d) => self.add_rms_norm(x, d, w, eps, rows, dim, out),
            None => self.rms_norm(x, w, eps, rows, dim, out),
        };
        // A delta deferred by the projection before (lora_epilogue.rs) goes in with this
        // norm's kernel where it can, else on its own before the norm.
        let deferred = self.state.lock().unwrap().lora_deferred.take();
        let Some(fi) = self.lora_ahead_kernel(rows, dim, next) else {
            self.launch_lora_deferred(deferred);
            return plain(x, out);
        };
        self.bind();
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, next) else {
            drop(st);
            self.launch_lora_deferred(deferred);
            return plain(x, out);
        };
        let deferred = match deferred {
            Some(d) if delta.is_some() && d.fits_norm(buf(x), rows, dim, site.gp) => Some(d),
            other => {
                self.launch_lora_deferred(other);
                None
            }
        };
        let sh = site.shape;
        let need = rows * sh.shrink_width() * 4;
        if st.lora_ahead_t.bytes < need {
            assert!(!self.recording.load(std::sync::atomic::Ordering::Relaxed), "LoRA shrink scratch too small while recording a step: stage_batch sizes it");
            self.grow(&mut st.lora_ahead_t, need);
        }
        let ob = self.shadow_for(&mut st, rows, dim);
        // With the site's tail taking this step's rows, the norm places t̂ too.
        let placed = if ob.ptr == 0 { None } else { self.lora_tail_ahead_step(next, rows, ob.ld) };
        let tail_cols = placed.map_or(0, |t| t.cols) as i32;
        let dp = delta.map(buf).unwrap_or(0);
        match deferred {
            None => launch!(self, self.k.rms_norm_shrink[fi], (rows as u32 * CLUSTER, 1, 1), (THREADS, 1, 1), smem = 0, cluster = CLUSTER;
                buf(x), dp, buf(w), buf(out), ob.ptr, dim as i32, ob.ld as i32, eps, site.a, site.gp, site.cap as i32, site.ranks, sh.n_slices as i32, sh.max_rank as i32, st.lora_ahead_t.ptr,
                site.scal, tail_cols),
            Some(d) => {
                let p = d.site;
                launch!(self, self.k.rms_norm_lora2[fi], (rows as u32 * CLUSTER, 1, 1), (THREADS, 1, 1), smem = 0, cluster = CLUSTER;
                    buf(x), dp, buf(w), buf(out), ob.ptr, dim as i32, ob.ld as i32, eps, site.a, site.gp, site.cap as i32, site.ranks, sh.n_slices as i32, sh.max_rank as i32, st.lora_ahead_t.ptr,
                    d.x, p.shape.in_dim as i32, p.a, p.b, p.ranks, p.scal, p.shape.max_rank as i32, p.shape.b_ld as i32, site.scal, tail_cols)
            }
        }
        self.set_shadow(&mut st, ob, buf(out), rows * dim);
        st.lora_ahead = Some(Ahead::of(next, rows, self.touches.load(std::sync::atomic::Ordering::Relaxed)));
        st.lora_ahead_placed = placed.map(|t| (t, ob.ptr));
        self.lora_ahead_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.mark("rms_norm + lora shrink");
    }

    /// The shrink the norm just computed for `call` over `rows` rows, if nothing has been
    /// queued since; clears it either way.
    pub(super) fn take_lora_ahead(&self, call: &LoraCall<'_>, rows: usize) -> Option<LoraAhead> {
        let mut st = self.state.lock().unwrap();
        let placed = st.lora_ahead_placed.take();
        let ahead = st.lora_ahead.take()?;
        (ahead == Ahead::of(call, rows, self.touches.load(std::sync::atomic::Ordering::Relaxed))).then_some(LoraAhead { t: st.lora_ahead_t.ptr, placed })
    }

    /// `y += s_j · t · Bᵀ` for `call`, with `t` the shrink computed ahead.
    pub(super) fn lora_expand_ahead(&self, call: &LoraCall<'_>, t: u64, y: u64) {
        let mut st = self.state.lock().unwrap();
        let Some(site) = self.lora_site(&mut st, call) else { return };
        let items = self.lora_expand_items(call, site.cap, site.recording);
        drop(st);
        if items == 0 {
            return;
        }
        let l = LoraLaunch { shape: site.shape, gp: site.gp, cap: site.cap, items, t, b: site.b, ranks: site.ranks, scal: site.scal };
        self.lora_expand_launch(&l, y);
    }

    /// Sizes the ahead scratch for a step of `rows` rows (before it may be recorded).
    pub(super) fn lora_ahead_reserve(&self, st: &mut State, rows: usize, width: usize) {
        if self.lora_ahead_min_rows.is_some() && rows <= AHEAD_MAX_ROWS {
            self.grow(&mut st.lora_ahead_t, rows * width.max(1) * 4);
        }
    }
}
