//! The two LoRA tiles on CPU (what `lora.rs` runs over a batch), built from the GEMM's register tiles.
//!
//! - **Shrink** `t[i, c] = x_{row(i)} · a_c`: a small GEMM (`rows × n` outputs, `n` = slices × rank)
//!   whose x rows are read in place through an optional row list (a chunk of the permutation),
//!   so grouping rows by adapter copies nothing. Every element is a [`tile`] element, computed
//!   exactly as the base GEMM computes one: its value does not depend on which rows or A rows
//!   share its tile.
//! - **Expand** `y_{row(i)}[c] += Σ_k (alpha · t[i, k]) · bᵀ[k, c]`: register tiles of up to 6
//!   rows × one block of `C` vectors of columns; a block of Bᵀ (`r × C·L` floats, 4 KiB at rank 16
//!   on AVX-512) stays in L1 while every row tile of the call passes over it, and each Bᵀ vector
//!   loaded serves the whole row tile. Every element starts from `y` and adds the `r` products in
//!   order `k = 0, 1, …` with one multiply-add each, whatever tile or column block it falls in.
//!
//! So a row's LoRA delta never depends on its batch-mates, on how a backend groups rows, or on
//! how threads split rows or columns: the property `tests/backends.rs` in the LoRA crate checks
//! bit for bit. The old per-row kernels (a 4 × 2 dot-product tile and one row per expand pass)
//! ran at about a third of the base GEMM's FLOP rate from 64 rows up.

use super::dot::{tile, Portable, Simd, NR};
use super::simd::{isa, Isa};

/// The shrink's operands; see [`lora_shrink`].
struct Shrink<'a> {
    out: *mut f32,
    ldo: usize,
    x: *const f32,
    ldx: usize,
    idx: Option<&'a [u32]>,
    rows: usize,
    a: *const f32,
    n: usize,
    k: usize,
}

/// The expand's operands; see [`lora_expand`].
struct Expand<'a> {
    y: *mut f32,
    ldy: usize,
    idx: Option<&'a [u32]>,
    rows: usize,
    coef: *const f32,
    ldc: usize,
    bt: *const f32,
    ldb: usize,
    r: usize,
    n: usize,
    alpha: f32,
}

#[inline(always)]
fn row_of(idx: Option<&[u32]>, i: usize) -> usize {
    idx.map_or(i, |p| p[i] as usize)
}

/// Dispatches `$f::<S, R>` for a tile of `$rows` (1..=6) rows.
macro_rules! by_rows {
    ($rows:expr, $f:ident::<$s:ty $(, $c:ident)?>($($arg:expr),*)) => {
        match $rows {
            1 => $f::<$s $(, $c)?, 1>($($arg),*),
            2 => $f::<$s $(, $c)?, 2>($($arg),*),
            3 => $f::<$s $(, $c)?, 3>($($arg),*),
            4 => $f::<$s $(, $c)?, 4>($($arg),*),
            5 => $f::<$s $(, $c)?, 5>($($arg),*),
            6 => $f::<$s $(, $c)?, 6>($($arg),*),
            _ => unreachable!("row tiles hold at most 6 rows"),
        }
    };
}

/// # Safety
/// See [`lora_shrink`]; the CPU must support `S`.
#[inline(always)]
unsafe fn shrink_body<S: Simd, const SR: usize>(s: &Shrink<'_>) {
    let mut i0 = 0;
    while i0 < s.rows {
        let rows = SR.min(s.rows - i0);
        unsafe { by_rows!(rows, shrink_tile::<S>(s, i0)) };
        i0 += rows;
    }
}

/// Rows `i0..i0 + R` against every row of A; a last partial group of A rows repeats its last
/// row and drops the extra results (as the GEMM does).
///
/// # Safety
/// See [`lora_shrink`]; the CPU must support `S`.
#[inline(always)]
unsafe fn shrink_tile<S: Simd, const R: usize>(s: &Shrink<'_>, i0: usize) {
    let mut xs = [s.x; R];
    for (i, p) in xs.iter_mut().enumerate() {
        *p = unsafe { s.x.add(row_of(s.idx, i0 + i) * s.ldx) };
    }
    let mut c = 0;
    while c < s.n {
        let mut ws = [s.a; NR];
        for (j, p) in ws.iter_mut().enumerate() {
            *p = unsafe { s.a.add((c + j).min(s.n - 1) * s.k) };
        }
        let t = unsafe { tile::<S, R, f32>(xs, ws, s.k) };
        let cn = NR.min(s.n - c);
        for (i, row) in t.iter().enumerate() {
            for (j, &v) in row.iter().enumerate().take(cn) {
                unsafe { *s.out.add((i0 + i) * s.ldo + c + j) = v };
            }
        }
        c += NR;
    }
}

