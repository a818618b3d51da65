//! Chunked SGMV on CPU: adapter rows sorted by slot through the stable permutation, split into
//! chunks of one slot; per chunk the input rows are gathered and shrunk with one GEMM, and the
//! expand adds straight into the rows' places in `y` through the permutation. Rows never move
//! in `y`. Best for decode, where
//! adjacent rows have different adapters and segments are one row long.

use super::{ensure, expand_rows, gemm_nt, LoraBackend, LoraInput, Scratch};
use rayon::prelude::*;
use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

pub struct ChunkedBackend;

/// Adapter rows from which the work runs on several threads.
const PARALLEL_MIN_ROWS: usize = 8;

/// Rows `perm[lo..hi]` (all of slot `w`): gather, shrink, expand-add into `y`.
/// `gathered` and `shrink` are this piece's own scratch (rows `0..hi-lo`).
///
/// # Safety
/// `y` points at the step's `[rows, out]` output; no other piece touches the rows listed in
/// `perm[lo..hi]` (each row belongs to exactly one chunk, and pieces split chunks).
#[allow(clippy::too_many_arguments)]
unsafe fn run_piece(site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, w: usize, lo: usize, hi: usize, y: *mut f32, gathered: &mut [f32], shrink: &mut [f32]) {
    let (din, out) = (site.in_dim, site.out_dim);
    let ld = site.n_slices * site.max_rank;
    let r = site.ranks[w] as usize;
    let rows = &group.perm[lo..hi];
    let n = rows.len();
    let cr = site.n_slices * r;
    let a = site.a_slot(w);
    match input {
        LoraInput::Dense(x) => {
            for (i, &p) in rows.iter().enumerate() {
                let p = p as usize;
                gathered[i * din..(i + 1) * din].copy_from_slice(&x[p * din..(p + 1) * din]);
            }
            gemm_nt(shrink, ld, gathered, din, a, din, n, cr, din, 1.0, false);
        }
        LoraInput::TokenIds(ids) => {
            for (i, &p) in rows.iter().enumerate() {
                let id = ids[p as usize] as usize;
                for k in 0..cr {
                    shrink[i * ld + k] = if id < din { a[k * din + id] } else { 0.0 };
                }
            }
        }
    }
    // SAFETY: the rows in perm[lo..hi] are this piece's alone (see above) and lie inside y.
    unsafe { expand_rows(site, w, r, shrink, n, y, out, Some(rows)) };
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl LoraBackend for ChunkedBackend {
    fn name(&self) -> &'static str {
        "chunked"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        if group.adapter_rows == 0 {
            return;
        }
        let din = site.in_dim;
        let ld = site.n_slices * site.max_rank;
        // Scratch is laid out by position in the permutation, so any split of the chunks into
        // pieces gets disjoint scratch rows.
        let total = group.adapter_rows;
        ensure(&mut scratch.shrink, total * ld);
        if matches!(input, LoraInput::Dense(_)) {
            ensure(&mut scratch.gathered, total * din);
        }
        let threads = rayon::current_num_threads();
        if threads > 1 && total >= PARALLEL_MIN_ROWS {
            return apply_parallel(site, group, input, y, scratch, threads);
        }
        let yp = y.as_mut_ptr();
        let Scratch { shrink, gathered } = scratch;
        for c in 0..group.num_chunks() {
            let w = group.chunk_slot[c] as usize;
            let (lo, hi) = (group.chunk_start[c] as usize, group.chunk_end[c] as usize);
            if site.ranks[w] == 0 {
                continue;
            }
            let g = if matches!(input, LoraInput::Dense(_)) { &mut gathered[lo * din..hi * din] } else { &mut [][..] };
            // SAFETY: one chunk at a time on this thread; its rows lie inside y.
            unsafe { run_piece(site, group, input, w, lo, hi, yp, g, &mut shrink[lo * ld..hi * ld]) };
        }
    }
}

struct Task {
    part: usize,
    w: usize,
    r: usize,
    lo: usize,
    hi: usize,
}

/// Column range `part` of `parts` over `[0, len)`, cut at multiples of `align` (the last part
/// takes the rest), so parts split the work without splitting a vector block.
fn part_range(len: usize, part: usize, parts: usize, align: usize) -> (usize, usize) {
    let cut = |p: usize| if p == parts { len } else { (len * p / parts) / align * align };
    (cut(part), cut(part + 1))
}

