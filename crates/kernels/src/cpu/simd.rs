//! Small vectorizable building blocks. Written as fixed-width lane arrays so LLVM vectorizes
//! them; each public entry is compiled three times (baseline x86-64, AVX2+FMA, AVX-512) and picks
//! one at run time, so the binary stays portable while using the wide units where present. The
//! source fixes the order of every operation (no FMA contraction in Rust), so all three give the
//! same results. The LoRA kernels (`dot`, `gemm_nt`, `lora_expand`) use explicit fused
//! multiply-adds (`mul_add`): one instruction with AVX2/AVX-512, a correctly rounded libm call
//! on the baseline, identical results either way.

use std::sync::atomic::{AtomicU8, Ordering};

const LANES: usize = 16;

/// e^x, accurate to ~2 ulp over the f32 range (Cody-Waite reduction + degree-6 polynomial).
/// libm's expf is a scalar call per element; SiLU and softmax call this millions of times a step.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_888_9)))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Hint that the cache line at `p` is read soon; never faults, whatever the address (so it is
/// safe to aim past the end of a buffer). A no-op off x86-64.
#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is SSE (baseline on x86-64) and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Pairwise (tree) sum of the lanes: shorter dependency chain than a sequential sum, and its
/// order is fixed by the source like everything else here. The accumulator passes through
/// `black_box` first: without that barrier LLVM let the tree's shape pick the vector width of
/// the main loop and produced 2-lane code (measured 3× slower).
#[inline(always)]
fn reduce_lanes(acc: [f32; LANES]) -> f32 {
    let acc = std::hint::black_box(acc);
    let h: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let q: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        // Fixed-size views: no bounds checks in the loop, so it vectorizes.
        let x: &[f32; LANES] = x.try_into().unwrap();
        let y: &[f32; LANES] = y.try_into().unwrap();
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    reduce_lanes(acc) + tail_dot(ta, tb)
}

/// The remainder after the full chunks, sequentially.
#[inline(always)]
fn tail_dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (x, y)| x.mul_add(*y, s))
}

/// Four dot products against one `w` (each `w` chunk loaded once, four independent
/// accumulation chains); every result is bit-identical to `dot_body(x[i], w)`.
#[inline(always)]
fn dot4_body(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let [[d0, _], [d1, _], [d2, _], [d3, _]] = dot4x2_body(x, [w, w], [w.as_ptr(); 2]);
    [d0, d1, d2, d3]
}

/// The eight dot products of four `x` rows with two `w` rows: each chunk of `x` and `w` loaded
/// once for four or two products, eight independent accumulation chains. Every result is
/// bit-identical to `dot_body(x[i], w[j])`. `next` are the rows the caller reads after these:
/// they are prefetched a line per chunk, so the adapter weights (cold: a whole forward pass ran
/// since they were last read) stream in while this pair computes.
#[inline(always)]
fn dot4x2_body(x: [&[f32]; 4], w: [&[f32]; 2], next: [*const f32; 2]) -> [[f32; 2]; 4] {
    let n = w[0].len();
    let [x0, x1, x2, x3] = x.map(|r| &r[..n]);
    let [w0, w1] = w.map(|r| &r[..n]);
    // Named accumulators and zipped exact chunks: the shape LLVM turns into vector registers
    // (an indexed `[[f32; 16]; 4]` stayed scalar on the stack).
    let z = [0.0f32; LANES];
    let (mut a00, mut a10, mut a20, mut a30, mut a01, mut a11, mut a21, mut a31) = (z, z, z, z, z, z, z, z);
    fn c(s: &[f32]) -> std::slice::ChunksExact<'_, f32> {
        s.chunks_exact(LANES)
    }
    let it = c(w0).zip(c(w1)).zip(c(x0)).zip(c(x1)).zip(c(x2)).zip(c(x3));
    for (ci, (((((p, q), v0), v1), v2), v3)) in it.enumerate() {
        prefetch(next[0].wrapping_add(ci * LANES));
        prefetch(next[1].wrapping_add(ci * LANES));
        let (p, q): (&[f32; LANES], &[f32; LANES]) = (p.try_into().unwrap(), q.try_into().unwrap());
        let (v0, v1): (&[f32; LANES], &[f32; LANES]) = (v0.try_into().unwrap(), v1.try_into().unwrap());
        let (v2, v3): (&[f32; LANES], &[f32; LANES]) = (v2.try_into().unwrap(), v3.try_into().unwrap());
        for l in 0..LANES {
            a00[l] = v0[l].mul_add(p[l], a00[l]);
            a10[l] = v1[l].mul_add(p[l], a10[l]);
            a20[l] = v2[l].mul_add(p[l], a20[l]);
            a30[l] = v3[l].mul_add(p[l], a30[l]);
            a01[l] = v0[l].mul_add(q[l], a01[l]);
            a11[l] = v1[l].mul_add(q[l], a11[l]);
            a21[l] = v2[l].mul_add(q[l], a21[l]);
            a31[l] = v3[l].mul_add(q[l], a31[l]);
        }
    }
    let t0 = n / LANES * LANES;
    let d = |acc, xr: &[f32], wr: &[f32]| reduce_lanes(acc) + tail_dot(&xr[t0..], &wr[t0..]);
    [[d(a00, x0, w0), d(a01, x0, w1)], [d(a10, x1, w0), d(a11, x1, w1)], [d(a20, x2, w0), d(a21, x2, w1)], [d(a30, x3, w0), d(a31, x3, w1)]]
}

