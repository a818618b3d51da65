//! One group per contiguous segment of rows sharing a slot: each is a small GEMM over
//! consecutive rows (shrink `x·Aᵀ` of all slices at once, then one expand per slice). Best when
//! segments are long (prefill).

use super::{LoraBackend, SiteRef};
use crate::batch::RowGrouping;
use quiver_kernels::{Device, LoraX, Tensor};

pub struct SegmentedBackend;

impl LoraBackend for SegmentedBackend {
    fn name(&self) -> &'static str {
        "segmented"
    }
    fn apply(&self, dev: &dyn Device, site: SiteRef<'_>, rows: &RowGrouping, x: LoraX<'_>, y: &mut Tensor) {
        if rows.adapter_rows > 0 {
            dev.lora_apply(&site.call(rows.segments()), x, y);
        }
    }
    fn groups<'a>(&self, rows: &'a RowGrouping) -> Option<quiver_kernels::LoraGroups<'a>> {
        Some(rows.segments())
    }
}
