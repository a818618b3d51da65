//! A tensor-parallel rank's share of the model, and how an adapter is cut to it (S-LoRA).
//!
//! The model slices its weights by a [`TpShard`] at load and the LoRA pool slices each adapter
//! by the same one when it fills a slot, so a rank's delta lands exactly on the outputs (or
//! reads exactly the inputs) its base shard has:
//! - column sites (qkv, gate_up, LM head): A whole, the shrink runs on the full input; B keeps
//!   the rank's output rows of each slice (q ⊕ k ⊕ v, gate ⊕ up), the base weight's layout;
//! - row sites (o, down): A keeps the rank's input columns, B whole; each rank's partial
//!   delta joins the base's partial output before the all-reduce that sums them;
//! - the embedding: whole, on rank 0 only (its delta is added once, before the all-reduce).

use crate::{LinearSite, LoraModelDims};
use quiver_kernels::lora::MAX_SLICES;
use std::ops::Range;

/// Which part of each sharded dimension rank `rank` of `ranks` holds: ranges of rows (or
/// columns) of the *full* model's dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub ranks: usize,
    /// Rows of the full q projection: this rank's q heads.
    pub q: Range<usize>,
    /// Rows of the full k (and v) projection: this rank's kv heads (shared with other ranks
    /// when the model has fewer kv heads than ranks).
    pub kv: Range<usize>,
    /// Columns of the intermediate: rows of gate and of up, input columns of down.
    pub inter: Range<usize>,
    /// Rows of the embedding and of the LM head.
    pub vocab: Range<usize>,
}

/// How one pool site of a rank cuts an adapter's modules: the input columns of A it keeps and,
/// per slice, the first output row of B it keeps (the slice's width is the pool site's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SiteCut {
    pub a_col0: usize,
    pub b_row0: [usize; MAX_SLICES],
}

impl TpShard {
    /// The whole model as one rank.
    pub fn whole(dims: &LoraModelDims) -> TpShard {
        TpShard { rank: 0, ranks: 1, q: 0..dims.q_out, kv: 0..dims.kv_out, inter: 0..dims.intermediate, vocab: 0..dims.vocab }
    }

    /// The dimensions of this rank's shard of `full`: what its pool's buffers are sized by.
    pub fn local_dims(&self, full: &LoraModelDims) -> LoraModelDims {
        LoraModelDims { q_out: self.q.len(), kv_out: self.kv.len(), intermediate: self.inter.len(), vocab: self.vocab.len(), ..*full }
    }

    /// How a linear site's adapter weights are cut for this rank.
    pub fn site_cut(&self, site: LinearSite) -> SiteCut {
        let column = |b_row0: [usize; MAX_SLICES]| SiteCut { a_col0: 0, b_row0 };
        match site {
            LinearSite::Qkv => column([self.q.start, self.kv.start, self.kv.start]),
            LinearSite::GateUp => column([self.inter.start, self.inter.start, 0]),
            LinearSite::O => SiteCut { a_col0: self.q.start, b_row0: [0; 3] },
            LinearSite::Down => SiteCut { a_col0: self.inter.start, b_row0: [0; 3] },
        }
    }

    /// The LM head's cut: the rank's vocab rows of B.
    pub fn lm_head_cut(&self) -> SiteCut {
        SiteCut { a_col0: 0, b_row0: [self.vocab.start, 0, 0] }
    }
}
