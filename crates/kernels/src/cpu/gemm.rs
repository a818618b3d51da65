//! `y = x · Wᵀ` with W `[n, k]` row-major (f32 or bf16), x `[m, k]`, y `[m, n]`: our own GEMM,
//! used for every M (decode and prefill alike).
//!
//! **Invariant: the accumulation order of every output element is independent of M.** Each
//! `y[i, j]` is the dot product of two contiguous rows, `x[i, :]` and `W[j, :]`, computed the
//! same way wherever it lands: `L` lane accumulators run over k in chunks of `L` (first the
//! `k mod L` tail as one zero-padded chunk, then the full chunks in increasing k), one
//! multiply-add per lane and chunk; then the `L` lanes are summed by a fixed halving tree.
//! Register tiles (`MR` rows of x × `NR` rows of W, smaller at the edges), cache blocks, aligned
//! copies and the split into parallel tasks only decide *which* elements are computed together,
//! never how one is computed. So a sequence's logits are bit-identical whether it runs alone
//! (decode, M = 1), inside a decode batch or inside a prefill chunk: batch invariance by
//! construction, not by tolerance. Keep it that way: never split k across tasks, reorder the
//! chunks, or let the tail or the reduction depend on the tile.
//!
//! The lane count and FMA-or-not depend on the instruction set (AVX-512: 16 lanes, 6×4 tiles, 8×3
//! for blocks of 7–8 rows;
//! AVX2+FMA: 8 lanes, 2×4; portable: 8 lanes, no FMA), chosen once per process at run time, so
//! results are reproducible on one machine but may differ in the last bits between machines.
//!
//! No packing: W is streamed as stored (bf16 rows are widened to f32 in registers, so memory
//! traffic stays at 2 bytes per weight while the arithmetic is f32), which is what decode
//! (small M, bandwidth-bound) wants. For larger M, a task's block of W (≤ 64 rows) stays in L2
//! while each x tile (in L1) passes over it.

use super::simd::{isa, Isa};
use super::SyncPtr;
use half::bf16;
use rayon::prelude::*;
use std::cell::RefCell;

/// One instruction set's vector of `L` f32 lanes and the few operations the kernel needs.
/// `reduce4` must sum each vector's lanes by the halving tree of [`reduce_tree`].
pub(super) trait Simd {
    type V: Copy;
    const L: usize;
    /// Rows of x per register tile (× `NR` rows of W).
    const MR: usize;
    /// Rows of x per tall tile (× `NR - 1` rows of W), for blocks of `MR + 1 ..= MR_TALL` rows,
    /// which it covers in one pass over W; 0 for none.
    const MR_TALL: usize = 0;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn load_bf16(p: *const bf16) -> Self::V;
    /// `a · b + c` per lane.
    unsafe fn madd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Hint that the cache line at `p` will be read soon (never faults, any address).
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    unsafe fn reduce4(v: [Self::V; NR]) -> [f32; NR];
}

/// Rows of W per register tile, on every instruction set.
pub(super) const NR: usize = 4;

/// Sum of the lanes by a fixed halving tree: lane l += lane l + L/2, then l + L/4, …, 1.
#[inline(always)]
fn reduce_tree<const L: usize>(mut v: [f32; L]) -> f32 {
    let mut h = L / 2;
    while h >= 1 {
        for l in 0..h {
            v[l] += v[l + h];
        }
        h /= 2;
    }
    v[0]
}

