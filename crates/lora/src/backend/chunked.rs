//! Chunked SGMV: adapter rows sorted by slot through the stable permutation and cut into chunks
//! of at most `chunk_size` rows of one slot; the kernel reads the input rows and adds into the
//! output rows in place through it (rows never move). Best for decode, where adjacent rows have
//! different adapters and segments are one row long: each adapter's A and Bᵀ are read once per
//! chunk instead of once per row.

use super::{LoraBackend, SiteRef};
use crate::batch::RowGrouping;
use quiver_kernels::{Device, LoraX, Tensor};

pub struct ChunkedBackend;

impl LoraBackend for ChunkedBackend {
    fn name(&self) -> &'static str {
        "chunked"
    }
    fn apply(&self, dev: &dyn Device, site: SiteRef<'_>, rows: &RowGrouping, x: LoraX<'_>, y: &mut Tensor) {
        if rows.adapter_rows > 0 {
            dev.lora_apply(&site.call(rows.chunks()), x, y);
        }
    }
    fn groups<'a>(&self, rows: &'a RowGrouping) -> Option<quiver_kernels::LoraGroups<'a>> {
        Some(rows.chunks())
    }
}
