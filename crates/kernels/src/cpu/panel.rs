//! `y = x · Wᵀ` on weights packed once at load into column panels: the CPU device's GEMM for
//! every model weight, at every M.
//!
//! **Layout.** W `[n, k]` becomes `⌈n / np⌉` panels of `np` output columns; panel `p` holds
//! `W[p·np + c, kk]` at `(p·k + kk)·np + c`, so one k step of a panel is `np` contiguous values
//! and a whole panel is one contiguous `k·np` run. The last panel is zero-padded. The panel width
//! is the instruction set's (see [`Shape`]): 48 columns (three vectors) with AVX-512's 32
//! registers, 16 (two vectors) with AVX2's 16.
//!
//! **Kernel.** A register tile is `R ≤ MR` rows of x × one panel (`np / L` vectors): per k step
//! it loads the panel's `np` values once and multiplies them by each row's `x[i, kk]` broadcast.
//! Compared with the dot-product tiles of `dot.rs`, which ran the weight GEMM before: no lane
//! reduction per element, one sequential stream per task instead of four short rows per tile,
//! and all 16 rows of a decode step in two or three passes over a panel that stays in L2.
//! Measured on SmolLM2 f32 (BENCHMARKS.md): 64-row decode +20–27%, 16-row +8–15%, prefill +0–16%.
//!
//! **Invariant: how an element is computed does not depend on M.** `y[i, j]` is one f32 chain
//! `acc = x[i, kk] · W[j, kk] + acc` for kk = 0, 1, …, k − 1 from zero (a fused multiply-add
//! on AVX-512 and AVX2, multiply then add on the portable path), whatever tile, task or batch the
//! element falls in. So a sequence's logits are bit-identical alone, in a decode batch or in a
//! prefill chunk, as `crates/engine/tests/batched_forward.rs` asserts. Never split k across tasks
//! or start a chain anywhere but zero.

use super::dot::{Portable, Simd, WElem};
use super::simd::{isa, prefetch_l2, Isa};
use super::SyncPtr;
use crate::aligned::AlignedVec;
use half::bf16;
use rayon::prelude::*;

/// The register-tile geometry of one instruction set.
///
/// A tile of `R` rows × `P` panels holds `R·P·np/L` accumulators plus the `P·np/L` W vectors of
/// one k step and a broadcast x: AVX-512 (32 registers) takes 8 rows × 48 columns (24 + 3 + 1),
/// AVX2 (16 registers) 6 rows × 16 columns (12 + 2 + 1), the classic shape for FMA units of
/// latency 4 and two ports (12 independent chains). Before AVX2 had its own shape it ran 2 rows
/// × 48 columns (12 + 6 + 1: spilled) and large products reached ~40% of the FMA peak.
pub(super) struct Shape {
    /// Output columns per panel.
    pub np: usize,
    /// Rows of x per register tile at most.
    pub mr: usize,
    /// Panels per tile for blocks of 1, 2, 3, 4 rows (index 0 unused): single-pass blocks read
    /// several panels at once for more independent streams of W, as registers allow.
    pub short_p: [usize; 5],
}

const AVX512_SHAPE: Shape = Shape { np: 48, mr: 8, short_p: [0, 2, 2, 2, 2] };
const AVX2_SHAPE: Shape = Shape { np: 16, mr: 6, short_p: [0, 4, 2, 1, 1] };
const PORTABLE_SHAPE: Shape = Shape { np: 16, mr: 4, short_p: [0, 2, 1, 1, 1] };

pub(super) fn shape(isa: Isa) -> &'static Shape {
    match isa {
        Isa::Avx512 => &AVX512_SHAPE,
        Isa::Avx2 => &AVX2_SHAPE,
        Isa::Portable => &PORTABLE_SHAPE,
    }
}

/// A weight `[n, k]` in panels (see the module docs), f32 or bf16 (widened in registers).
pub struct PanelWeight {
    n: usize,
    k: usize,
    /// Panel width, fixed at packing for the instruction set that will run the weight.
    np: usize,
    data: PanelData,
}

enum PanelData {
    F32(AlignedVec<f32>),
    Bf16(AlignedVec<bf16>),
}

