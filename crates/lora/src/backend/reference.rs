//! Per-row loops with f64 accumulation on host memory: slow and obviously correct, the oracle
//! every other backend is tested against. It reads only `row_slot`, not the segments or the
//! permutation, so it also checks the grouping logic. CPU only (it reads the pool and the
//! activations in host memory).

use super::{LoraBackend, SiteRef};
use crate::batch::RowGrouping;
use quiver_kernels::lora::MAX_SLICES;
use quiver_kernels::{Device, LoraX, Tensor};

pub struct ReferenceBackend;

thread_local! {
    /// One row's shrink of one slice, `R` floats, reused across calls.
    static SHRINK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl LoraBackend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn apply(&self, _dev: &dyn Device, site: SiteRef<'_>, rows: &RowGrouping, x: LoraX<'_>, y: &mut Tensor) {
        let sh = site.buffers.shape;
        let (din, dout) = (sh.in_dim, sh.out_dim());
        let ranks = site.table.ranks_at(site.entry);
        let scalings = site.table.scalings_at(site.entry);
        let y = y.as_cpu_mut();
        let mut held = SHRINK.with(|c| std::mem::take(&mut *c.borrow_mut()));
        held.resize(sh.max_rank.max(held.len()), 0.0);
        let t = &mut held[..sh.max_rank];
        for (row, &w) in rows.row_slot.iter().enumerate() {
            if w < 0 {
                continue;
            }
            let w = w as usize;
            let r = ranks[w] as usize;
            if r == 0 {
                continue;
            }
            let a = site.buffers.a_slot(w);
            let b = site.buffers.b_slot(w);
            for j in 0..sh.n_slices {
                // Slice j's A rows are [j·r, (j+1)·r).
                for (k, tk) in t.iter_mut().enumerate().take(r) {
                    let arow = &a[(j * r + k) * din..(j * r + k + 1) * din];
                    *tk = match x {
                        LoraX::Dense(x) => {
                            let xr = &x.as_cpu()[row * din..(row + 1) * din];
                            xr.iter().zip(arow).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>() as f32
                        }
                        LoraX::TokenIds(ids) => {
                            let id = ids[row] as usize;
                            if id < din { arow[id] } else { 0.0 }
                        }
                    };
                }
                let s = scalings[w * MAX_SLICES + j] as f64;
                for o in sh.offsets[j]..sh.offsets[j + 1] {
                    // Bᵀ layout: rank step k of column o at k·b_ld + o.
                    let d: f64 = (0..r).map(|k| b[k * sh.b_ld + o] as f64 * t[k] as f64).sum();
                    y[row * dout + o] += (s * d) as f32;
                }
            }
        }
        SHRINK.with(|c| *c.borrow_mut() = held);
    }
}
