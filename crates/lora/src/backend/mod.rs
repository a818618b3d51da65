//! LoRA kernels behind a name registry.
//!
//! Every backend computes, for each row `t` with slot `w` and site rank `r = ranks[w] > 0`,
//! and each slice `j` of the site:
//! `y[t, off_j..off_{j+1}] += s_{w,j} · (x[t] · A[w, j·r..(j+1)·r]ᵀ) · B[w, off_j..off_{j+1}, ..r]ᵀ`
//! contracting over exactly `r` (layout: crate docs). The embedding replaces the shrink by a
//! gather of A's columns at the token id. Rows with no slot or rank 0 are never touched.
//!
//! Backends (CPU): `reference` (per-row loops, the test oracle), `segmented` (one shrink GEMM
//! and one expand GEMM per slice per contiguous segment), `chunked` (rows grouped by slot
//! through a stable permutation, chunk by chunk: gather, GEMM, scatter-add), `auto` (per call,
//! segmented for prefill-shaped groupings, chunked for decode-shaped ones).

mod chunked;
mod reference;
mod segmented;

use quiver_kernels::DeviceKind;

pub use chunked::ChunkedBackend;
pub use reference::ReferenceBackend;
pub use segmented::SegmentedBackend;

use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

/// The input of a LoRA site.
#[derive(Clone, Copy)]
pub enum LoraInput<'a> {
    /// Row-major `[rows, in]` activations.
    Dense(&'a [f32]),
    /// Token ids (embedding LoRA): the shrink is a gather of A's columns.
    TokenIds(&'a [u32]),
}

/// Grow-only working memory, reused across calls so a steady-state step allocates nothing.
#[derive(Default)]
pub struct Scratch {
    /// Shrink output, `[rows, n·R]`.
    pub shrink: Vec<f32>,
    /// Gathered input rows (chunked).
    pub gathered: Vec<f32>,
    /// Expand output before the scatter-add (chunked).
    pub expanded: Vec<f32>,
}

pub(crate) fn ensure(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// A LoRA kernel set.
pub trait LoraBackend: Send + Sync {
    fn name(&self) -> &'static str;
    /// `y[t, ..out] += Δ(input[t])` for every row of `group` that has a slot with nonzero rank
    /// for this site. `y` is row-major `[group.rows(), site.out_dim]` (longer is fine).
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch);
}

/// The kernels crate's dot product: vectorized for the CPU's widest instruction set (chosen once
/// per process), with a fixed accumulation order, so a row's delta does not depend on which
/// rows share its GEMM.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    quiver_kernels::cpu::simd::dot(a, b)
}

/// `y[rows, n] (row stride ldy) (+)= alpha · x[rows, k] (stride ldx) · w[n, k] (stride ldw)ᵀ`.
///
/// Own kernel rather than faer: LoRA GEMMs have one tiny dimension (the rank), and faer
/// 0.24.4 corrupted the heap on strided row-major destinations with one row (caught by
/// `gemm_nt_matches_naive_and_stays_in_bounds`). Four input rows share each weight row load.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_nt(y: &mut [f32], ldy: usize, x: &[f32], ldx: usize, w: &[f32], ldw: usize, rows: usize, n: usize, k: usize, alpha: f32, add: bool) {
    if rows == 0 || n == 0 {
        return;
    }
    let mut r = 0;
    while r + 4 <= rows {
        let xs = [&x[r * ldx..r * ldx + k], &x[(r + 1) * ldx..(r + 1) * ldx + k], &x[(r + 2) * ldx..(r + 2) * ldx + k], &x[(r + 3) * ldx..(r + 3) * ldx + k]];
        for c in 0..n {
            let wr = &w[c * ldw..c * ldw + k];
            for (i, xr) in xs.iter().enumerate() {
                let d = alpha * dot(xr, wr);
                let o = &mut y[(r + i) * ldy + c];
                *o = if add { *o + d } else { d };
            }
        }
        r += 4;
    }
    while r < rows {
        let xr = &x[r * ldx..r * ldx + k];
        for c in 0..n {
            let d = alpha * dot(xr, &w[c * ldw..c * ldw + k]);
            let o = &mut y[r * ldy + c];
            *o = if add { *o + d } else { d };
        }
        r += 1;
    }
}

/// Shrink of rows `[lo, hi)` (contiguous) into `shrink` rows `0..hi-lo` (stride `n·R`).
pub(crate) fn shrink_rows(site: &SiteView<'_>, w: usize, r: usize, input: LoraInput<'_>, lo: usize, hi: usize, shrink: &mut [f32]) {
    let ld = site.n_slices * site.max_rank;
    let cr = site.n_slices * r;
    let a = site.a_slot(w);
    match input {
        LoraInput::Dense(x) => gemm_nt(shrink, ld, &x[lo * site.in_dim..], site.in_dim, a, site.in_dim, hi - lo, cr, site.in_dim, 1.0, false),
        LoraInput::TokenIds(ids) => {
            for (i, &id) in ids[lo..hi].iter().enumerate() {
                let id = id as usize;
                for k in 0..cr {
                    // Ids beyond the vocab (never produced by the tokenizer) get no delta.
                    shrink[i * ld + k] = if id < site.in_dim { a[k * site.in_dim + id] } else { 0.0 };
                }
            }
        }
    }
}

