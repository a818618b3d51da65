//! Chunked SGMV on CPU: adapter rows sorted by slot through the stable permutation, split into
//! chunks of one slot; per chunk one shrink GEMM reads the input rows in place through the
//! permutation, and the expand adds straight into the rows' places in `y` through it. Rows never move
//! in `y`. Best for decode, where
//! adjacent rows have different adapters and segments are one row long.

use super::{ensure, expand_rows, part_range, shrink_rows, LoraBackend, LoraInput, Rows, Scratch};
use rayon::prelude::*;
use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

pub struct ChunkedBackend;

/// Adapter rows from which the work runs on several threads.
const PARALLEL_MIN_ROWS: usize = 8;

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Shrink rows laid out by position in the permutation (`n·R` wide), which parallel tasks split
/// into disjoint regions.
#[derive(Clone, Copy)]
struct PermScratch {
    shrink: SyncPtr,
    ld: usize,
}

impl PermScratch {
    fn new(scratch: &mut Scratch, site: &SiteView<'_>, group: &RowGrouping) -> PermScratch {
        let ld = site.n_slices * site.max_rank;
        ensure(&mut scratch.shrink, group.adapter_rows * ld);
        PermScratch { shrink: SyncPtr(scratch.shrink.as_mut_ptr()), ld }
    }

    /// The shrink rows of permutation positions `lo..hi`.
    ///
    /// # Safety
    /// The caller is the only one touching those rows (or, for a column split, those rows'
    /// columns it writes) while it holds them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, lo: usize, hi: usize) -> &mut [f32] {
        // SAFETY: sized for every adapter row in `new`; exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.shrink.0.add(lo * self.ld), (hi - lo) * self.ld) }
    }
}

impl LoraBackend for ChunkedBackend {
    fn name(&self) -> &'static str {
        "chunked"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        if group.adapter_rows == 0 {
            return;
        }
        let threads = rayon::current_num_threads();
        let parts = if threads > 1 && group.adapter_rows >= PARALLEL_MIN_ROWS { threads } else { 1 };
        if parts > 1 && group.num_chunks() >= parts {
            apply_row_blocks(site, group, input, y, scratch, parts);
        } else {
            apply_parts(site, group, input, y, scratch, parts);
        }
    }
}

/// With at least as many chunks as threads: the permuted rows cut into `parts` equal blocks, each
/// task running shrink then expand over the pieces of the chunks inside its block. One fork-join
/// per call instead of two, and each thread reads only the adapters of its own rows (a chunk cut
/// by a block boundary is read by both neighbours), where the column split makes every thread
/// read a share of every adapter. No split changes how any element is computed.
fn apply_row_blocks(site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch, parts: usize) {
    let out = site.out_dim;
    let total = group.adapter_rows;
    let ps = PermScratch::new(scratch, site, group);
    let yp = SyncPtr(y.as_mut_ptr());
    let block = total.div_ceil(parts);
    (0..parts).into_par_iter().for_each(|b| {
        let (ps, yp) = (ps, yp);
        let (lo, hi) = (b * block, ((b + 1) * block).min(total));
        // First chunk that ends after `lo`.
        let first = group.chunk_end[..group.num_chunks()].partition_point(|&e| (e as usize) <= lo);
        for c in first..group.num_chunks() {
            let (c0, c1) = (group.chunk_start[c] as usize, group.chunk_end[c] as usize);
            if c0 >= hi {
                break;
            }
            let w = group.chunk_slot[c] as usize;
            if site.ranks[w] == 0 {
                continue;
            }
            let (p0, p1) = (c0.max(lo), c1.min(hi));
            let rows = &group.perm[p0..p1];
            // SAFETY: permutation positions p0..p1 lie in this task's block: their shrink rows,
            // and the y rows they list (perm is a permutation), are its alone.
            let sh = unsafe { ps.rows(p0, p1) };
            shrink_rows(site, w, input, Rows::Listed(rows), (0, site.n_slices * site.ranks[w] as usize), sh);
            unsafe { expand_rows(site, w, sh, p1 - p0, yp.0, out, Some(rows), (0, 1)) };
        }
    });
}

/// Every chunk's work split by *columns* into `parts` tasks: first the shrink (columns of
/// `x·Aᵀ`), then, after a join, the expand (output columns). With several threads each one thus
/// reads its share of the adapter's A and Bᵀ, where splitting by rows made every thread read all
/// of them: at decode sizes the weights, not the arithmetic, are the cost. With one part it is
/// a plain loop over the chunks. No split changes how any element is computed.
fn apply_parts(site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch, parts: usize) {
    let out = site.out_dim;
    let ld = site.n_slices * site.max_rank;
    let ps = PermScratch::new(scratch, site, group);
    let yp = SyncPtr(y.as_mut_ptr());
    // Task t: part t % parts of chunk t / parts; None when the chunk's slot has rank 0 here.
    let task = |t: usize| {
        let (c, part) = (t / parts, t % parts);
        let w = group.chunk_slot[c] as usize;
        let (lo, hi) = (group.chunk_start[c] as usize, group.chunk_end[c] as usize);
        (site.ranks[w] > 0).then_some((part, w, lo, hi))
    };
    let shrink_task = |t: usize| {
        let Some((part, w, lo, hi)) = task(t) else { return };
        let cols = part_range(site.n_slices * site.ranks[w] as usize, (part, parts), 1);
        #[allow(clippy::redundant_locals)]
        let ps = ps;
        // SAFETY: shrink rows lo..hi, columns `cols`, are this task's alone (chunks own disjoint
        // rows, parts disjoint columns, and shrink_rows writes only `cols`).
        let sh = unsafe { ps.rows(lo, hi) };
        shrink_rows(site, w, input, Rows::Listed(&group.perm[lo..hi]), cols, sh);
    };
    let expand_task = |t: usize, shrink: &[f32]| {
        let Some((part, w, lo, hi)) = task(t) else { return };
        // The whole SyncPtr, not its raw field, must be captured (edition 2021 closures capture
        // fields), or the closure is not Send.
        #[allow(clippy::redundant_locals)]
        let yp = yp;
        // SAFETY: this chunk's rows (listed in perm[lo..hi], inside y) in this part's output
        // columns are this task's alone.
        unsafe { expand_rows(site, w, &shrink[lo * ld..], hi - lo, yp.0, out, Some(&group.perm[lo..hi]), (part, parts)) };
    };
    let tasks = group.num_chunks() * parts;
    if parts == 1 {
        (0..tasks).for_each(shrink_task);
        let shrink = &scratch.shrink[..];
        (0..tasks).for_each(|t| expand_task(t, shrink));
    } else {
        (0..tasks).into_par_iter().for_each(shrink_task);
        let shrink = &scratch.shrink[..];
        (0..tasks).into_par_iter().for_each(|t| expand_task(t, shrink));
    }
}
