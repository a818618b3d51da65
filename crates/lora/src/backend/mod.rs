//! LoRA backends: *policies* that choose how a batch's rows are grouped for the device's LoRA
//! kernel (`Device::lora_apply`, one op with a CPU and a CUDA version), behind a name registry.
//!
//! Every backend computes, for each row `t` with slot `w` and site rank `r = ranks[w] > 0`,
//! and each slice `j` of the site:
//! `y[t, off_j..off_{j+1}] += s_{w,j} · (x[t] · A[w, j·r..(j+1)·r]ᵀ) · B[w, off_j..off_{j+1}, ..r]ᵀ`
//! contracting over exactly `r` (layout: crate docs). The embedding replaces the shrink by a
//! gather of A's columns at the token id. Rows with no slot or rank 0 are never touched.
//!
//! - `segmented`: one group per contiguous segment of rows sharing a slot (prefill: a request's
//!   rows), so each group is a small GEMM over consecutive rows;
//! - `chunked`: rows sorted by slot through a stable permutation and cut into chunks of at most
//!   `chunk_size` rows (decode: adapters interleaved row by row), read and written in place
//!   through it;
//! - `auto`: per call, segmented for prefill-shaped groupings, chunked for decode-shaped ones;
//! - `reference` (CPU only): per-row loops in f64 on host memory, the test oracle.
//!
//! Which device runs the kernel is the device's business: the policies name none.

mod chunked;
mod reference;
mod segmented;

use quiver_kernels::{Device, DeviceKind, LoraCall, LoraGroups, LoraSiteBuffers, LoraTable, LoraX, Tensor};

pub use chunked::ChunkedBackend;
pub use reference::ReferenceBackend;
pub use segmented::SegmentedBackend;

use crate::batch::RowGrouping;

/// One site's storage in the pool: its buffers and its row of the rank / scaling table.
#[derive(Clone, Copy)]
pub struct SiteRef<'a> {
    pub buffers: &'a LoraSiteBuffers,
    pub table: &'a LoraTable,
    pub entry: usize,
}

impl<'a> SiteRef<'a> {
    /// The device call for this site over `groups`.
    pub fn call(self, groups: LoraGroups<'a>) -> LoraCall<'a> {
        LoraCall { buffers: self.buffers, table: self.table, entry: self.entry, groups }
    }
}

/// A LoRA policy.
pub trait LoraBackend: Send + Sync {
    fn name(&self) -> &'static str;
    /// `y[t, ..out] += Δ(x[t])` for every row of `rows` that has a slot with nonzero rank for
    /// this site. `y` is row-major `[rows.rows(), out]` on `dev`.
    fn apply(&self, dev: &dyn Device, site: SiteRef<'_>, rows: &RowGrouping, x: LoraX<'_>, y: &mut Tensor);
    /// The grouping this policy hands the device for `rows` (what [`Self::apply`] passes to
    /// `Device::lora_apply`), so a projection can take its delta in the same device op
    /// (`Device::matmul_lora`); `None` for a policy that runs its own loops.
    fn groups<'a>(&self, _rows: &'a RowGrouping) -> Option<LoraGroups<'a>> {
        None
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

/// Devices with a `lora_apply` kernel.
fn any_device(_: DeviceKind) -> bool {
    true
}

/// Every backend, in preference order; `auto` is the default.
pub static BACKENDS: &[BackendSpec] = &[
    BackendSpec { name: "auto", description: "per call: segmented for prefill-shaped batches, chunked for decode", supports: any_device, make: || Box::new(AutoBackend::default()) },
    BackendSpec { name: "segmented", description: "one group per contiguous segment of rows sharing an adapter", supports: any_device, make: || Box::new(SegmentedBackend) },
    BackendSpec { name: "chunked", description: "rows grouped by adapter through a permutation, in chunks", supports: any_device, make: || Box::new(ChunkedBackend) },
    BackendSpec { name: "reference", description: "per-row loops on host memory; slow, the test oracle", supports: cpu_only, make: || Box::new(ReferenceBackend) },
];

pub const DEFAULT_BACKEND: &str = "auto";

/// Names of the backends usable on `device`.
pub fn backend_names(device: DeviceKind) -> Vec<&'static str> {
    BACKENDS.iter().filter(|b| (b.supports)(device)).map(|b| b.name).collect()
}

/// Ok if `name` is a backend that runs on `device`; otherwise a message listing valid names.
pub fn validate_backend(name: &str, device: DeviceKind) -> Result<(), String> {
    let valid = backend_names(device);
    let list = if valid.is_empty() { "none".to_string() } else { valid.join(", ") };
    match BACKENDS.iter().find(|b| b.name == name) {
        Some(b) if (b.supports)(device) => Ok(()),
        Some(_) => Err(format!("LoRA backend `{name}` does not support device {device}; valid LoRA backends for {device}: {list}")),
        None => Err(format!("unknown LoRA backend `{name}`; valid LoRA backends for {device}: {list}")),
    }
}

/// Builds the backend `name` for `device`.
pub fn create_backend(name: &str, device: DeviceKind) -> Result<Box<dyn LoraBackend>, String> {
    validate_backend(name, device)?;
    Ok((BACKENDS.iter().find(|b| b.name == name).expect("validated").make)())
}

/// Picks per call from the grouping's shape: with segments averaging at least
/// `min_avg_segment` rows the per-segment GEMMs win; with many short segments (decode: one row
/// per sequence, adapters interleaved) grouping rows by slot into chunks wins. Measured on the
/// 2-core dev VM for the CPU (`tests/bench_auto.rs`).
pub struct AutoBackend {
    pub min_avg_segment: usize,
}

impl Default for AutoBackend {
    fn default() -> Self {
        AutoBackend { min_avg_segment: 4 }
    }
}

impl AutoBackend {
    /// True when this grouping goes to the segmented policy.
    pub fn picks_segments(&self, rows: &RowGrouping) -> bool {
        rows.adapter_rows >= self.min_avg_segment * rows.num_segments().max(1)
    }
}

impl LoraBackend for AutoBackend {
    fn name(&self) -> &'static str {
        "auto"
    }
    fn apply(&self, dev: &dyn Device, site: SiteRef<'_>, rows: &RowGrouping, x: LoraX<'_>, y: &mut Tensor) {
        if self.picks_segments(rows) {
            SegmentedBackend.apply(dev, site, rows, x, y)
        } else {
            ChunkedBackend.apply(dev, site, rows, x, y)
        }
    }
    fn groups<'a>(&self, rows: &'a RowGrouping) -> Option<LoraGroups<'a>> {
        Some(if self.picks_segments(rows) { rows.segments() } else { rows.chunks() })
    }
}
