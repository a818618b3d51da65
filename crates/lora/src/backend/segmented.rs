//! One shrink GEMM (`x·Aᵀ`, all slices at once) and one expand GEMM per slice for each
//! contiguous segment of rows sharing a slot. Best when segments are long (prefill). For large
//! batches the rows are cut into fixed blocks processed in parallel with rayon; each block
//! handles the pieces of the segments that cross it, so blocks write disjoint rows.

use rayon::prelude::*;

use super::{ensure, expand_rows, shrink_rows, LoraBackend, LoraInput, Rows, Scratch};
use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

pub struct SegmentedBackend;

/// Largest rows per parallel block, and the adapter-row count from which rayon pays for itself
/// (a decode step of 16 rows already does: the adapters' weights are read once per step either
/// way, and two threads read them twice as fast).
const BLOCK_ROWS: usize = 64;
const PARALLEL_MIN_ROWS: usize = 8;

fn run_block(site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, lo: usize, hi: usize, y: &mut [f32], shrink: &mut [f32]) {
    let ld = site.n_slices * site.max_rank;
    // First segment that ends after `lo`.
    let first = group.seg_end.partition_point(|&e| (e as usize) <= lo);
    for s in first..group.num_segments() {
        let (s0, s1) = (group.seg_start[s] as usize, group.seg_end[s] as usize);
        if s0 >= hi {
            break;
        }
        let w = group.seg_slot[s] as usize;
        let r = site.ranks[w] as usize;
        if r == 0 {
            continue;
        }
        let (p0, p1) = (s0.max(lo), s1.min(hi));
        let sh = &mut shrink[(p0 - lo) * ld..];
        shrink_rows(site, w, input, Rows::Range(p0, p1), (0, site.n_slices * r), sh);
        let yb = &mut y[(p0 - lo) * site.out_dim..(p1 - lo) * site.out_dim];
        // SAFETY: rows p0..p1 of this block, borrowed mutably above.
        unsafe { expand_rows(site, w, sh, p1 - p0, yb.as_mut_ptr(), site.out_dim, None, (0, 1)) };
    }
}

impl LoraBackend for SegmentedBackend {
    fn name(&self) -> &'static str {
        "segmented"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        let m = group.rows();
        if group.adapter_rows == 0 || m == 0 {
            return;
        }
        let ld = site.n_slices * site.max_rank;
        let out = site.out_dim;
        let threads = rayon::current_num_threads();
        if group.adapter_rows >= PARALLEL_MIN_ROWS && threads > 1 {
            ensure(&mut scratch.shrink, m * ld);
            // Blocks split segments at row boundaries only; every element is computed the same
            // way whatever block it lands in.
            let block = m.div_ceil(threads).clamp(4, BLOCK_ROWS);
            y[..m * out]
                .par_chunks_mut(block * out)
                .zip(scratch.shrink[..m * ld].par_chunks_mut(block * ld))
                .enumerate()
                .for_each(|(b, (yb, sb))| {
                    let lo = b * block;
                    run_block(site, group, input, lo, (lo + block).min(m), yb, sb);
                });
        } else {
            // Sequential: one scratch block sized for the longest segment.
            ensure(&mut scratch.shrink, group.max_seg_len * ld);
            for s in 0..group.num_segments() {
                let (s0, s1) = (group.seg_start[s] as usize, group.seg_end[s] as usize);
                let w = group.seg_slot[s] as usize;
                let r = site.ranks[w] as usize;
                if r == 0 {
                    continue;
                }
                shrink_rows(site, w, input, Rows::Range(s0, s1), (0, site.n_slices * r), &mut scratch.shrink);
                let ys = &mut y[s0 * out..s1 * out];
                // SAFETY: the segment's rows, borrowed mutably above.
                unsafe { expand_rows(site, w, &scratch.shrink, s1 - s0, ys.as_mut_ptr(), out, None, (0, 1)) };
            }
        }
    }
}