/// `y[i, c] (+)= alpha · x[i, ..k] · w[c, ..k]` for `i < rows`, `c < n` (row strides `ldy`,
/// `ldx`, `ldw`). Each element is `alpha · dot(x_i, w_c)`, whatever `rows` is, so a row's result
/// does not depend on which rows share the call.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gemm_nt_body(y: &mut [f32], ldy: usize, x: &[f32], ldx: usize, w: &[f32], ldw: usize, rows: usize, n: usize, k: usize, alpha: f32, add: bool) {
    let put = |o: &mut f32, d: f32| *o = if add { *o + alpha * d } else { alpha * d };
    let mut r = 0;
    while r + 4 <= rows {
        let xs: [&[f32]; 4] = std::array::from_fn(|i| &x[(r + i) * ldx..(r + i) * ldx + k]);
        let mut c = 0;
        while c + 2 <= n {
            let next = [w.as_ptr().wrapping_add((c + 2) * ldw), w.as_ptr().wrapping_add((c + 3) * ldw)];
            let d = dot4x2_body(xs, [&w[c * ldw..c * ldw + k], &w[(c + 1) * ldw..(c + 1) * ldw + k]], next);
            for (i, d) in d.into_iter().enumerate() {
                put(&mut y[(r + i) * ldy + c], d[0]);
                put(&mut y[(r + i) * ldy + c + 1], d[1]);
            }
            c += 2;
        }
        if c < n {
            let d = dot4_body(xs, &w[c * ldw..c * ldw + k]);
            for (i, d) in d.into_iter().enumerate() {
                put(&mut y[(r + i) * ldy + c], d);
            }
        }
        r += 4;
    }
    while r < rows {
        let xr = &x[r * ldx..r * ldx + k];
        for c in 0..n {
            put(&mut y[r * ldy + c], dot_body(xr, &w[c * ldw..c * ldw + k]));
        }
        r += 1;
    }
}

/// Columns per block of the LoRA expand: four AVX-512 registers of accumulators, and a block
/// of Bᵀ (`r × 64` floats, 4 KiB at rank 16) stays in L1 while every row of the call uses it.
const EXPAND_COLS: usize = 64;