/// Plain Rust, for targets without AVX2: 8 lanes, separate multiply and add (a software FMA
/// would be slow).
pub(super) struct Portable;
impl Simd for Portable {
    type V = [f32; 8];
    const L: usize = 8;
    const MR: usize = 2;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        unsafe { (p as *const [f32; 8]).read_unaligned() }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> Self::V {
        let raw = unsafe { (p as *const [u16; 8]).read_unaligned() };
        raw.map(|b| f32::from_bits((b as u32) << 16))
    }
    #[inline(always)]
    unsafe fn madd(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|l| a[l] * b[l] + c[l])
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self::V {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        unsafe { (p as *mut [f32; 8]).write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn reduce4(v: [Self::V; NR]) -> [f32; NR] {
        v.map(reduce_tree)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{bf16, Simd, NR};
    use std::arch::x86_64::*;

    pub(in crate::cpu) struct Avx512;
    impl Simd for Avx512 {
        type V = __m512;
        const L: usize = 16;
        const MR: usize = 6;
        const MR_TALL: usize = 8;
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn load_bf16(p: *const bf16) -> __m512 {
            unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)))) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn madd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn splat(v: f32) -> __m512 {
            _mm512_set1_ps(v)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
        /// Four vectors' trees at once; 128-bit blocks Xb of vector X hold lanes 4b..4b+3.
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn reduce4([a, b, c, d]: [__m512; NR]) -> [f32; NR] {
            unsafe {
                // h = 8: [A0+A2, A1+A3, B0+B2, B1+B3] and the same for C, D.
                let ab = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b));
                let cd = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(c, d), _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d));
                // h = 4: one block per vector, [A, B, C, D].
                let s = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd), _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd));
                // h = 2, then h = 1, inside each block; lane 0 of each block is its vector's sum.
                let s = _mm512_add_ps(s, _mm512_shuffle_ps::<0b11_10_11_10>(s, s));
                let s = _mm512_add_ps(s, _mm512_shuffle_ps::<0b01_01_01_01>(s, s));
                let r = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
                let mut out = [0.0f32; NR];
                _mm_storeu_ps(out.as_mut_ptr(), r);
                out
            }
        }
    }

    pub(in crate::cpu) struct Avx2;
    impl Simd for Avx2 {
        type V = __m256;
        const L: usize = 8;
        const MR: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_bf16(p: *const bf16) -> __m256 {
            unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)))) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn madd(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn splat(v: f32) -> __m256 {
            _mm256_set1_ps(v)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
        /// Four vectors' trees at once; 128-bit halves X0, X1 of vector X hold lanes 0..3, 4..7.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn reduce4([a, b, c, d]: [__m256; NR]) -> [f32; NR] {
            unsafe {
                // h = 4: [A0+A1 | B0+B1] and [C0+C1 | D0+D1].
                let ab = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b));
                let cd = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(c, d), _mm256_permute2f128_ps::<0x31>(c, d));
                // h = 2: [a0+a2, a1+a3, c0+c2, c1+c3 | the same for b, d].
                let u = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(ab, cd), _mm256_shuffle_ps::<0b11_10_11_10>(ab, cd));
                // h = 1: [a, c, a, c | b, d, b, d].
                let v = _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(u, u), _mm256_shuffle_ps::<0b11_01_11_01>(u, u));
                let r = _mm_unpacklo_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let mut out = [0.0f32; NR];
                _mm_storeu_ps(out.as_mut_ptr(), r);
                out
            }
        }
    }
}

/// An element type of W: f32, or bf16 widened to f32 on load.
pub(super) trait WElem: Copy + Default + Send + Sync + 'static {
    /// # Safety
    /// `p..p + S::L` must be readable and the CPU must support `S`.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
}

impl WElem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        unsafe { S::load(p) }
    }
}

impl WElem for bf16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const bf16) -> S::V {
        unsafe { S::load_bf16(p) }
    }
}

/// One `R × NR` register tile: `out[i][j] = x_i · w_j` over `k`.
///
/// # Safety
/// Every `xs[i]` and `ws[j]` must point at `k` readable elements; the CPU must support `S`.
#[inline(always)]
pub(super) unsafe fn tile<S: Simd, const R: usize, T: WElem>(xs: [*const f32; R], ws: [*const T; NR], k: usize) -> [[f32; NR]; R] {
    unsafe { tile_n::<S, R, NR, T>(xs, ws, k) }
}