fn pack<T: Copy + Send + Sync + bytemuck::Zeroable>(n: usize, k: usize, np: usize, w: &[T]) -> AlignedVec<T> {
    assert_eq!(w.len(), n * k, "panel pack: weight data does not match [{n}, {k}]");
    let panels = n.div_ceil(np);
    // Zeroed pages straight from the allocator: the padding of the last panel stays zero and the
    // weights are written once, with no staging copy (a model's worth of bytes at load).
    let mut out = AlignedVec::<T>::zeroed(panels * np * k);
    out.par_chunks_mut(np * k).enumerate().for_each(|(p, panel)| {
        for c in 0..np.min(n - p * np) {
            let row = &w[(p * np + c) * k..(p * np + c + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * np + c] = v;
            }
        }
    });
    out
}

impl PanelWeight {
    pub fn from_f32(n: usize, k: usize, w: &[f32]) -> Self {
        Self::from_f32_for(isa(), n, k, w)
    }
    pub fn from_bf16(n: usize, k: usize, w: &[bf16]) -> Self {
        Self::from_bf16_for(isa(), n, k, w)
    }
    /// Packed for `isa`'s panel width; only that instruction set may run it.
    fn from_f32_for(isa: Isa, n: usize, k: usize, w: &[f32]) -> Self {
        let np = shape(isa).np;
        PanelWeight { n, k, np, data: PanelData::F32(pack(n, k, np, w)) }
    }
    fn from_bf16_for(isa: Isa, n: usize, k: usize, w: &[bf16]) -> Self {
        let np = shape(isa).np;
        PanelWeight { n, k, np, data: PanelData::Bf16(pack(n, k, np, w)) }
    }
    pub fn is_f32(&self) -> bool {
        matches!(self.data, PanelData::F32(_))
    }
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            PanelData::F32(v) => v.len() * 4,
            PanelData::Bf16(v) => v.len() * 2,
        }
    }
    /// Row `r` of W (an embedding row, for tied tables) converted to f32 into `out` (len `k`).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n, "panel row {r} of {}", self.n);
        let np = self.np;
        let (p, c) = (r / np, r % np);
        let base = p * np * self.k + c;
        match &self.data {
            PanelData::F32(v) => out.iter_mut().enumerate().for_each(|(kk, o)| *o = v[base + kk * np]),
            PanelData::Bf16(v) => out.iter_mut().enumerate().for_each(|(kk, o)| *o = v[base + kk * np].to_f32()),
        }
    }
}

/// What one task computes: `y[rows, panels]`; `y` has row stride `n`; W in panels of `np`.
#[derive(Clone, Copy)]
struct Block<T> {
    x: *const f32,
    w: *const T,
    y: *mut f32,
    k: usize,
    n: usize,
    np: usize,
    rows: (usize, usize),
    panels: (usize, usize),
}

/// Vectors between two near prefetches of one k step: one hint per 64-byte line, not per vector.
const fn prefetch_every<S: Simd, T>() -> usize {
    let v = S::L * std::mem::size_of::<T>();
    if v >= 64 { 1 } else { 64 / v }
}

