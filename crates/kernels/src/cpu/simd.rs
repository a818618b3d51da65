//! Small vectorizable building blocks. Written as fixed-width lane arrays so LLVM vectorizes
//! them; each public entry is compiled three times (baseline x86-64, AVX2+FMA, AVX-512) and picks
//! one at run time, so the binary stays portable while using the wide units where present. The
//! source fixes the order of every operation (no FMA contraction in Rust), so all three give the
//! same results. `dot` uses explicit fused multiply-adds (`mul_add`): one instruction with
//! AVX2/AVX-512, a correctly rounded libm call on the baseline, identical results either way.
//! (The LoRA kernels live in `lora.rs`, on the GEMM's register tiles.)

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

/// Hint that the line at `p` will be read soon, into L2 (never faults, any address).
#[inline(always)]
pub(super) fn prefetch_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults; SSE is baseline on x86_64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

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
dispatch!(silu_mul, silu_mul_body, (gate: &[f32], up: &[f32], out: &mut [f32]) -> ());
dispatch!(exp_shift_sum, exp_shift_sum_body, (s: &mut [f32], max: f32) -> f32);

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
}