/// Expand of `rows` shrink rows (stride `n·R`) into `y` rows (stride `ldy`, starting at the
/// slice offsets), every slice with its own scaling.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expand_rows(site: &SiteView<'_>, w: usize, r: usize, shrink: &[f32], rows: usize, y: &mut [f32], ldy: usize, add: bool) {
    let ld = site.n_slices * site.max_rank;
    let b = site.b_slot(w);
    for j in 0..site.n_slices {
        let (o0, o1) = (site.offsets[j], site.offsets[j + 1]);
        gemm_nt(&mut y[o0..], ldy, &shrink[j * r..], ld, &b[o0 * site.max_rank..], site.max_rank, rows, o1 - o0, r, site.scaling(w, j), add);
    }
}

/// A registered backend.
pub struct BackendSpec {
    pub name: &'static str,
    pub description: &'static str,
    pub supports: fn(DeviceKind) -> bool,
    pub make: fn() -> Box<dyn LoraBackend>,
}

fn cpu_only(d: DeviceKind) -> bool {
    d == DeviceKind::Cpu
}

/// Every backend, in preference order; `auto` is the default.
pub static BACKENDS: &[BackendSpec] = &[
    BackendSpec {
        name: "auto",
        description: "per call: segmented for prefill-shaped batches, chunked for decode (on CUDA, rows staged through host memory until GPU LoRA kernels land)",
        supports: |_| true, make: || Box::new(AutoBackend::default()) },
    BackendSpec { name: "segmented", description: "one shrink and one expand GEMM per contiguous segment", supports: cpu_only, make: || Box::new(SegmentedBackend) },
    BackendSpec { name: "chunked", description: "rows grouped by adapter through a permutation, GEMM per chunk", supports: cpu_only, make: || Box::new(ChunkedBackend) },
    BackendSpec { name: "reference", description: "per-row loops; slow, the test oracle", supports: cpu_only, make: || Box::new(ReferenceBackend) },
];

pub const DEFAULT_BACKEND: &str = "auto";

/// Names of the backends usable on `device`.
pub fn backend_names(device: DeviceKind) -> Vec<&'static str> {
    BACKENDS.iter().filter(|b| (b.supports)(device)).map(|b| b.name).collect()
}

/// Ok if `name` is a backend that runs on `device`; otherwise a message listing valid names.
pub fn validate_backend(name: &str, device: DeviceKind) -> Result<(), String> {
    let valid = backend_names(device);
    match BACKENDS.iter().find(|b| b.name == name) {
        Some(b) if (b.supports)(device) => Ok(()),
        Some(_) => Err(format!(
            "LoRA backend `{name}` does not support device {device}; valid LoRA backends for {device}: {}",
            if valid.is_empty() { "none".to_string() } else { valid.join(", ") }
        )),
        None => Err(format!(
            "unknown LoRA backend `{name}`; valid LoRA backends for {device}: {}",
            if valid.is_empty() { "none".to_string() } else { valid.join(", ") }
        )),
    }
}

/// Builds the backend `name` for `device`.
pub fn create_backend(name: &str, device: DeviceKind) -> Result<Box<dyn LoraBackend>, String> {
    validate_backend(name, device)?;
    Ok((BACKENDS.iter().find(|b| b.name == name).expect("validated").make)())
}

/// Picks per call from the grouping's shape. Measured on the 2-core dev VM (see the crate
/// report / `tests/bench_auto.rs`): with segments averaging at least `min_avg_segment` rows the
/// per-segment GEMMs win; with many short segments (decode: one row per sequence, adapters
/// interleaved) grouping rows by slot into chunks wins.
pub struct AutoBackend {
    pub min_avg_segment: usize,
}

impl Default for AutoBackend {
    fn default() -> Self {
        AutoBackend { min_avg_segment: 4 }
    }
}

impl LoraBackend for AutoBackend {
    fn name(&self) -> &'static str {
        "auto"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        let segs = group.num_segments().max(1);
        if group.adapter_rows >= self.min_avg_segment * segs {
            SegmentedBackend.apply(site, group, input, y, scratch)
        } else {
            ChunkedBackend.apply(site, group, input, y, scratch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_nt;

    /// `gemm_nt` on strided sub-matrices against naive loops, with guard bands that must stay
    /// untouched (the expand writes into the middle of wider rows).
    #[test]
    fn gemm_nt_matches_naive_and_stays_in_bounds() {
        let mut seed = 1u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for &(rows, n, k) in &[(1, 1, 1), (1, 20, 3), (5, 12, 7), (17, 53, 16), (33, 36, 2), (64, 20, 48), (3, 1, 20)] {
            for add in [false, true] {
                let (ldy, ldx, ldw) = (n + 3, k + 2, k + 5);
                let x: Vec<f32> = (0..rows * ldx).map(|_| rnd()).collect();
                let w: Vec<f32> = (0..n * ldw).map(|_| rnd()).collect();
                let guard = 1234.5f32;
                let mut y = vec![guard; rows * ldy + 8];
                for r in 0..rows {
                    for c in 0..n {
                        y[1 + r * ldy + c] = 0.25;
                    }
                }
                let mut want = y.clone();
                for r in 0..rows {
                    for c in 0..n {
                        let d: f32 = (0..k).map(|i| x[r * ldx + i] * w[c * ldw + i]).sum();
                        let v = &mut want[1 + r * ldy + c];
                        *v = if add { *v + 0.5 * d } else { 0.5 * d };
                    }
                }
                gemm_nt(&mut y[1..], ldy, &x, ldx, &w, ldw, rows, n, k, 0.5, add);
                for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() < 1e-4, "({rows},{n},{k},{add}) at {i}: {a} vs {b}");
                }
            }
        }
    }
}