/// `R` rows of x against `P` panels starting at `w` (each `k·np` further): `C` vectors of `S::L`
/// columns per panel, `np = C · S::L`. Several panels at once give small row counts more
/// independent streams of W in flight; each element is still its own chain.
///
/// Besides the near prefetch (`PREFETCH_ELEMS` ahead in the panels being read), every `every`
/// k steps one k step of `P` panels at `far` is fetched into L2: the panels the next tile or pass
/// reads first, spread so that a panel read in `every` row passes has the next one in L2 when
/// they finish (DRAM stays busy during passes that read from L2). Measured +20–30% GB/s on
/// 16-row products over streaming weights; a hint past the weight's end is harmless. `every`
/// 0 turns it off: single-pass blocks measured 5–10% slower end to end with it (1 and 4 rows),
/// though faster in the kernel probe.
///
/// # Safety
/// `xs[i]` has `k` readable elements, `w` `P` whole panels; the CPU supports `S`.
#[inline(always)]
unsafe fn tile<S: Simd, const R: usize, const P: usize, const C: usize, T: WElem>(xs: [*const f32; R], w: *const T, k: usize, far: *const T, every: usize) -> [[[S::V; C]; P]; R] {
    unsafe {
        let np = C * S::L;
        let mut acc = [[[S::zero(); C]; P]; R];
        let (mut fp, mut cnt) = (far, 0);
        let mut wp = w;
        let stride = k * np;
        for kk in 0..k {
            let mut wv = [[S::zero(); C]; P];
            for (q, vq) in wv.iter_mut().enumerate() {
                for (c, v) in vq.iter_mut().enumerate() {
                    let at = wp.add(q * stride + c * S::L);
                    if c % prefetch_every::<S, T>() == 0 {
                        S::prefetch(at.wrapping_add(PREFETCH_ELEMS) as *const u8);
                    }
                    *v = T::load::<S>(at);
                }
            }
            for i in 0..R {
                let xv = S::splat(*xs[i].add(kk));
                for q in 0..P {
                    for c in 0..C {
                        acc[i][q][c] = S::madd(xv, wv[q][c], acc[i][q][c]);
                    }
                }
            }
            wp = wp.add(np);
            cnt += 1;
            if cnt == every {
                cnt = 0;
                for q in 0..P {
                    for c in (0..C).step_by(prefetch_every::<S, T>()) {
                        prefetch_l2(fp.wrapping_add(q * stride + c * S::L) as *const u8);
                    }
                }
                fp = fp.wrapping_add(np);
            }
        }
        acc
    }
}

/// Rows `i0..i0 + R` against panels `p..p + P`, written to y.
///
/// # Safety
/// See `tile`; `y[i0..i0 + R, p·np..]` is written by this call only.
#[inline(always)]
unsafe fn row_tile<S: Simd, const R: usize, const P: usize, const C: usize, T: WElem>(b: &Block<T>, i0: usize, p: usize, far: *const T, every: usize) {
    unsafe {
        let np = C * S::L;
        let mut xs = [b.x; R];
        for (i, x) in xs.iter_mut().enumerate() {
            *x = b.x.add((i0 + i) * b.k);
        }
        let acc = tile::<S, R, P, C, T>(xs, b.w.add(p * np * b.k), b.k, far, every);
        for (i, row) in acc.iter().enumerate() {
            for (q, part) in row.iter().enumerate() {
                let j0 = (p + q) * np;
                let cols = np.min(b.n - j0);
                let yr = b.y.add((i0 + i) * b.n + j0);
                if cols == np {
                    for (c, &v) in part.iter().enumerate() {
                        S::store(yr.add(c * S::L), v);
                    }
                } else {
                    let mut tmp = [0.0f32; MAX_NP];
                    for (c, &v) in part.iter().enumerate() {
                        S::store(tmp.as_mut_ptr().add(c * S::L), v);
                    }
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), yr, cols);
                }
            }
        }
    }
}

/// The widest panel of any instruction set.
const MAX_NP: usize = 48;

/// A block of at most `MR` rows: one row tile, `P` panels at a time while `P` remain.
///
/// # Safety
/// See `row_tile`.
#[inline(always)]
unsafe fn short_block<S: Simd, const R: usize, const P: usize, const C: usize, T: WElem>(b: &Block<T>) {
    let mut p = b.panels.0;
    unsafe {
        while p + P <= b.panels.1 {
            row_tile::<S, R, P, C, T>(b, b.rows.0, p, b.w, 0);
            p += P;
        }
        while p < b.panels.1 {
            row_tile::<S, R, 1, C, T>(b, b.rows.0, p, b.w, 0);
            p += 1;
        }
    }
}