/// [`tile`] with `NC ≤ NR` rows of W: every element computed exactly as there (the lane
/// reduction of each vector does not depend on the others passed to `reduce4`).
///
/// # Safety
/// As for [`tile`].
#[inline(always)]
pub(super) unsafe fn tile_n<S: Simd, const R: usize, const NC: usize, T: WElem>(xs: [*const f32; R], ws: [*const T; NC], k: usize) -> [[f32; NC]; R] {
    unsafe {
        let full = k / S::L * S::L;
        let mut acc = [[S::zero(); NC]; R];
        if full < k {
            // The tail is one zero-padded chunk, taken first (the same place for every element).
            // Copy it out before any accumulator is live: the copies may be calls, and vector
            // registers do not survive calls.
            let r = k - full;
            let mut xt = [[0.0f32; 16]; R];
            let mut wt = [[T::default(); 16]; NC];
            for i in 0..R {
                std::ptr::copy_nonoverlapping(xs[i].add(full), xt[i].as_mut_ptr(), r);
            }
            for j in 0..NC {
                std::ptr::copy_nonoverlapping(ws[j].add(full), wt[j].as_mut_ptr(), r);
            }
            for i in 0..R {
                let xv = S::load(xt[i].as_ptr());
                for j in 0..NC {
                    acc[i][j] = S::madd(xv, T::load::<S>(wt[j].as_ptr()), acc[i][j]);
                }
            }
        }
        let mut wv = [S::zero(); NC];
        let mut c = 0;
        while c < full {
            for j in 0..NC {
                // The same place in the next group of W rows (rows are contiguous, so that is
                // `NC·k` further), one line per row and chunk: the next tile's first pass over W
                // then finds it in cache instead of waiting on DRAM with four short streams the
                // hardware prefetcher ramps up too late for. Measured +35% on 16-row and +60% on
                // 4-row decode steps of SmolLM2 f32 (A/B in one run); past the block's end it is
                // a harmless hint.
                S::prefetch(ws[j].wrapping_add(NC * k + c) as *const u8);
                wv[j] = T::load::<S>(ws[j].add(c));
            }
            for i in 0..R {
                let xv = S::load(xs[i].add(c));
                for j in 0..NC {
                    acc[i][j] = S::madd(xv, wv[j], acc[i][j]);
                }
            }
            c += S::L;
        }
        let mut out = [[0.0; NC]; R];
        for i in 0..R {
            let mut v = [S::zero(); NR];
            v[..NC].copy_from_slice(&acc[i]);
            let r = S::reduce4(v);
            out[i].copy_from_slice(&r[..NC]);
        }
        out
    }
}

/// What one task computes: `y[rows, cols]`. `y` points at `y[0, 0]`, row stride `n`.
#[derive(Clone, Copy)]
struct Block<T> {
    x: *const f32,
    w: *const T,
    y: *mut f32,
    k: usize,
    n: usize,
    rows: (usize, usize),
    cols: (usize, usize),
    accumulate: bool,
}

/// # Safety
/// `y[r, c]` for `r` in `rows`, `c` in `cols` is written by this call only; x and W cover the block.
#[inline(always)]
unsafe fn store<const R: usize, const NC: usize>(b: &Block<impl WElem>, i0: usize, j0: usize, out: [[f32; NC]; R]) {
    let cn = NC.min(b.cols.1 - j0);
    for (i, row) in out.iter().enumerate() {
        let yr = unsafe { b.y.add((i0 + i) * b.n + j0) };
        for (j, &v) in row.iter().enumerate().take(cn) {
            unsafe {
                if b.accumulate {
                    *yr.add(j) += v;
                } else {
                    *yr.add(j) = v;
                }
            }
        }
    }
}