/// `y_i[c] += Σ_{k<r} (alpha · coef[i·ldc + k]) · bt[k·ldb + c]` for `i < rows`, `c < n`, with
/// `y_i = y + row(i)·ldy` and `row(i) = idx[i]` (or `i`). Every element gets the same operations
/// in the same order whatever `rows` and `idx` are.
///
/// # Safety
/// Every `y_i[..n]` must be valid for writes and not accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lora_expand_body(y: *mut f32, ldy: usize, idx: Option<&[u32]>, rows: usize, coef: &[f32], ldc: usize, bt: &[f32], ldb: usize, r: usize, n: usize, alpha: f32) {
    let mut c0 = 0;
    while c0 < n {
        let w = (n - c0).min(EXPAND_COLS);
        for i in 0..rows {
            let row = idx.map_or(i, |p| p[i] as usize);
            // SAFETY: caller's contract.
            let yr = unsafe { std::slice::from_raw_parts_mut(y.add(row * ldy + c0), w) };
            let ci = &coef[i * ldc..i * ldc + r];
            if i == 0 {
                // The next column block of Bᵀ, while this one is used by every row.
                for k in 0..r {
                    let nb = bt.as_ptr().wrapping_add(k * ldb + c0 + EXPAND_COLS);
                    for l in (0..EXPAND_COLS).step_by(LANES) {
                        prefetch(nb.wrapping_add(l));
                    }
                }
            }
            if w == EXPAND_COLS {
                let mut acc: [f32; EXPAND_COLS] = (&*yr).try_into().unwrap();
                for (k, &c) in ci.iter().enumerate() {
                    let s = alpha * c;
                    let b: &[f32; EXPAND_COLS] = bt[k * ldb + c0..k * ldb + c0 + EXPAND_COLS].try_into().unwrap();
                    for l in 0..EXPAND_COLS {
                        acc[l] = s.mul_add(b[l], acc[l]);
                    }
                }
                yr.copy_from_slice(&acc);
            } else {
                for (l, yv) in yr.iter_mut().enumerate() {
                    let mut a = *yv;
                    for (k, &c) in ci.iter().enumerate() {
                        a = (alpha * c).mul_add(bt[k * ldb + c0 + l], a);
                    }
                    *yv = a;
                }
            }
        }
        c0 += w;
    }
}

#[inline(always)]
fn silu_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp_approx(-g)) * u;
    }
}

/// `s[i] = exp(s[i] - max)`, returns the sum.
#[inline(always)]
fn exp_shift_sum_body(s: &mut [f32], max: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp_approx(c[l] - max);
            acc[l] += c[l];
        }
    }
    let mut tail = 0.0;
    for v in chunks.into_remainder() {
        *v = exp_approx(*v - max);
        tail += *v;
    }
    acc.iter().sum::<f32>() + tail
}

/// The public entries compiled for one instruction set (same source, so the same results).
macro_rules! isa_module {
    ($m:ident, $feat:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $m {
            #[target_feature(enable = $feat)]
            pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
                super::dot_body(a, b)
            }
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub unsafe fn gemm_nt(y: &mut [f32], ldy: usize, x: &[f32], ldx: usize, w: &[f32], ldw: usize, rows: usize, n: usize, k: usize, alpha: f32, add: bool) {
                super::gemm_nt_body(y, ldy, x, ldx, w, ldw, rows, n, k, alpha, add)
            }
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub unsafe fn lora_expand(y: *mut f32, ldy: usize, idx: Option<&[u32]>, rows: usize, coef: &[f32], ldc: usize, bt: &[f32], ldb: usize, r: usize, n: usize, alpha: f32) {
                unsafe { super::lora_expand_body(y, ldy, idx, rows, coef, ldc, bt, ldb, r, n, alpha) }
            }
            #[target_feature(enable = $feat)]
            pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
                super::silu_mul_body(gate, up, out)
            }
            #[target_feature(enable = $feat)]
            pub unsafe fn exp_shift_sum(s: &mut [f32], max: f32) -> f32 {
                super::exp_shift_sum_body(s, max)
            }
        }
    };
}
isa_module!(avx2, "avx2,fma");
isa_module!(avx512, "avx512f,avx2,fma");