/// Every panel of the block against every row tile, panel by panel (the panel then stays in
/// L1/L2 while the row tiles pass over it). Blocks of one row tile (up to 4 rows) take `Pr`
/// panels per pass instead (see `tile` and [`Shape::short_p`]).
///
/// # Safety
/// See `row_tile`; the CPU supports `S`.
#[inline(always)]
unsafe fn block_body<S: Simd, const MR: usize, const C: usize, const P1: usize, const P2: usize, const P3: usize, const P4: usize, T: WElem>(b: &Block<T>) {
    debug_assert_eq!(b.np, C * S::L, "weight packed for another instruction set");
    let m = b.rows.1 - b.rows.0;
    unsafe {
        match m {
            1 => return short_block::<S, 1, P1, C, T>(b),
            2 => return short_block::<S, 2, P2, C, T>(b),
            3 if MR >= 3 => return short_block::<S, 3, P3, C, T>(b),
            4 if MR >= 4 => return short_block::<S, 4, P4, C, T>(b),
            _ => {}
        }
    }
    // Pass i of `passes` over panel p prefetches the i-th share of panel p + 1 (see `tile`); a
    // single pass does not (as for short blocks). Rows are spread evenly over the passes (16 rows
    // in tiles of 6 go 6, 5, 5, not 6, 6, 4).
    let passes = m.div_ceil(MR);
    let every = if passes > 1 { passes } else { 0 };
    let np = C * S::L;
    let span = b.k.div_ceil(passes) * np;
    for p in b.panels.0..b.panels.1 {
        let mut i0 = b.rows.0;
        let mut far = b.w.wrapping_add((p + 1) * np * b.k);
        for pass in 0..passes {
            let r = (m - (i0 - b.rows.0)).div_ceil(passes - pass);
            unsafe {
                match r {
                    1 => row_tile::<S, 1, 1, C, T>(b, i0, p, far, every),
                    2 => row_tile::<S, 2, 1, C, T>(b, i0, p, far, every),
                    3 => row_tile::<S, 3, 1, C, T>(b, i0, p, far, every),
                    4 => row_tile::<S, 4, 1, C, T>(b, i0, p, far, every),
                    5 if MR >= 5 => row_tile::<S, 5, 1, C, T>(b, i0, p, far, every),
                    6 if MR >= 6 => row_tile::<S, 6, 1, C, T>(b, i0, p, far, every),
                    7 if MR >= 7 => row_tile::<S, 7, 1, C, T>(b, i0, p, far, every),
                    8 if MR >= 8 => row_tile::<S, 8, 1, C, T>(b, i0, p, far, every),
                    _ => unreachable!("a pass has at most MR ≤ 8 rows"),
                }
            }
            i0 += r;
            far = far.wrapping_add(span);
        }
    }
}

/// The `block_body` of a [`Shape`], its constants spelled out as const arguments.
macro_rules! shaped_body {
    ($s:ty, $shape:expr, $t:ty, $b:expr) => {
        block_body::<$s, { $shape.mr }, { $shape.np / <$s as Simd>::L }, { $shape.short_p[1] }, { $shape.short_p[2] }, { $shape.short_p[3] }, { $shape.short_p[4] }, $t>($b)
    };
}

#[cfg(target_arch = "x86_64")]
mod x86_entry {
    use super::super::dot::x86::{Avx2, Avx512};
    use super::super::dot::Simd;
    use super::{block_body, Block, WElem, AVX2_SHAPE, AVX512_SHAPE};
    /// # Safety
    /// The CPU has AVX-512F; see `row_tile`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn avx512<T: WElem>(b: &Block<T>) {
        unsafe { shaped_body!(Avx512, AVX512_SHAPE, T, b) }
    }
    /// # Safety
    /// The CPU has AVX2 and FMA; see `row_tile`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2<T: WElem>(b: &Block<T>) {
        unsafe { shaped_body!(Avx2, AVX2_SHAPE, T, b) }
    }
}

/// # Safety
/// See `row_tile`; `isa` is what this CPU supports and what W was packed for.
unsafe fn run_block<T: WElem>(isa: Isa, b: &Block<T>) {
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86_entry::avx512(b),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86_entry::avx2(b),
            _ => shaped_body!(Portable, PORTABLE_SHAPE, T, b),
        }
    }
}

/// How far ahead in its panel a tile asks for W, in elements (3 KiB of f32): the hardware
/// prefetcher stops at every 4 KiB page, a panel is one long run of pages, and past the panel's
/// end the hint lands on the next panel, which the task reads next.
const PREFETCH_ELEMS: usize = 768;

/// Blocks of at most this many rows run in one pass (see [`Shape::short_p`]).
const SHORT_ROWS: usize = 4;