/// How far ahead in each Bᵀ row the expand prefetches: 256 bytes, one AVX-512 column block,
/// four AVX2 blocks (one AVX2 block ahead is ~50 ns of work, short of a DRAM miss).
const EXPAND_AHEAD: usize = 64;

/// # Safety
/// See [`lora_expand`]; the CPU must support `S`.
#[inline(always)]
unsafe fn expand_body<S: Simd, const C: usize, const ER: usize>(e: &Expand<'_>) {
    let cw = C * S::L;
    let mut c0 = 0;
    while c0 + cw <= e.n {
        // The column block `EXPAND_AHEAD` floats on, a line per 16 floats, while this one serves
        // every row: each Bᵀ row is its own short stream, too many for the hardware prefetcher.
        for k in 0..e.r {
            let nb = e.bt.wrapping_add(k * e.ldb + c0 + EXPAND_AHEAD);
            for l in (0..cw).step_by(16) {
                unsafe { S::prefetch(nb.wrapping_add(l) as *const u8) };
            }
        }
        expand_rows::<S, C, ER>(e, c0);
        c0 += cw;
    }
    while c0 + S::L <= e.n {
        expand_rows::<S, 1, ER>(e, c0);
        c0 += S::L;
    }
    if c0 < e.n {
        unsafe { expand_tail::<S>(e, c0) };
    }
}

/// Every row of the call over the `C` vectors of columns from `c0`, `ER` rows at a time.
#[inline(always)]
fn expand_rows<S: Simd, const C: usize, const ER: usize>(e: &Expand<'_>, c0: usize) {
    let mut i0 = 0;
    while i0 < e.rows {
        let rows = ER.min(e.rows - i0);
        // SAFETY: columns c0..c0 + C·L ≤ n of rows the caller of `lora_expand` vouches for.
        unsafe { by_rows!(rows, expand_tile::<S, C>(e, i0, c0)) };
        i0 += rows;
    }
}

/// # Safety
/// Columns `c0..c0 + C·L` lie within `n`; see [`lora_expand`]; the CPU must support `S`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // a register tile reads best as indices
unsafe fn expand_tile<S: Simd, const C: usize, const R: usize>(e: &Expand<'_>, i0: usize, c0: usize) {
    unsafe {
        let mut yp = [e.y; R];
        for (i, p) in yp.iter_mut().enumerate() {
            *p = e.y.add(row_of(e.idx, i0 + i) * e.ldy + c0);
        }
        let mut acc = [[S::zero(); C]; R];
        for i in 0..R {
            for v in 0..C {
                acc[i][v] = S::load(yp[i].add(v * S::L));
            }
        }
        for k in 0..e.r {
            let mut b = [S::zero(); C];
            for (v, bv) in b.iter_mut().enumerate() {
                *bv = S::load(e.bt.add(k * e.ldb + c0 + v * S::L));
            }
            for i in 0..R {
                let s = S::splat(e.alpha * *e.coef.add((i0 + i) * e.ldc + k));
                for v in 0..C {
                    acc[i][v] = S::madd(s, b[v], acc[i][v]);
                }
            }
        }
        for i in 0..R {
            for v in 0..C {
                S::store(yp[i].add(v * S::L), acc[i][v]);
            }
        }
    }
}

/// The last `n - c0 < L` columns, through zero-padded copies so they get the very same vector
/// multiply-adds as every other column (rare: only widths that are not a multiple of `L`).
///
/// # Safety
/// See [`lora_expand`]; the CPU must support `S`.
#[inline(always)]
unsafe fn expand_tail<S: Simd>(e: &Expand<'_>, c0: usize) {
    let w = e.n - c0;
    let mut yt = [0.0f32; 16];
    let mut bt = [0.0f32; 16];
    for i in 0..e.rows {
        unsafe {
            let yr = e.y.add(row_of(e.idx, i) * e.ldy + c0);
            std::ptr::copy_nonoverlapping(yr, yt.as_mut_ptr(), w);
            let mut acc = S::load(yt.as_ptr());
            for k in 0..e.r {
                std::ptr::copy_nonoverlapping(e.bt.add(k * e.ldb + c0), bt.as_mut_ptr(), w);
                let s = S::splat(e.alpha * *e.coef.add(i * e.ldc + k));
                acc = S::madd(s, S::load(bt.as_ptr()), acc);
            }
            S::store(yt.as_mut_ptr(), acc);
            std::ptr::copy_nonoverlapping(yt.as_ptr(), yr, w);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_entry {
    use super::super::dot::x86::{Avx2, Avx512};
    use super::{Expand, Shrink};
    /// # Safety
    /// The CPU has AVX-512F; see `lora_shrink`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn shrink_avx512(s: &Shrink<'_>) {
        // 6 rows × 4 A rows: 24 accumulators + 4 of A + x.
        unsafe { super::shrink_body::<Avx512, 6>(s) }
    }
    /// # Safety
    /// The CPU has AVX2 and FMA; see `lora_shrink`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn shrink_avx2(s: &Shrink<'_>) {
        // 3 rows × 4 A rows: 12 accumulators + 4 of A + x, within the 16 registers.
        unsafe { super::shrink_body::<Avx2, 3>(s) }
    }
    /// # Safety
    /// The CPU has AVX-512F; see `lora_expand`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn expand_avx512(e: &Expand<'_>) {
        // 4 vectors = 64 columns; 6 × 4 accumulators + 4 of Bᵀ + the coefficient: 29 registers.
        unsafe { super::expand_body::<Avx512, 4, 6>(e) }
    }
    /// # Safety
    /// The CPU has AVX2 and FMA; see `lora_expand`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn expand_avx2(e: &Expand<'_>) {
        // 2 vectors = 16 columns; 6 × 2 accumulators + 2 + 1: 15 of the 16 registers, and each
        // Bᵀ vector loaded serves six rows.
        unsafe { super::expand_body::<Avx2, 2, 6>(e) }
    }
}