/// The body of one task. For each row tile of x (which then stays in L1), every group of `NR`
/// rows of W in the block passes over it (from L2 once the block has been read). A last partial
/// row tile uses a smaller tile; a last partial group of W rows repeats its last row and drops
/// the extra results. Neither changes how an element is computed.
///
/// # Safety
/// See `store`; the CPU must support `S`.
#[inline(always)]
unsafe fn block_body<S: Simd, T: WElem>(b: &Block<T>) {
    let (r0, r1) = b.rows;
    let m = r1 - r0;
    let mut i0 = r0;
    unsafe {
        if m > S::MR && m <= S::MR_TALL {
            // One pass over the block of W instead of two (7 or 8 rows: one tile of 8 instead of
            // 6 + 2), with one W row less per tile to stay within the registers. Measured +6% on
            // 8-row decode steps (196.5 → 208.5 tok/s, medians of six alternated runs); at 16
            // rows two passes of 8 × 3 were no better than three of 6 × 4 (−3%, noise), so
            // larger blocks keep the 6 × 4 tile.
            while i0 < r1 {
                let rows = S::MR_TALL.min(r1 - i0);
                match rows {
                    1 => row_tile::<S, 1, { NR - 1 }, T>(b, i0),
                    2 => row_tile::<S, 2, { NR - 1 }, T>(b, i0),
                    3 => row_tile::<S, 3, { NR - 1 }, T>(b, i0),
                    4 => row_tile::<S, 4, { NR - 1 }, T>(b, i0),
                    5 => row_tile::<S, 5, { NR - 1 }, T>(b, i0),
                    6 => row_tile::<S, 6, { NR - 1 }, T>(b, i0),
                    7 => row_tile::<S, 7, { NR - 1 }, T>(b, i0),
                    8 => row_tile::<S, 8, { NR - 1 }, T>(b, i0),
                    _ => unreachable!("MR_TALL is at most 8"),
                }
                i0 += rows;
            }
            return;
        }
        while i0 < r1 {
            let rows = S::MR.min(r1 - i0);
            match rows {
                1 => row_tile::<S, 1, NR, T>(b, i0),
                2 => row_tile::<S, 2, NR, T>(b, i0),
                3 => row_tile::<S, 3, NR, T>(b, i0),
                4 => row_tile::<S, 4, NR, T>(b, i0),
                5 => row_tile::<S, 5, NR, T>(b, i0),
                6 => row_tile::<S, 6, NR, T>(b, i0),
                _ => unreachable!("MR is at most 6"),
            }
            i0 += rows;
        }
    }
}

/// Rows `i0..i0 + R` of x against every row of W in the block.
///
/// # Safety
/// See `store`; the CPU must support `S`.
#[inline(always)]
unsafe fn row_tile<S: Simd, const R: usize, const NC: usize, T: WElem>(b: &Block<T>, i0: usize) {
    let (c0, c1) = b.cols;
    let mut xs = [b.x; R];
    for (i, p) in xs.iter_mut().enumerate() {
        *p = unsafe { b.x.add((i0 + i) * b.k) };
    }
    let mut j0 = c0;
    while j0 < c1 {
        let mut ws = [b.w; NC];
        for (j, p) in ws.iter_mut().enumerate() {
            *p = unsafe { b.w.add((j0 + j).min(c1 - 1) * b.k) };
        }
        unsafe { store::<R, NC>(b, i0, j0, tile_n::<S, R, NC, T>(xs, ws, b.k)) };
        j0 += NC;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_entry {
    use super::x86::{Avx2, Avx512};
    use super::{block_body, Block, WElem};
    /// # Safety
    /// The CPU has AVX-512F; see `store`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn avx512<T: WElem>(b: &Block<T>) {
        unsafe { block_body::<Avx512, T>(b) }
    }
    /// # Safety
    /// The CPU has AVX2 and FMA; see `store`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2<T: WElem>(b: &Block<T>) {
        unsafe { block_body::<Avx2, T>(b) }
    }
}

/// Rows of x per register tile on this instruction set.
fn mr_of(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => <x86::Avx512 as Simd>::MR,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => <x86::Avx2 as Simd>::MR,
        _ => Portable::MR,
    }
}

/// # Safety
/// See `store`; `isa` is what this CPU supports.
unsafe fn run_block<T: WElem>(isa: Isa, b: &Block<T>) {
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86_entry::avx512(b),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86_entry::avx2(b),
            _ => block_body::<Portable, T>(b),
        }
    }
}

/// Rows of x per task at most: a block of x rows and a block of W rows both stay in L2.
const MAX_BLOCK_ROWS: usize = 64;
/// Rows of W per task at most.
const MAX_BLOCK_COLS: usize = 64;
/// Below this many multiply-adds the whole product runs on the calling thread.
const SEQ_WORK: usize = 64 * 1024;


