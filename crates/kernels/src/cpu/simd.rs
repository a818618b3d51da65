//! Small vectorizable building blocks. Written as fixed-width lane arrays so LLVM vectorizes
//! them; each public entry is compiled twice (baseline x86-64 and AVX2+FMA) and picks one at
//! run time, so the binary stays portable while using the wide units where present.

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
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ta.iter().zip(tb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `y[i*ldy + j] = x_i · w_j` for `i < m`, `j < n`: the small-batch (decode) GEMM. Each weight row
/// is streamed from memory once and reused for all `m` input rows from cache, with no packing
/// (packing costs more than the product when `m` is small).
#[inline(always)]
fn small_m_body(x: &[f32], m: usize, k: usize, w: &[f32], rows: std::ops::Range<usize>, y: &mut [f32], ldy: usize, col0: usize) {
    for j in rows {
        let wr = &w[j * k..(j + 1) * k];
        for i in 0..m {
            y[i * ldy + j - col0] = dot_body(&x[i * k..(i + 1) * k], wr);
        }
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        super::dot_body(a, b)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn small_m(x: &[f32], m: usize, k: usize, w: &[f32], rows: std::ops::Range<usize>, y: &mut [f32], ldy: usize, col0: usize) {
        super::small_m_body(x, m, k, w, rows, y, ldy, col0)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::silu_mul_body(gate, up, out)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shift_sum(s: &mut [f32], max: f32) -> f32 {
        super::exp_shift_sum_body(s, max)
    }
}

fn has_avx2() -> bool {
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            #[cfg(target_arch = "x86_64")]
            let yes = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            #[cfg(not(target_arch = "x86_64"))]
            let yes = false;
            STATE.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
    }
}

macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { avx2::$name($($arg),*) };
            }
            $body($($arg),*)
        }
    };
}

dispatch!(dot, dot_body, (a: &[f32], b: &[f32]) -> f32);
dispatch!(silu_mul, silu_mul_body, (gate: &[f32], up: &[f32], out: &mut [f32]) -> ());
dispatch!(exp_shift_sum, exp_shift_sum_body, (s: &mut [f32], max: f32) -> f32);
#[allow(clippy::too_many_arguments)]
pub fn small_m(x: &[f32], m: usize, k: usize, w: &[f32], rows: std::ops::Range<usize>, y: &mut [f32], ldy: usize, col0: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
        return unsafe { avx2::small_m(x, m, k, w, rows, y, ldy, col0) };
    }
    small_m_body(x, m, k, w, rows, y, ldy, col0)
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
    fn dot_and_small_m_match_naive() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
        let (m, k, n) = (3, 37, 5);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.3).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.7).cos()).collect();
        let mut y = vec![f32::NAN; m * n];
        small_m(&x, m, k, &w, 0..n, &mut y, n, 0);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
                assert!((y[i * n + j] as f64 - want).abs() < 1e-4);
            }
        }
    }
}
