//! Vector instruction sets behind one small trait ([`Simd`]) and the dot-product register tile
//! built on it: `MR` rows of x against `NR` rows of another row-major matrix, each element the
//! dot product of two contiguous rows. LoRA's shrink (`lora.rs`) and attention's Q·Kᵀ
//! (`attention.rs`) use the tile; the weight GEMM (`panel.rs`) uses the trait with its own
//! broadcast tile over packed panels.
//!
//! **Invariant: how an element is computed does not depend on the tile.** Each element is the
//! dot product of two contiguous rows, computed the same way wherever it lands: `L` lane
//! accumulators run over k in chunks of `L` (first the `k mod L` tail as one zero-padded chunk,
//! then the full chunks in increasing k), one multiply-add per lane and chunk; then the `L` lanes
//! are summed by a fixed halving tree. Which rows share a tile, and how many, never changes it,
//! so callers get results independent of how rows are batched.
//!
//! The lane count and FMA-or-not depend on the instruction set (AVX-512: 16 lanes; AVX2+FMA: 8
//! lanes; portable: 8 lanes, no FMA; callers pick the rows per tile), chosen once per process, so
//! results are reproducible on one machine but may differ in the last bits between machines.

use half::bf16;
/// One instruction set's vector of `L` f32 lanes and the few operations the kernel needs.
/// `reduce4` must sum each vector's lanes by the halving tree of [`reduce_tree`].
pub(super) trait Simd {
    type V: Copy;
    const L: usize;
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
    unsafe {
        let full = k / S::L * S::L;
        let mut acc = [[S::zero(); NR]; R];
        if full < k {
            // The tail is one zero-padded chunk, taken first (the same place for every element).
            // Copy it out before any accumulator is live: the copies may be calls, and vector
            // registers do not survive calls.
            let r = k - full;
            let mut xt = [[0.0f32; 16]; R];
            let mut wt = [[T::default(); 16]; NR];
            for i in 0..R {
                std::ptr::copy_nonoverlapping(xs[i].add(full), xt[i].as_mut_ptr(), r);
            }
            for j in 0..NR {
                std::ptr::copy_nonoverlapping(ws[j].add(full), wt[j].as_mut_ptr(), r);
            }
            for i in 0..R {
                let xv = S::load(xt[i].as_ptr());
                for j in 0..NR {
                    acc[i][j] = S::madd(xv, T::load::<S>(wt[j].as_ptr()), acc[i][j]);
                }
            }
        }
        let mut wv = [S::zero(); NR];
        let mut c = 0;
        while c < full {
            for j in 0..NR {
                // The same place in the next group of rows (rows are contiguous, so that is
                // `NR·k` further), one line per row and chunk: the next tile's first pass then
                // finds it in cache instead of waiting on DRAM with four short streams the
                // hardware prefetcher ramps up too late for (+35% on 16-row decode steps when
                // the weight GEMM used this tile); past the end it is a harmless hint.
                S::prefetch(ws[j].wrapping_add(NR * k + c) as *const u8);
                wv[j] = T::load::<S>(ws[j].add(c));
            }
            for i in 0..R {
                let xv = S::load(xs[i].add(c));
                for j in 0..NR {
                    acc[i][j] = S::madd(xv, wv[j], acc[i][j]);
                }
            }
            c += S::L;
        }
        let mut out = [[0.0; NR]; R];
        for i in 0..R {
            out[i] = S::reduce4(acc[i]);
        }
        out
    }
}