/// `out[i·ldo + c] = x_{row(i)} · a[c·k..(c+1)·k]` for `i < rows`, `c < n`, with x row `j` at
/// `x[j·ldx..]` and `row(i) = idx[i]` (or `i`). Each element is computed exactly as the base GEMM
/// computes one, whatever rows share the call.
#[allow(clippy::too_many_arguments)]
pub fn lora_shrink(out: &mut [f32], ldo: usize, x: &[f32], ldx: usize, idx: Option<&[u32]>, rows: usize, a: &[f32], n: usize, k: usize) {
    if rows == 0 || n == 0 {
        return;
    }
    let last_row = idx.map_or(rows - 1, |p| p[..rows].iter().copied().max().unwrap_or(0) as usize);
    assert!(k <= ldx && x.len() >= last_row * ldx + k, "lora_shrink: x too small");
    assert!(a.len() >= n * k && n <= ldo && out.len() >= (rows - 1) * ldo + n, "lora_shrink: a or out too small");
    let s = Shrink { out: out.as_mut_ptr(), ldo, x: x.as_ptr(), ldx, idx, rows, a: a.as_ptr(), n, k };
    // SAFETY: the asserts bound every read and write; the ISA was detected on this CPU.
    unsafe {
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86_entry::shrink_avx512(&s),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86_entry::shrink_avx2(&s),
            _ => shrink_body::<Portable, 2>(&s),
        }
    }
}

