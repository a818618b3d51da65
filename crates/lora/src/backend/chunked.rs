//! Chunked SGMV on CPU: adapter rows sorted by slot through the stable permutation, split into
//! chunks of one slot; per chunk the input rows are gathered, shrunk and expanded with GEMMs,
//! then scatter-added back to their rows. Rows never move in `y`. Best for decode, where
//! adjacent rows have different adapters and segments are one row long.

use super::{ensure, expand_rows, gemm_nt, LoraBackend, LoraInput, Scratch};
use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

pub struct ChunkedBackend;

impl LoraBackend for ChunkedBackend {
    fn name(&self) -> &'static str {
        "chunked"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        if group.adapter_rows == 0 {
            return;
        }
        let (din, out) = (site.in_dim, site.out_dim);
        let ld = site.n_slices * site.max_rank;
        let maxc = (0..group.num_chunks()).map(|c| (group.chunk_end[c] - group.chunk_start[c]) as usize).max().unwrap_or(0);
        ensure(&mut scratch.shrink, maxc * ld);
        ensure(&mut scratch.expanded, maxc * out);
        if matches!(input, LoraInput::Dense(_)) {
            ensure(&mut scratch.gathered, maxc * din);
        }
        for c in 0..group.num_chunks() {
            let w = group.chunk_slot[c] as usize;
            let r = site.ranks[w] as usize;
            if r == 0 {
                continue;
            }
            let rows = &group.perm[group.chunk_start[c] as usize..group.chunk_end[c] as usize];
            let n = rows.len();
            let cr = site.n_slices * r;
            let a = site.a_slot(w);
            match input {
                LoraInput::Dense(x) => {
                    for (i, &p) in rows.iter().enumerate() {
                        let p = p as usize;
                        scratch.gathered[i * din..(i + 1) * din].copy_from_slice(&x[p * din..(p + 1) * din]);
                    }
                    gemm_nt(&mut scratch.shrink, ld, &scratch.gathered, din, a, din, n, cr, din, 1.0, false);
                }
                LoraInput::TokenIds(ids) => {
                    for (i, &p) in rows.iter().enumerate() {
                        let id = ids[p as usize] as usize;
                        for k in 0..cr {
                            scratch.shrink[i * ld + k] = if id < din { a[k * din + id] } else { 0.0 };
                        }
                    }
                }
            }
            expand_rows(site, w, r, &scratch.shrink, n, &mut scratch.expanded, out, false);
            for (i, &p) in rows.iter().enumerate() {
                let p = p as usize;
                for (d, s) in y[p * out..(p + 1) * out].iter_mut().zip(&scratch.expanded[i * out..(i + 1) * out]) {
                    *d += *s;
                }
            }
        }
    }
}