/// The widest instruction set this CPU offers that the kernels use, detected once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F + AVX2 + FMA.
    Avx512,
    /// AVX2 + FMA.
    Avx2,
    /// Baseline code for the target.
    Portable,
}

pub fn isa() -> Isa {
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => Isa::Portable,
        2 => Isa::Avx2,
        3 => Isa::Avx512,
        _ => {
            #[cfg(target_arch = "x86_64")]
            let found = match (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), is_x86_feature_detected!("avx512f")) {
                (true, true) => Isa::Avx512,
                (true, false) => Isa::Avx2,
                _ => Isa::Portable,
            };
            #[cfg(not(target_arch = "x86_64"))]
            let found = Isa::Portable;
            STATE.store(
                match found {
                    Isa::Portable => 1,
                    Isa::Avx2 => 2,
                    Isa::Avx512 => 3,
                },
                Ordering::Relaxed,
            );
            found
        }
    }
}

macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[allow(clippy::too_many_arguments)]
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            match isa() {
                // SAFETY: the CPU supports the module's features (checked at run time).
                Isa::Avx512 => return unsafe { avx512::$name($($arg),*) },
                Isa::Avx2 => return unsafe { avx2::$name($($arg),*) },
                Isa::Portable => {}
            }
            $body($($arg),*)
        }
    };
}

dispatch!(dot, dot_body, (a: &[f32], b: &[f32]) -> f32);
dispatch!(gemm_nt, gemm_nt_body, (y: &mut [f32], ldy: usize, x: &[f32], ldx: usize, w: &[f32], ldw: usize, rows: usize, n: usize, k: usize, alpha: f32, add: bool) -> ());
dispatch!(silu_mul, silu_mul_body, (gate: &[f32], up: &[f32], out: &mut [f32]) -> ());
dispatch!(exp_shift_sum, exp_shift_sum_body, (s: &mut [f32], max: f32) -> f32);