/// `y_i[c] += Σ_{k<r} (alpha · coef[i·ldc + k]) · bt[k·ldb + c]` for `i < rows`, `c < n`, with
/// `y_i = y + row(i)·ldy` and `row(i) = idx[i]` (or `i`). Every element gets the same operations
/// in the same order whatever `rows` and `idx` are.
///
/// # Safety
/// Every `y_i[..n]` must be valid for reads and writes and not accessed by anyone else during the
/// call; `coef` holds `rows` rows of `r` (stride `ldc`), `bt` holds `r` rows of `n` (stride `ldb`).
#[allow(clippy::too_many_arguments)]
pub unsafe fn lora_expand(y: *mut f32, ldy: usize, idx: Option<&[u32]>, rows: usize, coef: &[f32], ldc: usize, bt: &[f32], ldb: usize, r: usize, n: usize, alpha: f32) {
    if rows == 0 || n == 0 {
        return;
    }
    assert!(r == 0 || (coef.len() >= (rows - 1) * ldc + r && bt.len() >= (r - 1) * ldb + n), "lora_expand: coef or bt too small");
    let e = Expand { y, ldy, idx, rows, coef: coef.as_ptr(), ldc, bt: bt.as_ptr(), ldb, r, n, alpha };
    // SAFETY: the caller vouches for y; the assert bounds coef and bt; the ISA was detected here.
    unsafe {
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86_entry::expand_avx512(&e),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86_entry::expand_avx2(&e),
            _ => expand_body::<Portable, 2, 2>(&e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Against f64 sums, on odd shapes (k and n not multiples of any lane count, every tile
    /// height, listed rows), and each row equal bit for bit to that row computed alone.
    #[test]
    fn shrink_and_expand_match_f64_and_are_row_independent() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(k, n, r, rows) in &[(37usize, 5usize, 3usize, 1usize), (64, 48, 16, 13), (100, 131, 7, 7), (576, 8, 4, 32)] {
            let total = rows + 3;
            let x = random(&mut rng, total * k);
            let a = random(&mut rng, n * k);
            // Rows listed out of order, skipping some.
            let idx: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 2) % total as u32).collect();
            let mut uniq = idx.clone();
            uniq.sort();
            uniq.dedup();
            if uniq.len() < rows {
                continue;
            }
            let mut t = vec![f32::NAN; rows * n];
            lora_shrink(&mut t, n, &x, k, Some(&idx), rows, &a, n, k);
            for i in 0..rows {
                let xr = &x[idx[i] as usize * k..][..k];
                for c in 0..n {
                    let want: f64 = xr.iter().zip(&a[c * k..(c + 1) * k]).map(|(&p, &q)| p as f64 * q as f64).sum();
                    assert!((t[i * n + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "shrink k={k} n={n} ({i},{c})");
                }
                let mut alone = vec![0.0; n];
                lora_shrink(&mut alone, n, xr, k, None, 1, &a, n, k);
                assert_eq!(alone[..], t[i * n..(i + 1) * n], "shrink row {i} alone");
            }
            // Expand the first r shrink columns through B^T (r × n) into rows of y, scaled.
            let bt = random(&mut rng, r * n);
            let y0 = random(&mut rng, total * n);
            let mut y = y0.clone();
            unsafe { lora_expand(y.as_mut_ptr(), n, Some(&idx), rows, &t, n, &bt, n, r, n, 0.5) };
            for i in 0..rows {
                let yr = idx[i] as usize;
                for c in 0..n {
                    let d: f64 = (0..r).map(|q| 0.5 * t[i * n + q] as f64 * bt[q * n + c] as f64).sum();
                    let want = y0[yr * n + c] as f64 + d;
                    assert!((y[yr * n + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "expand ({i},{c})");
                }
                let mut alone = y0[yr * n..(yr + 1) * n].to_vec();
                unsafe { lora_expand(alone.as_mut_ptr(), n, None, 1, &t[i * n..], n, &bt, n, r, n, 0.5) };
                assert_eq!(alone[..], y[yr * n..(yr + 1) * n], "expand row {i} alone");
            }
            // Rows not listed are untouched.
            for j in 0..total {
                if !idx.contains(&(j as u32)) {
                    assert_eq!(y[j * n..(j + 1) * n], y0[j * n..(j + 1) * n], "row {j} not listed");
                }
            }
        }
    }

    /// A column split (what threads do) gives the same bits as the whole width.
    #[test]
    fn expand_column_split_is_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (rows, r, n) = (9, 16, 200);
        let coef = random(&mut rng, rows * r);
        let bt = random(&mut rng, r * n);
        let y0 = random(&mut rng, rows * n);
        let mut whole = y0.clone();
        unsafe { lora_expand(whole.as_mut_ptr(), n, None, rows, &coef, r, &bt, n, r, n, 2.0) };
        let mut split = y0.clone();
        for (c0, c1) in [(0, 64), (64, 128), (128, 200)] {
            unsafe { lora_expand(split.as_mut_ptr().add(c0), n, None, rows, &coef, r, &bt[c0..], n, r, c1 - c0, 2.0) };
        }
        assert_eq!(whole, split);
    }

    /// Strided sub-matrices (both kernels write into the middle of wider rows) against f64
    /// loops, with guard bands that must stay untouched.
    #[test]
    fn strided_operands_stay_in_bounds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let guard = 1234.5f32;
        for &(rows, n, k) in &[(1, 1, 1), (1, 20, 3), (5, 12, 7), (17, 53, 16), (33, 36, 2), (64, 20, 48), (3, 1, 20), (6, 130, 16), (9, 64, 64)] {
            let (ldy, ldx) = (n + 3, k + 2);
            let x = random(&mut rng, rows * ldx);
            // A rows are contiguous (stride k) in the pool.
            let w = random(&mut rng, n * k);
            let mut y0 = vec![guard; rows * ldy + 8];
            for r in 0..rows {
                y0[1 + r * ldy..1 + r * ldy + n].fill(0.25);
            }
            let mut want = y0.clone();
            for r in 0..rows {
                for c in 0..n {
                    want[1 + r * ldy + c] = (0..k).map(|i| x[r * ldx + i] as f64 * w[c * k + i] as f64).sum::<f64>() as f32;
                }
            }
            let mut y = y0.clone();
            lora_shrink(&mut y[1..], ldy, &x, ldx, None, rows, &w, n, k);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-4, "lora_shrink ({rows},{n},{k}) at {i}: {a} vs {b}");
            }
            // Expand: coefficients x[rows, k] (stride ldx), Bᵀ [k, n] with stride ldb; rows
            // written in reverse order through idx.
            let ldb = n + 5;
            let bt = random(&mut rng, k * ldb);
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