/// Rows of x per task at most: a task's x rows stay in L2 while its panels pass.
const MAX_BLOCK_ROWS: usize = 64;
/// Below this many multiply-adds the whole product runs on the calling thread.
const SEQ_WORK: usize = 64 * 1024;

fn gemm<T: WElem>(isa: Isa, x: &[f32], m: usize, pw: &PanelWeight, w: &[T], y: &mut [f32]) {
    let (k, n, np) = (pw.k, pw.n, pw.np);
    let sh = shape(isa);
    assert_eq!(np, sh.np, "panel gemm: weight packed {np} wide, {isa:?} runs {}", sh.np);
    let panels = n.div_ceil(np);
    assert!(x.len() >= m * k && w.len() >= panels * np * k && y.len() >= m * n, "panel gemm: buffers too small for {m}x{k} · ({n}x{k})ᵀ");
    if m == 0 || n == 0 {
        return;
    }
    let base = Block { x: x.as_ptr(), w: w.as_ptr(), y: y.as_mut_ptr(), k, n, np, rows: (0, m), panels: (0, panels) };
    let threads = rayon::current_num_threads();
    if threads == 1 || m * n * k < SEQ_WORK {
        // SAFETY: one block covering all of y, on this thread; the assert bounds x, W and y.
        unsafe { run_block(isa, &base) };
        return;
    }
    let mr = sh.mr;
    let bm = if m <= MAX_BLOCK_ROWS { m } else { MAX_BLOCK_ROWS / mr * mr };
    let mblocks = m.div_ceil(bm);
    let short = m <= SHORT_ROWS.min(mr);
    // Enough tasks for load balance on a shared machine, few enough that each streams a long
    // run of panels (the far prefetch never covers a task's first panel). Single-pass blocks
    // are light per byte, so they take more, shorter tasks.
    let want = (threads * if short { 16 } else { 4 }).div_ceil(mblocks);
    let mut bp = panels.div_ceil(want).max(1);
    if short {
        bp = bp.next_multiple_of(sh.short_p[m]);
    }
    let pblocks = panels.div_ceil(bp);
    let (xp, wp, yp) = (SyncPtr(base.x), SyncPtr(base.w), SyncPtr(base.y as *const f32));
    (0..mblocks * pblocks).into_par_iter().for_each(|t| {
        let (bi, bj) = (t / pblocks, t % pblocks);
        let (xp, wp, yp) = (xp, wp, yp);
        let rows = (bi * bm, ((bi + 1) * bm).min(m));
        let b = Block { x: xp.0, w: wp.0, y: yp.0 as *mut f32, rows, panels: (bj * bp, ((bj + 1) * bp).min(panels)), ..base };
        // SAFETY: tasks own disjoint rectangles of y; the assert bounds x, W and y.
        unsafe { run_block(isa, &b) };
    });
}

/// `y = x · Wᵀ`, x `[m, k]`, y `[m, n]`.
pub fn matmul(x: &[f32], m: usize, w: &PanelWeight, y: &mut [f32]) {
    match &w.data {
        PanelData::F32(v) => gemm(isa(), x, m, w, v, y),
        PanelData::Bf16(v) => gemm(isa(), x, m, w, v, y),
    }
}