/// The multi-threaded path: every chunk's work is split by *columns* across `parts` tasks,
/// first the shrink (columns of `x·Aᵀ`), then, after a join, the expand (output columns). Each
/// thread thus reads its share of the adapter's A and Bᵀ, where splitting by rows made every
/// thread read all of them: at decode sizes the weights, not the arithmetic, are the cost.
/// Neither split changes how any element is computed.
fn apply_parallel(site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch, parts: usize) {
    let din = site.in_dim;
    let ld = site.n_slices * site.max_rank;
    let total = group.adapter_rows;
    // Each (chunk, part) task gathers its chunk's rows into its own region.
    if matches!(input, LoraInput::Dense(_)) {
        ensure(&mut scratch.gathered, parts * total * din);
    }
    let Scratch { shrink, gathered } = scratch;
    let (sp, gp, yp) = (SyncPtr(shrink.as_mut_ptr()), SyncPtr(gathered.as_mut_ptr()), SyncPtr(y.as_mut_ptr()));
    let tasks = group.num_chunks() * parts;
    // Task t: part t % parts of chunk t / parts; None when the chunk's slot has rank 0 here.
    let task = |t: usize| {
        let (c, part) = (t / parts, t % parts);
        let w = group.chunk_slot[c] as usize;
        let r = site.ranks[w] as usize;
        (r > 0).then(|| Task { part, w, r, lo: group.chunk_start[c] as usize, hi: group.chunk_end[c] as usize })
    };
    (0..tasks).into_par_iter().for_each(|t| {
        let Some(Task { part, w, r, lo, hi }) = task(t) else { return };
        let rows = &group.perm[lo..hi];
        let n = hi - lo;
        let (c0, c1) = part_range(site.n_slices * r, part, parts, 1);
        let a = site.a_slot(w);
        let (sp, gp) = (sp, gp);
        // SAFETY: shrink rows lo..hi, columns c0..c1 are this task's alone (chunks own disjoint
        // rows, parts disjoint columns); the gathered region (part, lo..hi) likewise.
        unsafe {
            let sh = std::slice::from_raw_parts_mut(sp.0.add(lo * ld), n * ld);
            match input {
                LoraInput::Dense(x) => {
                    let g = std::slice::from_raw_parts_mut(gp.0.add((part * total + lo) * din), n * din);
                    for (i, &p) in rows.iter().enumerate() {
                        let p = p as usize;
                        g[i * din..(i + 1) * din].copy_from_slice(&x[p * din..(p + 1) * din]);
                    }
                    gemm_nt(&mut sh[c0..], ld, g, din, &a[c0 * din..], din, n, c1 - c0, din, 1.0, false);
                }
                LoraInput::TokenIds(ids) => {
                    for (i, &p) in rows.iter().enumerate() {
                        let id = ids[p as usize] as usize;
                        for k in c0..c1 {
                            sh[i * ld + k] = if id < din { a[k * din + id] } else { 0.0 };
                        }
                    }
                }
            }
        }
    });
    let shrink = &*shrink;
    (0..tasks).into_par_iter().for_each(|t| {
        let Some(Task { part, w, r, lo, hi }) = task(t) else { return };
        let bt = site.b_slot(w);
        // The whole SyncPtr, not its raw field, must be captured (edition 2021 closures capture
        // fields), or the closure is not Send.
        #[allow(clippy::redundant_locals)]
        let yp = yp;
        for j in 0..site.n_slices {
            let (o0, o1) = (site.offsets[j], site.offsets[j + 1]);
            let (p0, p1) = part_range(o1 - o0, part, parts, 64);
            // SAFETY: output columns o0+p0..o0+p1 of this chunk's rows are this task's alone.
            unsafe {
                quiver_kernels::cpu::simd::lora_expand(yp.0.add(o0 + p0), site.out_dim, Some(&group.perm[lo..hi]), hi - lo, &shrink[lo * ld + j * r..], ld, &bt[o0 + p0..], site.out_dim, r, p1 - p0, site.scaling(w, j));
            }
        }
    });
}
