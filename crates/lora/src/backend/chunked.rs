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

/// Adapter rows from which the chunks run on several threads.
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
        // Pieces: each chunk cut into runs of at most `piece` rows.
        let piece = if threads > 1 && total >= PARALLEL_MIN_ROWS { total.div_ceil(threads).max(1) } else { usize::MAX };
        let yp = SyncPtr(y.as_mut_ptr());
        let Scratch { shrink, gathered } = scratch;
        let (sp, gp) = (SyncPtr(shrink.as_mut_ptr()), SyncPtr(gathered.as_mut_ptr()));
        let run = |c: usize, lo: usize, hi: usize| {
            let w = group.chunk_slot[c] as usize;
            if site.ranks[w] == 0 {
                return;
            }
            let (yp, sp, gp) = (yp, sp, gp);
            let (o, n) = (lo, hi - lo);
            // SAFETY: scratch rows o..o+n belong to this piece (disjoint across pieces, sized to
            // all adapter rows above); y rows of this piece are its own (run_piece's contract).
            unsafe {
                let g = if matches!(input, LoraInput::Dense(_)) { std::slice::from_raw_parts_mut(gp.0.add(o * din), n * din) } else { &mut [][..] };
                let sh = std::slice::from_raw_parts_mut(sp.0.add(o * ld), n * ld);
                run_piece(site, group, input, w, lo, hi, yp.0, g, sh);
            }
        };
        if piece == usize::MAX {
            for c in 0..group.num_chunks() {
                run(c, group.chunk_start[c] as usize, group.chunk_end[c] as usize);
            }
            return;
        }
        let pieces_of = |c: usize| ((group.chunk_end[c] - group.chunk_start[c]) as usize).div_ceil(piece);
        let total_pieces: usize = (0..group.num_chunks()).map(pieces_of).sum();
        (0..total_pieces).into_par_iter().for_each(|mut i| {
            // Piece i → (chunk, row range), without a list (no allocation per call).
            let mut c = 0;
            while i >= pieces_of(c) {
                i -= pieces_of(c);
                c += 1;
            }
            let lo = group.chunk_start[c] as usize + i * piece;
            run(c, lo, (lo + piece).min(group.chunk_end[c] as usize));
        });
    }
}