/// `y[p] = x[p] · W_gᵀ` for every row p in group g's range `offsets[g]..offsets[g + 1]`: an
/// MoE layer's experts, each over the rows routed to it, in one parallel region. Every element is
/// computed exactly as [`matmul`] computes it (the same tile kernels, one chain over k from
/// zero), so a row's result does not depend on which rows share its group. All weights have the
/// same `[n, k]`; x and y have row strides k and n.
pub fn matmul_grouped<'w>(x: &[f32], y: &mut [f32], offsets: &[u32], weight: &(dyn Fn(usize) -> &'w PanelWeight + Sync)) {
    let groups = offsets.len().saturating_sub(1);
    let rows = |g: usize| (offsets[g] as usize, offsets[g + 1] as usize);
    let Some(g0) = (0..groups).find(|&g| rows(g).1 > rows(g).0) else { return };
    let (k, n, np) = (weight(g0).k, weight(g0).n, weight(g0).np);
    let isa = isa();
    let sh = shape(isa);
    assert_eq!(np, sh.np, "grouped panel gemm: weight packed {np} wide, {isa:?} runs {}", sh.np);
    let total = offsets[groups] as usize;
    assert!(x.len() >= total * k && y.len() >= total * n, "grouped panel gemm: buffers too small for {total} rows of {k} -> {n}");
    let panels = n.div_ceil(np);
    let (xp, yp) = (SyncPtr(x.as_ptr()), SyncPtr(y.as_mut_ptr() as *const f32));
    // Group g, rows `r`, panels `pn`: one block against g's weight.
    let run = |g: usize, r: (usize, usize), pn: (usize, usize)| {
        let w = weight(g);
        assert!(w.k == k && w.n == n && w.np == np, "grouped panel gemm: expert {g} is [{}, {}], expected [{n}, {k}]", w.n, w.k);
        let (xp, yp) = (xp, yp);
        #[allow(clippy::too_many_arguments)]
        fn go<T: WElem>(isa: Isa, x: *const f32, w: &[T], y: *mut f32, k: usize, n: usize, np: usize, rows: (usize, usize), panels: (usize, usize)) {
            let b = Block { x, w: w.as_ptr(), y, k, n, np, rows, panels };
            // SAFETY: the assert above bounds x and y by the last group's end; W holds whole
            // panels; callers give each block a disjoint rectangle of y.
            unsafe { run_block(isa, &b) }
        }
        match &w.data {
            PanelData::F32(v) => go(isa, xp.0, v, yp.0 as *mut f32, k, n, np, r, pn),
            PanelData::Bf16(v) => go(isa, xp.0, v, yp.0 as *mut f32, k, n, np, r, pn),
        }
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || total * n * k < SEQ_WORK {
        (0..groups).filter(|&g| rows(g).1 > rows(g).0).for_each(|g| run(g, rows(g), (0, panels)));
        return;
    }
    // The split of `gemm`, with the task count shared out over every group's row blocks.
    let bm = |m: usize| if m <= MAX_BLOCK_ROWS { m } else { MAX_BLOCK_ROWS / sh.mr * sh.mr };
    let row_blocks: usize = (0..groups).map(|g| rows(g).1 - rows(g).0).filter(|&m| m > 0).map(|m| m.div_ceil(bm(m))).sum();
    let split = |m: usize| {
        let short = m <= SHORT_ROWS.min(sh.mr);
        let want = (threads * if short { 16 } else { 4 }).div_ceil(row_blocks);
        let mut bp = panels.div_ceil(want).max(1);
        if short {
            bp = bp.next_multiple_of(sh.short_p[m]);
        }
        (bm(m), bp)
    };
    (0..groups).into_par_iter().for_each(|g| {
        let (r0, r1) = rows(g);
        if r1 == r0 {
            return;
        }
        let (bm, bp) = split(r1 - r0);
        let pblocks = panels.div_ceil(bp);
        let mblocks = (r1 - r0).div_ceil(bm);
        (0..mblocks * pblocks).into_par_iter().for_each(|t| {
            let (bi, bj) = (t / pblocks, t % pblocks);
            run(g, (r0 + bi * bm, (r0 + (bi + 1) * bm).min(r1)), (bj * bp, ((bj + 1) * bp).min(panels)));
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut impl Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn seed() -> u64 {
        let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        eprintln!("panel test seed {s}");
        s
    }

    /// Within k ulps of Σ|terms| of the f64 dot product.
    fn check(got: &[f32], x: &[f32], w: &[f32], m: usize, k: usize, n: usize, what: &str) {
        for i in 0..m {
            for j in 0..n {
                let (mut e, mut mag) = (0.0f64, 0.0f64);
                for t in 0..k {
                    let p = x[i * k + t] as f64 * w[j * k + t] as f64;
                    e += p;
                    mag += p.abs();
                }
                let g = got[i * n + j] as f64;
                assert!((g - e).abs() <= 1.2e-7 * k as f64 * mag + 1e-30, "{what} m={m} k={k} n={n} [{i},{j}]: {g} vs {e}");
            }
        }
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f") {
                    v.push(Isa::Avx512);
                }
            }
        }
        v
    }

    /// One block over all of y with a given instruction set.
    fn run(isa: Isa, x: &[f32], m: usize, w: &PanelWeight) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.n];
        fn go<T: WElem>(isa: Isa, x: &[f32], m: usize, w: &PanelWeight, v: &[T], y: &mut [f32]) {
            let b = Block { x: x.as_ptr(), w: v.as_ptr(), y: y.as_mut_ptr(), k: w.k, n: w.n, np: w.np, rows: (0, m), panels: (0, w.n.div_ceil(w.np)) };
            assert_eq!(w.np, shape(isa).np);
            // SAFETY: one block over all of y; `isa` was detected on this CPU.
            unsafe { run_block(isa, &b) }
        }
        match &w.data {
            PanelData::F32(v) => go(isa, x, m, w, v, &mut y),
            PanelData::Bf16(v) => go(isa, x, m, w, v, &mut y),
        }
        y
    }

    #[test]
    fn every_isa_is_accurate_and_batch_invariant_on_odd_shapes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        for &(m, k, n) in &[(1, 1, 1), (2, 9, 70), (3, 7, 5), (4, 31, 33), (6, 20, 16), (7, 8, 100), (9, 45, 13), (8, 16, 48), (12, 50, 65), (16, 100, 97), (17, 33, 49), (5, 577, 131), (13, 64, 96)] {
            let x = random(&mut rng, m * k);
            let w = random(&mut rng, n * k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            for isa in isas() {
                let (pf, pb) = (PanelWeight::from_f32_for(isa, n, k, &w), PanelWeight::from_bf16_for(isa, n, k, &wb));
                let (yf, yb) = (run(isa, &x, m, &pf), run(isa, &x, m, &pb));
                check(&yf, &x, &w, m, k, n, &format!("{isa:?} f32"));
                check(&yb, &x, &wr, m, k, n, &format!("{isa:?} bf16"));
                for i in 0..m {
                    let row = &x[i * k..(i + 1) * k];
                    assert_eq!(run(isa, row, 1, &pf), yf[i * n..(i + 1) * n], "{isa:?} f32 row {i} of {m}");
                    assert_eq!(run(isa, row, 1, &pb), yb[i * n..(i + 1) * n], "{isa:?} bf16 row {i} of {m}");
                }
            }
        }
    }

    /// The parallel split (row blocks × panel groups) gives each row the bits of its 1-row
    /// product, at sizes that take it.
    #[test]
    fn parallel_rows_equal_their_one_row_products_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        for &(m, k, n) in &[(130, 576, 960), (16, 1536, 577), (70, 64, 1000), (7, 100, 33)] {
            let x: Vec<f32> = random(&mut rng, m * k).iter().enumerate().map(|(t, &v)| if t % k % 97 == 3 { v * 300.0 } else { v }).collect();
            let w = random(&mut rng, n * k);
            let pw = PanelWeight::from_f32(n, k, &w);
            let mut all = vec![f32::NAN; m * n];
            matmul(&x, m, &pw, &mut all);
            check(&all, &x, &w, m, k, n, "parallel");
            for i in 0..m {
                let mut one = vec![f32::NAN; n];
                matmul(&x[i * k..(i + 1) * k], 1, &pw, &mut one);
                assert_eq!(one, all[i * n..(i + 1) * n], "row {i} of {m}");
            }
        }
    }

    /// The grouped product (MoE experts over their row groups, parallel split shared across
    /// groups) gives every row the bits of its 1-row product against its group's weight.
    #[test]
    fn grouped_rows_equal_their_one_row_products_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        for &(k, n, ref sizes) in &[(64usize, 96usize, vec![0usize, 3, 1, 0, 17, 2, 70, 0]), (200, 33, vec![1, 1, 1, 1]), (48, 1536, vec![5, 0, 9])] {
            let ws: Vec<Vec<f32>> = sizes.iter().map(|_| random(&mut rng, n * k)).collect();
            let pws: Vec<PanelWeight> = ws.iter().map(|w| PanelWeight::from_f32(n, k, w)).collect();
            let mut offsets = vec![0u32];
            for &s in sizes {
                offsets.push(offsets.last().unwrap() + s as u32);
            }
            let m = *offsets.last().unwrap() as usize;
            let x = random(&mut rng, m * k);
            let mut y = vec![f32::NAN; m * n];
            matmul_grouped(&x, &mut y, &offsets, &|g| &pws[g]);
            for g in 0..sizes.len() {
                for r in offsets[g] as usize..offsets[g + 1] as usize {
                    let mut one = vec![f32::NAN; n];
                    matmul(&x[r * k..(r + 1) * k], 1, &pws[g], &mut one);
                    assert_eq!(one, y[r * n..(r + 1) * n], "group {g} row {r} of {m} (k={k} n={n})");
                }
            }
        }
    }

    #[test]
    fn rows_read_back_from_panels() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        let (n, k) = (101, 37);
        let w = random(&mut rng, n * k);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut row = vec![0.0; k];
        for isa in isas() {
            let (pf, pb) = (PanelWeight::from_f32_for(isa, n, k, &w), PanelWeight::from_bf16_for(isa, n, k, &wb));
            for r in [0, 15, 16, 47, 48, 100] {
                pf.row_f32(r, &mut row);
                assert_eq!(row, w[r * k..(r + 1) * k], "{isa:?} row {r}");
                pb.row_f32(r, &mut row);
                assert_eq!(row, wb[r * k..(r + 1) * k].iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "{isa:?} row {r}");
            }
        }
    }

    /// Model-shaped products over distinct weights that stream from DRAM, as in a forward pass
    /// (400 MB of copies, more than the L3 holds; `GEMM_COPIES=1` for one cache-resident copy),
    /// f32 and bf16 panels, and the AMX tiles where the CPU has them; `GEMM_M=1,16` picks rows.
    /// `cargo test --release -p quiver-kernels panel_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn panel_timing() {
        use super::super::amx;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let ms: Vec<usize> = std::env::var("GEMM_M").ok().map_or(vec![1, 4, 16, 64, 512], |v| v.split(',').filter_map(|s| s.parse().ok()).collect());
        for &(k, n) in &[(576, 960), (576, 3072), (1536, 576), (576, 49152)] {
            let copies = std::env::var("GEMM_COPIES").ok().and_then(|v| v.parse().ok()).unwrap_or(((400 << 20) / (n * k * 4)).max(3));
            let raw: Vec<Vec<f32>> = (0..copies).map(|_| random(&mut rng, n * k)).collect();
            let pf: Vec<PanelWeight> = raw.iter().map(|w| PanelWeight::from_f32(n, k, w)).collect();
            let pb: Vec<PanelWeight> = raw.iter().map(|w| PanelWeight::from_bf16(n, k, &w.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())).collect();
            let tiled: Vec<amx::TiledWeight> = if amx::supported() { raw.iter().map(|w| amx::TiledWeight::from_f32(n, k, w)).collect() } else { Vec::new() };
            drop(raw);
            for &m in &ms {
                let x = random(&mut rng, m * k);
                let mut y = vec![0.0; m * n];
                let mut time = |f: &mut dyn FnMut(&mut [f32])| {
                    let t = std::time::Instant::now();
                    f(&mut y);
                    t.elapsed().as_secs_f64() / copies as f64
                };
                for _ in 0..if m >= 64 { 1 } else { 3 } {
                    let tf = time(&mut |y| pf.iter().for_each(|w| matmul(&x, m, w, y)));
                    let tb = time(&mut |y| pb.iter().for_each(|w| matmul(&x, m, w, y)));
                    let ta = time(&mut |y| tiled.iter().for_each(|w| amx::matmul(&x, m, w, y)));
                    let gf = |dt: f64| 2.0 * (m * n * k) as f64 / dt / 1e9;
                    let amx = if tiled.is_empty() { String::new() } else { format!(" | amx f32 {:6.1} GFLOP/s", gf(ta)) };
                    eprintln!("k={k:5} n={n:5} m={m:3}: f32 {:7.1} us {:6.1} GFLOP/s {:5.1} GB/s | bf16 {:7.1} us {:6.1} GFLOP/s{amx}", tf * 1e6, gf(tf), (n * k * 4) as f64 / tf / 1e9, tb * 1e6, gf(tb));
                }
            }
        }
    }
}
