//! Multi-LoRA: PEFT adapters, the LoRA memory pool, batch metadata and pluggable backends.
//!
//! The model meets LoRA at exactly one seam, [`LoraHook`]: after each base linear (and after
//! the embedding gather and the LM head) it hands the hook the layer input and the base output,
//! and the hook adds every row's adapter delta in place. The model names no backend and no
//! device; rows without an adapter cost nothing.

use quiver_kernels::Tensor;

/// A linear site of a Llama-family layer. q/k/v and gate/up are fused in the base model, so
/// their LoRA deltas are fused multi-slice expands (3 and 2 slices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearSite {
    /// Output `[q | k | v]`, widths `[q_out, kv_out, kv_out]`.
    Qkv,
    /// Attention output projection.
    O,
    /// Output `[gate | up]`, widths `[inter, inter]`.
    GateUp,
    /// MLP down projection.
    Down,
}

/// Dimensions of the base model that the LoRA pool and kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraModelDims {
    pub num_layers: usize,
    pub hidden: usize,
    /// `n_heads · head_dim`
    pub q_out: usize,
    /// `n_kv_heads · head_dim`
    pub kv_out: usize,
    pub intermediate: usize,
    pub vocab: usize,
}

/// The seam between the forward pass and LoRA. `m` rows of the batch are processed; which
/// adapter each row uses is the implementor's business (it was prepared for this batch).
pub trait LoraHook: Sync {
    /// `y[r, :] += Δ_site(x[r, :])` for every row `r < m` whose adapter targets this site.
    /// `x` is the linear's input `[m, in]`, `y` its fused base output `[m, out]`.
    fn linear(&self, layer: usize, site: LinearSite, x: &Tensor, m: usize, y: &mut Tensor);
    /// `out[r, :] += Δ_embed(ids[r])` for rows whose adapter has `embed_tokens` LoRA.
    fn embedding(&self, ids: &[u32], out: &mut Tensor);
    /// LM head on pruned rows: `x` is `[rows.len(), hidden]` (final-normed hidden states of the
    /// token rows listed in `rows`), `logits` is `[rows.len(), vocab]`.
    fn lm_head(&self, x: &Tensor, rows: &[u32], logits: &mut Tensor);
    /// False when no row of this batch has an adapter, so the model may skip every call.
    fn is_active(&self) -> bool;
}

/// The hook for a batch with no adapters at all.
pub struct NoLora;

impl LoraHook for NoLora {
    fn linear(&self, _: usize, _: LinearSite, _: &Tensor, _: usize, _: &mut Tensor) {}
    fn embedding(&self, _: &[u32], _: &mut Tensor) {}
    fn lm_head(&self, _: &Tensor, _: &[u32], _: &mut Tensor) {}
    fn is_active(&self) -> bool {
        false
    }
}
