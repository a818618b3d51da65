//! `Device::lora_apply` on CPU: the shrink and expand tiles of `lora_tiles` over the groups a
//! backend chose, spread over the rayon pool.
//!
//! - **Segments** (contiguous rows of one slot, prefill): the rows are cut into fixed blocks run
//!   in parallel; each block shrinks and expands the pieces of the segments that cross it, so
//!   blocks write disjoint rows.
//! - **Chunks** of the slot-sorted permutation (decode): with at least as many chunks as
//!   threads, the permuted rows are cut into one block per thread (shrink then expand of the
//!   chunks inside it, one fork-join); with fewer, every chunk is split by *columns* (shrink
//!   columns, join, expand columns), so each thread reads only its share of the adapters' A and
//!   Bᵀ, which at decode sizes are the cost.
//!
//! Every element is computed the same way whatever rows, columns or threads share its call (the
//! tiles' property), so a row's delta does not depend on its batch, on the grouping a backend
//! picked, or on the thread split: the LoRA crate's `tests/backends.rs` checks bit equality.
//! Shrink outputs go to a thread-local buffer that only grows.

use super::lora_tiles::{lora_expand, lora_shrink};
use crate::lora::{GroupRows, LoraCall, LoraGroups, LoraSiteShape, LoraX};
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// Shrink output of one call, `[adapter rows, n·R]`.
    static SHRINK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Adapter rows from which the work runs on several threads (a decode step of 16 rows already
/// pays: the adapters' weights are read once per step either way, and two threads read them
/// twice as fast).
const PARALLEL_MIN_ROWS: usize = 8;
/// Largest rows per parallel block of the segments path.
const BLOCK_ROWS: usize = 64;

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// The host view of one call.
#[derive(Clone, Copy)]
struct Site<'a> {
    shape: &'a LoraSiteShape,
    call: &'a LoraCall<'a>,
}

impl Site<'_> {
    fn ld(&self) -> usize {
        self.shape.shrink_width()
    }
    fn rank(&self, w: usize) -> usize {
        self.call.rank(w)
    }
}

/// The input rows a shrink reads.
#[derive(Clone, Copy)]
enum Rows<'a> {
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