/// The LoRA expand (see `lora_expand_body`), on this CPU's widest instruction set.
///
/// # Safety
/// Rows `y + row(i)·ldy .. + n` must be valid for writes and not accessed by anyone else during
/// the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn lora_expand(y: *mut f32, ldy: usize, idx: Option<&[u32]>, rows: usize, coef: &[f32], ldc: usize, bt: &[f32], ldb: usize, r: usize, n: usize, alpha: f32) {
    #[cfg(target_arch = "x86_64")]
    match isa() {
        // SAFETY: the CPU supports the module's features (checked at run time); rows: caller.
        Isa::Avx512 => return unsafe { avx512::lora_expand(y, ldy, idx, rows, coef, ldc, bt, ldb, r, n, alpha) },
        Isa::Avx2 => return unsafe { avx2::lora_expand(y, ldy, idx, rows, coef, ldc, bt, ldb, r, n, alpha) },
        Isa::Portable => {}
    }
    unsafe { lora_expand_body(y, ldy, idx, rows, coef, ldc, bt, ldb, r, n, alpha) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "max relative error {worst}");
        assert_eq!(exp_approx(-1000.0), exp_approx(-87.3));
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
    }

    fn rnd(seed: &mut u32) -> f32 {
        *seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
        (*seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    }

    /// The dispatched kernels give bit-identical results to the portable source (so a machine's
    /// instruction set never changes an output), and a row's result is the same alone or among
    /// other rows.
    #[test]
    fn dispatched_equals_portable_and_rows_are_independent() {
        let mut seed = 7u32;
        let (rows, n, k) = (7, 37, 581);
        let x: Vec<f32> = (0..rows * k).map(|_| rnd(&mut seed)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed)).collect();
        let mut a = vec![0.0; rows * n];
        let mut b = vec![0.0; rows * n];
        gemm_nt(&mut a, n, &x, k, &w, k, rows, n, k, 0.7, false);
        gemm_nt_body(&mut b, n, &x, k, &w, k, rows, n, k, 0.7, false);
        assert_eq!(a, b);
        for r in 0..rows {
            let mut one = vec![0.0; n];
            gemm_nt(&mut one, n, &x[r * k..], k, &w, k, 1, n, k, 0.7, false);
            assert_eq!(one, a[r * n..(r + 1) * n]);
        }
        let (r, n) = (13, 203);
        let coef: Vec<f32> = (0..rows * r).map(|_| rnd(&mut seed)).collect();
        let bt: Vec<f32> = (0..r * n).map(|_| rnd(&mut seed)).collect();
        let y0: Vec<f32> = (0..rows * n).map(|_| rnd(&mut seed)).collect();
        let (mut p, mut q) = (y0.clone(), y0.clone());
        unsafe {
            lora_expand(p.as_mut_ptr(), n, None, rows, &coef, r, &bt, n, r, n, 1.5);
            lora_expand_body(q.as_mut_ptr(), n, None, rows, &coef, r, &bt, n, r, n, 1.5);
        }
        assert_eq!(p, q);
        let idx = [3u32];
        let mut one = y0.clone();
        unsafe { lora_expand(one.as_mut_ptr(), n, Some(&idx), 1, &coef[3 * r..], r, &bt, n, r, n, 1.5) };
        assert_eq!(one[3 * n..4 * n], p[3 * n..4 * n]);
    }

    /// `gemm_nt` and `lora_expand` on strided sub-matrices against f64 loops, with guard bands
    /// that must stay untouched (the LoRA kernels write into the middle of wider rows).
    #[test]
    fn lora_kernels_match_naive_and_stay_in_bounds() {
        let mut seed = 1u32;
        let guard = 1234.5f32;
        for &(rows, n, k) in &[(1, 1, 1), (1, 20, 3), (5, 12, 7), (17, 53, 16), (33, 36, 2), (64, 20, 48), (3, 1, 20), (6, 130, 16), (9, 64, 64)] {
            let (ldy, ldx, ldw) = (n + 3, k + 2, k + 5);
            let x: Vec<f32> = (0..rows * ldx).map(|_| rnd(&mut seed)).collect();
            let w: Vec<f32> = (0..n * ldw).map(|_| rnd(&mut seed)).collect();
            let mut y0 = vec![guard; rows * ldy + 8];
            for r in 0..rows {
                for c in 0..n {
                    y0[1 + r * ldy + c] = 0.25;
                }
            }
            for add in [false, true] {
                let mut want = y0.clone();
                for r in 0..rows {
                    for c in 0..n {
                        let d: f64 = (0..k).map(|i| x[r * ldx + i] as f64 * w[c * ldw + i] as f64).sum();
                        let v = &mut want[1 + r * ldy + c];
                        *v = if add { *v + 0.5 * d as f32 } else { 0.5 * d as f32 };
                    }
                }
                let mut y = y0.clone();
                gemm_nt(&mut y[1..], ldy, &x, ldx, &w, ldw, rows, n, k, 0.5, add);
                for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() < 1e-4, "gemm_nt ({rows},{n},{k},{add}) at {i}: {a} vs {b}");
                }
            }
            // Expand: coefficients x[rows, k] (stride ldx), Bᵀ = w viewed as [k, n] with stride
            // ldb; rows written in reverse order through idx.
            let ldb = n + 5;
            let bt: Vec<f32> = (0..k * ldb).map(|_| rnd(&mut seed)).collect();
            let idx: Vec<u32> = (0..rows as u32).rev().collect();
            let mut want = y0.clone();
            for (i, &row) in idx.iter().enumerate() {
                for c in 0..n {
                    let d: f64 = (0..k).map(|j| x[i * ldx + j] as f64 * bt[j * ldb + c] as f64).sum();
                    want[1 + row as usize * ldy + c] += 0.5 * d as f32;
                }
            }
            let mut y = y0.clone();
            unsafe { lora_expand(y[1..].as_mut_ptr(), ldy, Some(&idx), rows, &x, ldx, &bt, ldb, k, n, 0.5) };
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-4, "lora_expand ({rows},{n},{k}) at {i}: {a} vs {b}");
            }
        }
    }
}
