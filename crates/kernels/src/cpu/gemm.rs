//! `y = x · Wᵀ` with W `[n, k]` row-major: faer for f32 weights; bf16 weights are widened to f32
//! one block of rows at a time (into thread-local scratch) and fed to the same f32 kernel, so
//! memory traffic stays at 2 bytes per weight while the arithmetic is f32.

use faer::{Accum, MatMut, MatRef, Par};
use half::bf16;
use rayon::prelude::*;
use std::cell::RefCell;

/// f32 GEMM. `accumulate` adds into `y` instead of overwriting it.
pub fn matmul_f32(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32], accumulate: bool) {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(w.len(), n * k);
    debug_assert_eq!(y.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    let xm = MatRef::from_row_major_slice(x, m, k);
    let wt = MatRef::from_row_major_slice(w, n, k).transpose();
    let ym = MatMut::from_row_major_slice_mut(y, m, n);
    // Small problems lose more to thread handoff than they gain.
    let par = if (m * n * k) < 64 * 1024 { Par::Seq } else { Par::rayon(0) };
    faer::linalg::matmul::matmul(ym, if accumulate { Accum::Add } else { Accum::Replace }, xm, wt, 1.0f32, par);
}

/// An unpacked streaming kernel for small M (decode). Not used by `matmul_f32` yet: its k-order
/// differs from faer's, and with the massive activations of real LLMs that reassociation moves
/// logits by ~1e-4 relative between a sequence run alone (small M) and in a batch (faer), which
/// breaks batch invariance. It needs faer's accumulation order (or faer needs replacing for all M)
/// before it can be switched on; it is 1.5–2× faster than faer at M = 4..16 here.
#[allow(dead_code)]
pub const SMALL_M: usize = 16;

thread_local! {
    static SMALL_Y: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[allow(dead_code)]
fn small_m_parallel(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    let nb = (n / (threads * 4)).clamp(16, 256);
    let yptr = SyncPtr(y.as_mut_ptr());
    (0..n.div_ceil(nb)).into_par_iter().for_each(|b| {
        let j0 = b * nb;
        let j1 = (j0 + nb).min(n);
        let w_ = j1 - j0;
        SMALL_Y.with(|c| {
            let mut buf = c.borrow_mut();
            if buf.len() < m * w_ {
                buf.resize(m * w_, 0.0);
            }
            super::simd::small_m(x, m, k, w, j0..j1, &mut buf[..m * w_], w_, j0);
            let yp = yptr;
            for i in 0..m {
                // SAFETY: columns j0..j1 of every row belong to this task alone; i*n + j1 <= m*n.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(i * w_), yp.0.add(i * n + j0), w_) };
            }
        })
    });
}

/// Output rows of W per task for bf16: 64 rows × k floats of scratch stays in L2.
const BF16_BLOCK: usize = 64;

thread_local! {
    static WIDEN: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static YBLK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub fn matmul_bf16(x: &[f32], m: usize, k: usize, w: &[bf16], n: usize, y: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    let xm = MatRef::from_row_major_slice(x, m, k);
    // Each task computes y[:, n0..n1] into its own scratch, then scatters; y is shared through a
    // raw pointer because the column blocks are disjoint.
    let yptr = SyncPtr(y.as_mut_ptr());
    let nblocks = n.div_ceil(BF16_BLOCK);
    (0..nblocks).into_par_iter().for_each(|b| {
        let n0 = b * BF16_BLOCK;
        let nb = BF16_BLOCK.min(n - n0);
        WIDEN.with(|wc| {
            YBLK.with(|yc| {
                let mut wbuf = wc.borrow_mut();
                let mut ybuf = yc.borrow_mut();
                if wbuf.len() < nb * k {
                    wbuf.resize(nb * k, 0.0);
                }
                if ybuf.len() < m * nb {
                    ybuf.resize(m * nb, 0.0);
                }
                for (o, v) in wbuf[..nb * k].iter_mut().zip(&w[n0 * k..(n0 + nb) * k]) {
                    *o = v.to_f32();
                }
                let wt = MatRef::from_row_major_slice(&wbuf[..nb * k], nb, k).transpose();
                let ym = MatMut::from_row_major_slice_mut(&mut ybuf[..m * nb], m, nb);
                faer::linalg::matmul::matmul(ym, Accum::Replace, xm, wt, 1.0f32, Par::Seq);
                let yp = yptr;
                for r in 0..m {
                    // SAFETY: columns n0..n0+nb of every row belong to this task alone, and
                    // r*n + n0 + nb <= m*n = y.len().
                    unsafe {
                        std::ptr::copy_nonoverlapping(ybuf.as_ptr().add(r * nb), yp.0.add(r * n + n0), nb);
                    }
                }
            })
        });
    });
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn f32_and_bf16_match_naive() {
        let mut s = 12345u64;
        let mut rnd = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        for &(m, k, n) in &[(1, 7, 5), (3, 64, 130), (17, 33, 65), (64, 128, 200)] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let want = naive(&x, m, k, &w, n);
            let mut y = vec![f32::NAN; m * n];
            matmul_f32(&x, m, k, &w, n, &mut y, false);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let want = naive(&x, m, k, &wr, n);
            let mut y = vec![f32::NAN; m * n];
            matmul_bf16(&x, m, k, &wb, n, &mut y);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }
}

#[cfg(test)]
mod small_m_tests {
    use super::*;

    /// The decode kernel (M ≤ SMALL_M) and faer must agree at model shapes, so a sequence gets
    /// the same logits alone as in a batch.
    #[test]
    fn small_m_matches_faer_at_model_shapes() {
        let mut s = 99u64;
        let mut rnd = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        for &(m, k, n) in &[(1, 576, 960), (5, 576, 3072), (16, 1536, 576), (3, 576, 49152)] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let mut a = vec![f32::NAN; m * n];
            let mut b = vec![f32::NAN; m * n];
            small_m_parallel(&x, m, k, &w, n, &mut a);
            let xm = MatRef::from_row_major_slice(&x, m, k);
            let wt = MatRef::from_row_major_slice(&w, n, k).transpose();
            faer::linalg::matmul::matmul(MatMut::from_row_major_slice_mut(&mut b, m, n), Accum::Replace, xm, wt, 1.0f32, Par::Seq);
            let worst = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "m={m} k={k} n={n}: max diff {worst}");
        }
    }
}
