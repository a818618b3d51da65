//! Per-row loops with f64 accumulation: slow and obviously correct, the oracle every other
//! backend is tested against. It reads only `row_slot`, not the segments or the permutation,
//! so it also checks the grouping logic.

use super::{ensure, LoraBackend, LoraInput, Scratch};
use crate::batch::RowGrouping;
use crate::mem_pool::SiteView;

pub struct ReferenceBackend;

impl LoraBackend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn apply(&self, site: &SiteView<'_>, group: &RowGrouping, input: LoraInput<'_>, y: &mut [f32], scratch: &mut Scratch) {
        let (din, dout, rmax) = (site.in_dim, site.out_dim, site.max_rank);
        ensure(&mut scratch.shrink, site.n_slices * rmax);
        let t = &mut scratch.shrink;
        for (row, &w) in group.row_slot.iter().enumerate() {
            if w < 0 {
                continue;
            }
            let w = w as usize;
            let r = site.ranks[w] as usize;
            if r == 0 {
                continue;
            }
            let a = site.a_slot(w);
            let b = site.b_slot(w);
            for j in 0..site.n_slices {
                // Slice j's A rows are [j·r, (j+1)·r).
                for k in 0..r {
                    let arow = &a[(j * r + k) * din..(j * r + k + 1) * din];
                    t[k] = match input {
                        LoraInput::Dense(x) => {
                            let xr = &x[row * din..(row + 1) * din];
                            xr.iter().zip(arow).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>() as f32
                        }
                        LoraInput::TokenIds(ids) => {
                            let id = ids[row] as usize;
                            if id < din { arow[id] } else { 0.0 }
                        }
                    };
                }
                let s = site.scaling(w, j) as f64;
                for o in site.offsets[j]..site.offsets[j + 1] {
                    // Bᵀ layout: rank step k of column o at k·b_ld + o.
                    let d: f64 = (0..r).map(|k| b[k * site.b_ld + o] as f64 * t[k] as f64).sum();
                    y[row * dout + o] += (s * d) as f32;
                }
            }
        }
    }
}
