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
//! through a stable permutation, chunk by chunk: shrink and expand read and write the rows in
//! place through it), `auto` (per call,
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

/// The kernels crate's LoRA shrink and expand: register-tiled, rows read and written in place
/// through an optional row list, each element computed the same way whatever rows share the
/// call (a row's delta never depends on its batch).
use quiver_kernels::cpu::lora::{lora_expand, lora_shrink};

/// The input rows a shrink reads.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'a> {
    /// Rows `[lo, hi)`, contiguous (a segment).
    Range(usize, usize),
    /// The rows listed (a chunk of the permutation), read in place.
    Listed(&'a [u32]),
}

impl Rows<'_> {
    fn len(&self) -> usize {
        match *self {
            Rows::Range(lo, hi) => hi - lo,
            Rows::Listed(p) => p.len(),
        }
    }
    fn row(&self, i: usize) -> usize {
        match *self {
            Rows::Range(lo, _) => lo + i,
            Rows::Listed(p) => p[i] as usize,
        }
    }
}

/// Part `part` of `parts` of `[0, len)`, cut at multiples of `align` (the last part takes the
/// rest): how the threads split a chunk's columns without splitting a vector block.
pub(crate) fn part_range(len: usize, (part, parts): (usize, usize), align: usize) -> (usize, usize) {
    let cut = |p: usize| if p == parts { len } else { (len * p / parts) / align * align };
    (cut(part), cut(part + 1))
}

/// Shrink columns `cols` (of the `n·r` of slot `w`, all of them for `(0, n·r)`) of `rows` into
/// `shrink` rows `0..` (stride `n·R`).
pub(crate) fn shrink_rows(site: &SiteView<'_>, w: usize, input: LoraInput<'_>, rows: Rows<'_>, (c0, c1): (usize, usize), shrink: &mut [f32]) {
    let (din, ld) = (site.in_dim, site.n_slices * site.max_rank);
    let a = site.a_slot(w);
    let n = rows.len();
    match input {
        LoraInput::Dense(x) => match rows {
            Rows::Range(lo, _) => lora_shrink(&mut shrink[c0..], ld, &x[lo * din..], din, None, n, &a[c0 * din..], c1 - c0, din),
            Rows::Listed(p) => lora_shrink(&mut shrink[c0..], ld, x, din, Some(p), n, &a[c0 * din..], c1 - c0, din),
        },
        LoraInput::TokenIds(ids) => {
            for i in 0..n {
                let id = ids[rows.row(i)] as usize;
                for k in c0..c1 {
                    // Ids beyond the vocab (never produced by the tokenizer) get no delta.
                    shrink[i * ld + k] = if id < din { a[k * din + id] } else { 0.0 };
                }
            }
        }
    }
}

/// Expand of `rows` shrink rows (stride `n·R`) added into `y` rows (stride `ldy`, row `i` at
/// `idx[i]`, or `i` without `idx`), every slice with its own scaling. `part` of `parts` (see
/// [`part_range`]) restricts it to that share of every slice's output columns; `(0, 1)` is all.
///
/// # Safety
/// The addressed `y` rows (the part's columns) are valid for writes and nobody else touches them
/// during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn expand_rows(site: &SiteView<'_>, w: usize, shrink: &[f32], rows: usize, y: *mut f32, ldy: usize, idx: Option<&[u32]>, part: (usize, usize)) {
    let (ld, r) = (site.n_slices * site.max_rank, site.ranks[w] as usize);
    let bt = site.b_slot(w);
    for j in 0..site.n_slices {
        let o0 = site.offsets[j];
        let (p0, p1) = part_range(site.offsets[j + 1] - o0, part, 64);
        // SAFETY: columns o0+p0..o0+p1 ≤ out_dim of the caller's rows.
        unsafe { lora_expand(y.add(o0 + p0), ldy, idx, rows, &shrink[j * r..], ld, &bt[o0 + p0..], site.b_ld, r, p1 - p0, site.scaling(w, j)) };
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