#[derive(Clone, Copy)]
enum Input<'a> {
    Dense(&'a [f32]),
    TokenIds(&'a [u32]),
}

/// Part `part` of `parts` of `[0, len)`, cut at multiples of `align` (the last part takes the
/// rest): how the threads split a chunk's columns without splitting a vector block.
fn part_range(len: usize, (part, parts): (usize, usize), align: usize) -> (usize, usize) {
    let cut = |p: usize| if p == parts { len } else { (len * p / parts) / align * align };
    (cut(part), cut(part + 1))
}

/// Shrink columns `c0..c1` (of the `n·r` of slot `w`) of `rows` into `shrink` rows `0..`
/// (stride `n·R`).
fn shrink_rows(site: Site<'_>, w: usize, input: Input<'_>, rows: Rows<'_>, (c0, c1): (usize, usize), shrink: &mut [f32]) {
    let (din, ld) = (site.shape.in_dim, site.ld());
    let a = site.call.buffers.a_slot(w);
    let n = rows.len();
    match input {
        Input::Dense(x) => match rows {
            Rows::Range(lo, _) => lora_shrink(&mut shrink[c0..], ld, &x[lo * din..], din, None, n, &a[c0 * din..], c1 - c0, din),
            Rows::Listed(p) => lora_shrink(&mut shrink[c0..], ld, x, din, Some(p), n, &a[c0 * din..], c1 - c0, din),
        },
        Input::TokenIds(ids) => {
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
/// `idx[i]`, or `i` without `idx`), every slice with its own scaling. `part` of `parts`
/// restricts it to that share of every slice's output columns; `(0, 1)` is all.
///
/// # Safety
/// The addressed `y` rows (the part's columns) are valid for writes and nobody else touches them
/// during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn expand_rows(site: Site<'_>, w: usize, shrink: &[f32], rows: usize, y: *mut f32, ldy: usize, idx: Option<&[u32]>, part: (usize, usize)) {
    let (ld, r) = (site.ld(), site.rank(w));
    let bt = site.call.buffers.b_slot(w);
    let s = site.shape;
    for j in 0..s.n_slices {
        let o0 = s.offsets[j];
        let (p0, p1) = part_range(s.offsets[j + 1] - o0, part, 64);
        // SAFETY: columns o0+p0..o0+p1 ≤ out_dim of the caller's rows.
        unsafe { lora_expand(y.add(o0 + p0), ldy, idx, rows, &shrink[j * r..], ld, &bt[o0 + p0..], s.b_ld, r, p1 - p0, site.call.scaling(w, j)) };
    }
}

/// Runs `f` with a grow-only shrink buffer of at least `len` floats: this thread's, or a fresh
/// one when this thread is already inside a LoRA call (a worker waiting in a parallel loop may
/// run another forward's step).
fn with_shrink<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SHRINK.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// The CPU device's `lora_apply`.
pub(crate) fn apply(call: &LoraCall<'_>, x: LoraX<'_>, y: &mut [f32]) {
    let g = &call.groups;
    if g.adapter_rows == 0 {
        return;
    }
    let site = Site { shape: &call.buffers.shape, call };
    let input = match x {
        LoraX::Dense(t) => Input::Dense(t.as_cpu()),
        LoraX::TokenIds(ids) => Input::TokenIds(ids),
    };
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && g.adapter_rows >= PARALLEL_MIN_ROWS;
    match g.group_rows {
        GroupRows::Contiguous => apply_segments(site, g, input, y, parallel.then_some(threads)),
        GroupRows::Permuted(perm) => {
            let parts = if parallel { threads } else { 1 };
            with_shrink(g.adapter_rows * site.ld(), |sh| {
                if parts > 1 && g.num_groups() >= parts {
                    apply_row_blocks(site, g, perm, input, y, sh, parts);
                } else {
                    apply_parts(site, g, perm, input, y, sh, parts);
                }
            })
        }
    }
}

/// Segments: fixed row blocks, in parallel from `PARALLEL_MIN_ROWS` adapter rows; blocks split
/// segments at row boundaries only.
fn apply_segments(site: Site<'_>, g: &LoraGroups<'_>, input: Input<'_>, y: &mut [f32], threads: Option<usize>) {
    let (m, ld, out) = (g.rows, site.ld(), site.shape.out_dim());
    match threads {
        Some(threads) => with_shrink(m * ld, |sh| {
            let block = m.div_ceil(threads).clamp(4, BLOCK_ROWS);
            y[..m * out].par_chunks_mut(block * out).zip(sh.par_chunks_mut(block * ld)).enumerate().for_each(|(b, (yb, sb))| {
                let lo = b * block;
                segment_block(site, g, input, lo, (lo + block).min(m), yb, sb);
            });
        }),
        // Sequential: one scratch block sized for the longest segment.
        None => with_shrink(g.max_len() * ld, |sh| {
            for s in 0..g.num_groups() {
                let (s0, s1) = (g.start[s] as usize, g.end[s] as usize);
                let w = g.slot[s] as usize;
                let r = site.rank(w);
                if r == 0 {
                    continue;
                }
                shrink_rows(site, w, input, Rows::Range(s0, s1), (0, site.shape.n_slices * r), sh);
                let ys = &mut y[s0 * out..s1 * out];
                // SAFETY: the segment's rows, borrowed mutably above.
                unsafe { expand_rows(site, w, sh, s1 - s0, ys.as_mut_ptr(), out, None, (0, 1)) };
            }
        }),
    }
}

/// The pieces of every segment inside rows `lo..hi` (`y` and `shrink` start at row `lo`).
fn segment_block(site: Site<'_>, g: &LoraGroups<'_>, input: Input<'_>, lo: usize, hi: usize, y: &mut [f32], shrink: &mut [f32]) {
    let (ld, out) = (site.ld(), site.shape.out_dim());
    // First segment that ends after `lo`.
    let first = g.end.partition_point(|&e| (e as usize) <= lo);
    for s in first..g.num_groups() {
        let (s0, s1) = (g.start[s] as usize, g.end[s] as usize);
        if s0 >= hi {
            break;
        }
        let w = g.slot[s] as usize;
        let r = site.rank(w);
        if r == 0 {
            continue;
        }
        let (p0, p1) = (s0.max(lo), s1.min(hi));
        let sh = &mut shrink[(p0 - lo) * ld..];
        shrink_rows(site, w, input, Rows::Range(p0, p1), (0, site.shape.n_slices * r), sh);
        let yb = &mut y[(p0 - lo) * out..(p1 - lo) * out];
        // SAFETY: rows p0..p1 of this block, borrowed mutably above.
        unsafe { expand_rows(site, w, sh, p1 - p0, yb.as_mut_ptr(), out, None, (0, 1)) };
    }
}

/// Chunks, at least as many as threads: the permuted rows cut into `parts` equal blocks, each
/// task running shrink then expand over the pieces of the chunks inside its block. One
/// fork-join per call instead of two, and each thread reads only the adapters of its own rows.
fn apply_row_blocks(site: Site<'_>, g: &LoraGroups<'_>, perm: &[u32], input: Input<'_>, y: &mut [f32], shrink: &mut [f32], parts: usize) {
    let (out, ld) = (site.shape.out_dim(), site.ld());
    let total = g.adapter_rows;
    let (sp, yp) = (SyncPtr(shrink.as_mut_ptr()), SyncPtr(y.as_mut_ptr()));
    let block = total.div_ceil(parts);
    (0..parts).into_par_iter().for_each(|b| {
        let (sp, yp) = (sp, yp);
        let (lo, hi) = (b * block, ((b + 1) * block).min(total));
        // First chunk that ends after `lo`.
        let first = g.end.partition_point(|&e| (e as usize) <= lo);
        for c in first..g.num_groups() {
            let (c0, c1) = (g.start[c] as usize, g.end[c] as usize);
            if c0 >= hi {
                break;
            }
            let w = g.slot[c] as usize;
            let r = site.rank(w);
            if r == 0 {
                continue;
            }
            let (p0, p1) = (c0.max(lo), c1.min(hi));
            let rows = &perm[p0..p1];
            // SAFETY: permutation positions p0..p1 lie in this task's block: their shrink rows,
            // and the y rows they list (perm is a permutation), are its alone.
            let sh = unsafe { std::slice::from_raw_parts_mut(sp.0.add(p0 * ld), (p1 - p0) * ld) };
            shrink_rows(site, w, input, Rows::Listed(rows), (0, site.shape.n_slices * r), sh);
            unsafe { expand_rows(site, w, sh, p1 - p0, yp.0, out, Some(rows), (0, 1)) };
        }
    });
}

/// Every chunk's work split by *columns* into `parts` tasks: first the shrink (columns of
/// `x·Aᵀ`), then, after a join, the expand (output columns). With one part it is a plain loop
/// over the chunks.
#[allow(clippy::too_many_arguments)]
fn apply_parts(site: Site<'_>, g: &LoraGroups<'_>, perm: &[u32], input: Input<'_>, y: &mut [f32], shrink: &mut [f32], parts: usize) {
    let (out, ld) = (site.shape.out_dim(), site.ld());
    let (sp, yp) = (SyncPtr(shrink.as_mut_ptr()), SyncPtr(y.as_mut_ptr()));
    // Task t: part t % parts of chunk t / parts; None when the chunk's slot has rank 0 here.
    let task = |t: usize| {
        let (c, part) = (t / parts, t % parts);
        let w = g.slot[c] as usize;
        let (lo, hi) = (g.start[c] as usize, g.end[c] as usize);
        (site.rank(w) > 0).then_some((part, w, lo, hi))
    };
    let shrink_task = |t: usize| {
        let Some((part, w, lo, hi)) = task(t) else { return };
        let cols = part_range(site.shape.n_slices * site.rank(w), (part, parts), 1);
        #[allow(clippy::redundant_locals)]
        let sp = sp;
        // SAFETY: shrink rows lo..hi, columns `cols`, are this task's alone (chunks own disjoint
        // rows, parts disjoint columns, and shrink_rows writes only `cols`).
        let sh = unsafe { std::slice::from_raw_parts_mut(sp.0.add(lo * ld), (hi - lo) * ld) };
        shrink_rows(site, w, input, Rows::Listed(&perm[lo..hi]), cols, sh);
    };
    let expand_task = |t: usize| {
        let Some((part, w, lo, hi)) = task(t) else { return };
        // The whole SyncPtr, not its raw field, must be captured (edition 2021 closures capture
        // fields), or the closure is not Send.
        #[allow(clippy::redundant_locals)]
        let (sp, yp) = (sp, yp);
        // SAFETY: the shrink is complete (joined); this chunk's rows (listed in perm[lo..hi],
        // inside y) in this part's output columns are this task's alone.
        let sh = unsafe { std::slice::from_raw_parts(sp.0.add(lo * ld), (hi - lo) * ld) };
        unsafe { expand_rows(site, w, sh, hi - lo, yp.0, out, Some(&perm[lo..hi]), (part, parts)) };
    };
    let tasks = g.num_groups() * parts;
    if parts == 1 {
        (0..tasks).for_each(shrink_task);
        (0..tasks).for_each(expand_task);
    } else {
        (0..tasks).into_par_iter().for_each(shrink_task);
        (0..tasks).into_par_iter().for_each(expand_task);
    }
}