fn gemm<T: WElem>(x: &[f32], m: usize, k: usize, w: &[T], n: usize, y: &mut [f32], accumulate: bool) {
    assert!(x.len() >= m * k && w.len() >= n * k && y.len() >= m * n, "gemm: buffers too small for {m}x{k} · ({n}x{k})ᵀ");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            y[..m * n].fill(0.0);
        }
        return;
    }
    // Misaligned rows make every vector load span two cache lines (~25% slower in cache); our
    // buffers come from the allocator 16-byte aligned. x is copied once per call; a task's block
    // of W only when enough rows of x reuse it (small M is bound by DRAM, not by loads).
    XCOPY.with(|buf| match buf.try_borrow_mut() {
        // SAFETY: `aligned` copies the m·k elements of x that the assert above bounds.
        Ok(mut buf) => gemm_blocks(unsafe { aligned(&mut buf, x.as_ptr(), m * k, k) }, m, k, w, n, y, accumulate),
        Err(_) => gemm_blocks(x.as_ptr(), m, k, w, n, y, accumulate),
    })
}

thread_local! {
    static XCOPY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static WCOPY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Rows of x a task needs before its block of W is copied to aligned scratch.
const ALIGN_W_MIN_ROWS: usize = 16;

/// `src` if it is 64-byte aligned or its rows of `k` elements could not all be; else a copy of
/// its `len` elements at the aligned start of `buf` (which grows once to the largest need).
///
/// # Safety
/// `src..src + len` must be readable and stay unchanged while the result is used.
unsafe fn aligned<T: Copy>(buf: &mut Vec<u8>, src: *const T, len: usize, k: usize) -> *const T {
    let size = std::mem::size_of::<T>();
    if (src as usize).is_multiple_of(64) || !(k * size).is_multiple_of(64) {
        return src;
    }
    if buf.len() < len * size + 64 {
        buf.resize(len * size + 64, 0);
    }
    let off = buf.as_ptr().align_offset(64);
    unsafe {
        let dst = buf.as_mut_ptr().add(off) as *mut T;
        std::ptr::copy_nonoverlapping(src, dst, len);
        dst
    }
}

/// `gemm` on x at `x` (m·k readable elements).
fn gemm_blocks<T: WElem>(x: *const f32, m: usize, k: usize, w: &[T], n: usize, y: &mut [f32], accumulate: bool) {
    let isa = isa();
    let (mr, nr) = (mr_of(isa), NR);
    let base = Block { x, w: w.as_ptr(), y: y.as_mut_ptr(), k, n, rows: (0, m), cols: (0, n), accumulate };
    let threads = rayon::current_num_threads();
    if threads == 1 || m * n * k < SEQ_WORK {
        // SAFETY: one block covering all of y, on this thread; the caller bounds x, W, y.
        unsafe { run_block(isa, &base) };
        return;
    }
    let bm = if m <= MAX_BLOCK_ROWS { m } else { MAX_BLOCK_ROWS / mr * mr };
    let mblocks = m.div_ceil(bm);
    // Enough tasks for load balance on a shared machine, few enough to keep each one long.
    let want = (threads * 8).div_ceil(mblocks);
    let bn = n.div_ceil(want).next_multiple_of(nr).clamp(nr, MAX_BLOCK_COLS.max(nr));
    let nblocks = n.div_ceil(bn);
    let (xp, wp, yp) = (SyncPtr(base.x), SyncPtr(base.w), SyncPtr(base.y as *const f32));
    (0..mblocks * nblocks).into_par_iter().for_each(|t| {
        let (bi, bj) = (t / nblocks, t % nblocks);
        let (xp, wp, yp) = (xp, wp, yp);
        let (rows, cols) = ((bi * bm, ((bi + 1) * bm).min(m)), (bj * bn, ((bj + 1) * bn).min(n)));
        let b = Block { x: xp.0, w: wp.0, y: yp.0 as *mut f32, rows, cols, ..base };
        if rows.1 - rows.0 < ALIGN_W_MIN_ROWS {
            // SAFETY: tasks own disjoint rectangles of y; the caller bounds x, W and y.
            return unsafe { run_block(isa, &b) };
        }
        WCOPY.with(|buf| match buf.try_borrow_mut() {
            // SAFETY: as above; the copy holds W rows cols.0..cols.1, so columns are re-based
            // to it and y is offset to match.
            Ok(mut buf) => unsafe {
                let wa = aligned(&mut buf, b.w.add(cols.0 * k), (cols.1 - cols.0) * k, k);
                run_block(isa, &Block { w: wa, y: b.y.add(cols.0), cols: (0, cols.1 - cols.0), ..b })
            },
            // SAFETY: as above.
            Err(_) => unsafe { run_block(isa, &b) },
        });
    });
}

/// f32 GEMM. `accumulate` adds into `y` instead of overwriting it.
pub fn matmul_f32(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32], accumulate: bool) {
    gemm(x, m, k, w, n, y, accumulate)
}

/// bf16-weight GEMM, accumulating in f32 exactly like `matmul_f32` on the widened weights.
pub fn matmul_bf16(x: &[f32], m: usize, k: usize, w: &[bf16], n: usize, y: &mut [f32]) {
    gemm(x, m, k, w, n, y, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>();
            }
        }
        y
    }

    fn random(rng: &mut impl Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Bound for a k-term f32 dot product against the exact value: k ulps of the sum of |terms|.
    #[allow(clippy::too_many_arguments)]
    fn check(got: &[f32], want: &[f64], x: &[f32], w: &[f32], m: usize, k: usize, n: usize, what: &str) {
        for i in 0..m {
            for j in 0..n {
                let mag: f64 = (0..k).map(|t| (x[i * k + t] as f64 * w[j * k + t] as f64).abs()).sum();
                let (g, e) = (got[i * n + j] as f64, want[i * n + j]);
                assert!((g - e).abs() <= 1e-6 * (k as f64).sqrt() * mag + 1e-30, "{what} m={m} k={k} n={n} [{i},{j}]: {g} vs {e}");
            }
        }
    }

    fn seed() -> u64 {
        let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        eprintln!("gemm test seed {s}");
        s
    }

    #[test]
    fn f32_and_bf16_match_f64_reference_on_odd_shapes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        // Odd shapes, then shapes big enough for the parallel path and the aligned copies.
        let odd = (1..=37).map(|m| (m, [1, 7, 15, 17, 33, 63, 129, 577][m % 8], [1, 3, 5, 13, 31, 67, 131][m % 7]));
        for (m, k, n) in odd.chain([(40, 576, 37), (70, 64, 101), (17, 1536, 45)]) {
            let x = random(&mut rng, m * k);
            let w = random(&mut rng, n * k);
            let mut y = vec![f32::NAN; m * n];
            matmul_f32(&x, m, k, &w, n, &mut y, false);
            check(&y, &naive(&x, m, k, &w, n), &x, &w, m, k, n, "f32");

            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let mut y = vec![f32::NAN; m * n];
            matmul_bf16(&x, m, k, &wb, n, &mut y);
            check(&y, &naive(&x, m, k, &wr, n), &x, &wr, m, k, n, "bf16");
        }
    }

    #[test]
    fn accumulate_adds_into_y() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        let (m, k, n) = (5, 33, 9);
        let (x, w) = (random(&mut rng, m * k), random(&mut rng, n * k));
        let y0 = random(&mut rng, m * n);
        let mut plain = vec![f32::NAN; m * n];
        matmul_f32(&x, m, k, &w, n, &mut plain, false);
        let mut acc = y0.clone();
        matmul_f32(&x, m, k, &w, n, &mut acc, true);
        for ((a, p), b) in acc.iter().zip(&plain).zip(&y0) {
            assert_eq!(*a, p + b);
        }
    }

    /// Batch invariance by construction: row i of an M-row product is bit-identical to the
    /// 1-row product of row i alone, at sizes that take the parallel, multi-block path too.
    #[test]
    fn each_row_equals_its_one_row_product_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        for &(m, k, n) in &[(37, 577, 131), (130, 576, 960), (9, 1536, 577), (70, 64, 1000), (16, 577, 131), (7, 100, 33)] {
            let x = random(&mut rng, m * k);
            // Real activations have outliers: make some columns large so reassociation shows.
            let x: Vec<f32> = x.iter().enumerate().map(|(t, &v)| if t % k % 97 == 3 { v * 300.0 } else { v }).collect();
            let w = random(&mut rng, n * k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut all = vec![f32::NAN; m * n];
            let mut allb = vec![f32::NAN; m * n];
            matmul_f32(&x, m, k, &w, n, &mut all, false);
            matmul_bf16(&x, m, k, &wb, n, &mut allb);
            for i in 0..m {
                let mut one = vec![f32::NAN; n];
                matmul_f32(&x[i * k..(i + 1) * k], 1, k, &w, n, &mut one, false);
                assert_eq!(one, all[i * n..(i + 1) * n], "f32 row {i} of {m}");
                matmul_bf16(&x[i * k..(i + 1) * k], 1, k, &wb, n, &mut one);
                assert_eq!(one, allb[i * n..(i + 1) * n], "bf16 row {i} of {m}");
            }
        }
    }

    /// Every instruction-set body this CPU can run (not only the one `isa()` picks) matches
    /// the reference and gives each row the same bits as its 1-row product.
    #[test]
    fn every_isa_body_is_accurate_and_batch_invariant() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f") {
                    isas.push(Isa::Avx512);
                }
            }
        }
        for &(m, k, n) in &[(11, 45, 13), (6, 16, 4), (9, 3, 7), (5, 100, 9), (8, 45, 13), (14, 100, 9)] {
            let (x, w) = (random(&mut rng, m * k), random(&mut rng, n * k));
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            for &isa in &isas {
                fn run<T: WElem>(isa: Isa, x: &[f32], m: usize, k: usize, w: &[T], n: usize) -> Vec<f32> {
                    let mut y = vec![f32::NAN; m * n];
                    let b = Block { x: x.as_ptr(), w: w.as_ptr(), y: y.as_mut_ptr(), k, n, rows: (0, m), cols: (0, n), accumulate: false };
                    // SAFETY: one block over all of y; `isa` was detected on this CPU.
                    unsafe { run_block(isa, &b) };
                    y
                }
                let all = run(isa, &x, m, k, &w, n);
                check(&all, &naive(&x, m, k, &w, n), &x, &w, m, k, n, &format!("{isa:?} f32"));
                let allb = run(isa, &x, m, k, &wb, n);
                check(&allb, &naive(&x, m, k, &wr, n), &x, &wr, m, k, n, &format!("{isa:?} bf16"));
                for i in 0..m {
                    let row = &x[i * k..(i + 1) * k];
                    assert_eq!(run(isa, row, 1, k, &w, n), all[i * n..(i + 1) * n], "{isa:?} f32 row {i}");
                    assert_eq!(run(isa, row, 1, k, &wb, n), allb[i * n..(i + 1) * n], "{isa:?} bf16 row {i}");
                }
            }
        }
    }

    /// Decode-shaped products over weights that stream from DRAM, as in a real forward pass
    /// (many distinct weights, more bytes than the L3 holds); `GEMM_M` rows (default 16).
    /// `cargo test --release -p quiver-kernels gemm_streaming -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn gemm_streaming() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let m: usize = std::env::var("GEMM_M").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
        for &(k, n) in &[(576, 960), (576, 3072), (1536, 576)] {
            let copies = (400 << 20) / (n * k * 4);
            let ws: Vec<crate::aligned::AlignedVec<f32>> = (0..copies).map(|_| crate::aligned::AlignedVec::from_slice(&random(&mut rng, n * k))).collect();
            let x = random(&mut rng, m * k);
            let mut y = vec![0.0; m * n];
            for _ in 0..3 {
                let t = std::time::Instant::now();
                for w in &ws {
                    matmul_f32(&x, m, k, w, n, &mut y, false);
                }
                let dt = t.elapsed().as_secs_f64() / copies as f64;
                eprintln!("k={k:5} n={n:5} m={m}: {:7.1} us {:5.1} GB/s {:6.1} GFLOP/s", dt * 1e6, (n * k * 4) as f64 / dt / 1e9, 2.0 * (m * n * k) as f64 / dt / 1e9);
            }
        }
    }

    /// Timing of model-shaped products; `cargo test --release -p quiver-kernels gemm_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn gemm_timing() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        {
            // Streaming ceiling: a parallel vectorized sum over a 113 MB array.
            let big = random(&mut rng, 576 * 49152);
            for _ in 0..3 {
                let t = std::time::Instant::now();
                let s: f32 = big.par_chunks(64 * 576).map(|c| crate::cpu::simd::dot(c, c)).sum();
                let dt = t.elapsed().as_secs_f64();
                eprintln!("stream sum: {:.1} GB/s ({s})", (big.len() * 4) as f64 / dt / 1e9);
            }
        }
        {
            // Cost of one parallel op issued from outside the pool, as the forward pass does.
            let mut v = vec![0.0f32; 2 * 64];
            for _ in 0..3 {
                let t = std::time::Instant::now();
                for _ in 0..2000 {
                    v.par_chunks_mut(64).for_each(|c| c[0] += 1.0);
                }
                eprintln!("handoff: {:.1} us per par op", t.elapsed().as_secs_f64() / 2000.0 * 1e6);
            }
        }
        {
            // Kernel ceiling: one thread, everything in L1/L2.
            let (m, k, n) = (48, 256, 64);
            let (xv, wv) = (random(&mut rng, m * k + 64), random(&mut rng, n * k + 64));
            let mut y = vec![0.0; m * n];
            for align in [false, true, false, true] {
            let (xo, wo) = if align { (xv.as_ptr().align_offset(64), wv.as_ptr().align_offset(64)) } else { (xv.as_ptr().align_offset(64) + 4, wv.as_ptr().align_offset(64) + 4) };
            let (x, w) = (&xv[xo..], &wv[wo..]);
            eprintln!("aligned {align}");
            let b = Block { x: x.as_ptr(), w: w.as_ptr(), y: y.as_mut_ptr(), k, n, rows: (0, m), cols: (0, n), accumulate: false };
            for _ in 0..2 {
                let t = std::time::Instant::now();
                for _ in 0..2000 {
                    // SAFETY: one block over all of y.
                    unsafe { run_block(isa(), &b) };
                }
                let dt = t.elapsed().as_secs_f64() / 2000.0;
                eprintln!("in-cache single thread: {:.1} GFLOP/s", 2.0 * (m * n * k) as f64 / dt / 1e9);
            }
            }
        }
        let only: Option<usize> = std::env::var("GEMM_M").ok().and_then(|v| v.parse().ok());
        for &(k, n) in &[(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)] {
            let w = random(&mut rng, n * k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let tiled = super::super::amx::supported().then(|| (super::super::amx::TiledWeight::from_f32(n, k, &w), super::super::amx::TiledWeight::from_bf16(n, k, &wb)));
            for &m in &[1, 4, 16, 64, 512] {
                if (n == 49152 && m > 64) || only.is_some_and(|o| o != m) {
                    continue;
                }
                let x = random(&mut rng, m * k);
                let mut y = vec![0.0; m * n];
                let reps = (2_000_000_000 / (m * n * k).max(1) / 8).clamp(3, 200);
                let time = |f: &mut dyn FnMut()| {
                    f();
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        f();
                    }
                    t.elapsed().as_secs_f64() / reps as f64
                };
                let tf = time(&mut || matmul_f32(&x, m, k, &w, n, &mut y, false));
                let tb = time(&mut || matmul_bf16(&x, m, k, &wb, n, &mut y));
                let gf = |t: f64| 2.0 * (m * n * k) as f64 / t / 1e9;
                eprintln!("k={k:5} n={n:6} m={m:4}: f32 {:8.1} us {:6.1} GFLOP/s {:5.1} GB/s | bf16 {:8.1} us {:6.1} GFLOP/s", tf * 1e6, gf(tf), (n * k * 4) as f64 / tf / 1e9, tb * 1e6, gf(tb));
                if let Some((af, ab)) = &tiled {
                    let (ta, tab) = (time(&mut || super::super::amx::matmul(&x, m, af, &mut y)), time(&mut || super::super::amx::matmul(&x, m, ab, &mut y)));
                    eprintln!("{:22}amx f32 {:6.1} GFLOP/s ({:.2}x fma) | amx bf16 {:6.1} GFLOP/s ({:.2}x fma)", "", gf(ta), tf / ta, gf(tab), tb / tab);
                }
            }
        }
    }
}
