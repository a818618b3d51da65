//! Multi-LoRA: PEFT adapters, the LoRA memory pool, batch metadata and pluggable backends.
//!
//! The model meets LoRA at exactly one seam, [`LoraHook`]: after each base linear (and after
//! the embedding gather and the LM head) it hands the hook the layer input and the base output,
//! and the hook adds every row's adapter delta in place. The model names no backend and no
//! device; rows without an adapter cost nothing.
//!
//! # Pieces (one concept per file)
//! - [`config`]: PEFT `adapter_config.json` semantics (rsLoRA, rank/alpha patterns, target and
//!   exclude matching, `layers_to_transform`) and every refusal.
//! - [`adapter`]: one adapter's weights in host memory, validated against the model dims.
//! - [`adapter_files`]: bounded, sandboxed reads of an adapter directory's files.
//! - `adapter_moe`: expert and shared-expert modules, PEFT's `target_parameters` on fused experts.
//! - [`mem_pool`]: the preallocated slot buffers the kernels read.
//! - [`eviction_policy`]: LRU / FIFO victim choice over slots.
//! - [`registry`]: names, versions, in-flight counts and the host-memory cache.
//! - [`batch`]: per-step metadata in fixed, reused buffers.
//! - [`backend`]: kernels (`reference`, `segmented`, `chunked`, `auto`) behind a registry.
//! - [`shard`]: a tensor-parallel rank's share, and how adapters are cut to it (S-LoRA).
//! - [`manager`]: [`LoraManager`], the object the engine owns, and [`BatchHook`], what the model
//!   consumes.
//!
//! # Memory layout (shared by pool, kernels and reference)
//! Packed, rank-exact per site. For slot `w`, layer `l`, site with `n` slices (qkv 3, gate_up 2,
//! others 1), the pool stores a *site rank* `r = ranks[w][l][site]` (the largest rank of the
//! slices present; 0 when the adapter lacks the whole site). Slice `j`'s `lora_A` occupies A rows
//! `[j·r, j·r + r_j)` of `A[w]` (`(n·R, in)`), its `lora_B`, transposed, occupies rows `[0, r_j)`
//! and columns `off_j..off_{j+1}` of `Bᵀ[w]` (`(R, b_ld)`, rows padded past `out` to an odd
//! number of cache lines; see `mem_pool`).
//!
//! **Invariant:** every other element of a slot (A rows and Bᵀ rows beyond a slice's rank,
//! slices and sites the adapter lacks, the whole tail up to `R`) is zero, because loading a slot
//! first zeroes it. Kernels contract over exactly `r` (never the padded `R`), so mixed ranks
//! cost nothing extra; the zeroed tail makes a kernel that did contract over `R` still correct
//! (no stale rank-64 tail under a rank-8 adapter, no evicted adapter leaking into a module the
//! new one lacks). Scaling is kept per slice in f32 and applied inside the expand, never folded
//! into B. Rows with no adapter are in no slot and no segment.

pub mod adapter;
pub mod adapter_files;
mod adapter_moe;
pub mod backend;
pub mod batch;
pub mod config;
pub mod error;
pub mod eviction_policy;
pub mod manager;
pub mod mem_pool;
pub mod registry;
pub mod shard;

pub use adapter::{LoraAdapter, ReadLimits};
pub use backend::{backend_names, validate_backend, LoraBackend, SiteRef};
pub use batch::LoraBatchInfo;
pub use config::{AdapterConfig, LoraModule};
pub use error::LoraError;
pub use eviction_policy::EvictionPolicy;
pub use manager::{BatchHook, LoraConfig, LoraManager};
pub use mem_pool::{LoraImageMaker, LoraMemoryPool};
pub use registry::{AdapterId, AdapterKey, AdapterInfo};
pub use shard::{SiteCut, TpShard};
pub use mem_pool::MAX_EXPERT_POOL_BYTES;

use quiver_kernels::{Device, Epilogue, MoeRouting, Tensor, Weight};

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

impl LinearSite {
    pub const ALL: [LinearSite; 4] = [LinearSite::Qkv, LinearSite::O, LinearSite::GateUp, LinearSite::Down];
    pub fn index(self) -> usize {
        self as usize
    }
    /// The PEFT projections fused into this site, in output order.
    pub fn modules(self) -> &'static [LoraModule] {
        use LoraModule::*;
        match self {
            LinearSite::Qkv => &[QProj, KProj, VProj],
            LinearSite::O => &[OProj],
            LinearSite::GateUp => &[GateProj, UpProj],
            LinearSite::Down => &[DownProj],
        }
    }
}

impl LoraModelDims {
    /// `(in, out)` of a projection or of the embedding / LM head (`in` = vocab for the
    /// embedding, whose lora_A is `(r, vocab)`).
    pub fn module_dims(&self, m: LoraModule) -> (usize, usize) {
        use LoraModule::*;
        match m {
            QProj => (self.hidden, self.q_out),
            KProj | VProj => (self.hidden, self.kv_out),
            OProj => (self.q_out, self.hidden),
            GateProj | UpProj => (self.hidden, self.intermediate),
            DownProj => (self.intermediate, self.hidden),
            EmbedTokens => (self.vocab, self.hidden),
            LmHead => (self.hidden, self.vocab),
            ExpertGateProj | ExpertUpProj => (self.hidden, self.moe_dims().expert_intermediate),
            ExpertDownProj => (self.moe_dims().expert_intermediate, self.hidden),
            SharedGateProj | SharedUpProj => (self.hidden, self.moe_dims().shared_intermediate),
            SharedDownProj => (self.moe_dims().shared_intermediate, self.hidden),
        }
    }
    fn moe_dims(&self) -> MoeLoraDims {
        self.moe.unwrap_or_default()
    }
    /// Whether layer `l`'s MLP is experts.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.moe.is_some_and(|m| l >= 128 || m.moe_layers >> l & 1 == 1)
    }
    /// Input width and fused slice widths of an expert site (one expert's), or of the shared
    /// expert's (`shared`).
    pub fn expert_site_dims(&self, site: ExpertSite, shared: bool) -> (usize, [usize; 3], usize) {
        let m = self.moe_dims();
        let i = if shared { m.shared_intermediate } else { m.expert_intermediate };
        match site {
            ExpertSite::GateUp => (self.hidden, [i, i, 0], 2),
            ExpertSite::Down => (i, [self.hidden, 0, 0], 1),
        }
    }
    /// Input width and fused slice widths of a site.
    pub fn site_dims(&self, site: LinearSite) -> (usize, [usize; 3], usize) {
        match site {
            LinearSite::Qkv => (self.hidden, [self.q_out, self.kv_out, self.kv_out], 3),
            LinearSite::O => (self.q_out, [self.hidden, 0, 0], 1),
            LinearSite::GateUp => (self.hidden, [self.intermediate, self.intermediate, 0], 2),
            LinearSite::Down => (self.intermediate, [self.hidden, 0, 0], 1),
        }
    }
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
    /// Set for a mixture-of-experts model.
    pub moe: Option<MoeLoraDims>,
}

/// What LoRA needs to know of a model's experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeLoraDims {
    pub num_experts: usize,
    pub expert_intermediate: usize,
    /// Qwen2-MoE's shared expert; 0 without one.
    pub shared_intermediate: usize,
    /// Mixtral's module names (`block_sparse_moe.experts.{e}.w1|w3|w2`) instead of
    /// `mlp.experts.{e}.gate_proj|up_proj|down_proj`.
    pub mixtral_names: bool,
    /// Bit `l` set when layer `l`'s MLP is experts (Qwen's `mlp_only_layers` are not); layers
    /// from 128 on count as experts (no MoE model has dense layers that deep).
    pub moe_layers: u128,
}

/// The LoRA sites of an expert (and of Qwen2-MoE's shared expert): its fused `[gate | up]`
/// and its down projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertSite {
    GateUp,
    Down,
}

impl ExpertSite {
    pub const ALL: [ExpertSite; 2] = [ExpertSite::GateUp, ExpertSite::Down];
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn expert_modules(self) -> &'static [LoraModule] {
        match self {
            ExpertSite::GateUp => &[LoraModule::ExpertGateProj, LoraModule::ExpertUpProj],
            ExpertSite::Down => &[LoraModule::ExpertDownProj],
        }
    }
    pub fn shared_modules(self) -> &'static [LoraModule] {
        match self {
            ExpertSite::GateUp => &[LoraModule::SharedGateProj, LoraModule::SharedUpProj],
            ExpertSite::Down => &[LoraModule::SharedDownProj],
        }
    }
}

/// The seam between the forward pass and LoRA. `m` rows of the batch are processed; which
/// adapter each row uses is the implementor's business (it was prepared for this batch).
///
/// `dev` is the device holding the tensors; the hook has it run its LoRA kernel
/// (`Device::lora_apply`) on them where they live.
pub trait LoraHook: Sync {
    /// `y[r, :] += Δ_site(x[r, :])` for every row `r < m` whose adapter targets this site.
    /// `x` is the linear's input `[m, in]`, `y` its fused base output `[m, out]`.
    fn linear(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &Tensor, m: usize, y: &mut Tensor);
    /// The whole projection of `site`: `y = x·Wᵀ (+ bias)`, the delta of [`Self::linear`], then
    /// `epilogue` — the model's one call per projection, so the device may fold the delta into
    /// the projection (`Device::matmul_lora`). The default makes the three calls in turn.
    #[allow(clippy::too_many_arguments)]
    fn project(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        dev.matmul(x, m, w, bias, y);
        self.linear(dev, layer, site, x, m, y);
        epilogue.run(dev, y, m, w);
    }
    /// The RMSNorm whose output `out` is `site`'s input, made right before [`Self::project`] of
    /// the same site: `Device::rms_norm` of `x`, or with `delta` `Device::add_rms_norm`
    /// (`x += delta` first). With adapters in the batch the device gets the site's LoRA call
    /// too ([`Device::rms_norm_before_lora`]), so it may start the delta in the norm's pass.
    #[allow(clippy::too_many_arguments)]
    fn norm(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, m: usize, dim: usize, out: &mut Tensor) {
        let _ = (layer, site);
        plain_norm(dev, x, delta, w, eps, m, dim, out)
    }
    /// `out[r, :] += Δ_embed(ids[r])` for rows whose adapter has `embed_tokens` LoRA.
    fn embedding(&self, dev: &dyn Device, ids: &[u32], out: &mut Tensor);
    /// LM head on pruned rows: `x` is `[rows.len(), hidden]` (final-normed hidden states of the
    /// token rows listed in `rows`), `logits` is `[rows.len(), vocab]`.
    fn lm_head(&self, dev: &dyn Device, x: &Tensor, rows: &[u32], logits: &mut Tensor);
    /// An MoE layer's experts: `x` and `y` are the `m·k` grouped rows of `route` (`[m·k, in]`
    /// input and `[m·k, out]` base output of the experts' GEMM); position `p` gets the delta of
    /// its expert in its source row's adapter, before the router-weighted combine.
    fn experts(&self, _dev: &dyn Device, _layer: usize, _site: ExpertSite, _route: &MoeRouting, _x: &Tensor, _y: &mut Tensor) {}
    /// Qwen2-MoE's shared expert, like [`Self::linear`] over the `m` token rows.
    fn shared_expert(&self, _dev: &dyn Device, _layer: usize, _site: ExpertSite, _x: &Tensor, _m: usize, _y: &mut Tensor) {}
    /// False when no row of this batch has an adapter, so the model may skip every call.
    fn is_active(&self) -> bool;
    /// Calls `f` with the hook of tensor-parallel rank `rank` ≥ 1 for the same batch (the hook
    /// itself is rank 0's): the rows and slots are the same, the pool is the rank's cut
    /// ([`shard`]). A hook without a sharded pool has no other ranks (the default refuses:
    /// its rank 0 would read whole adapters against a shard).
    fn with_rank(&self, rank: usize, _f: &mut dyn FnMut(&dyn LoraHook)) {
        panic!("LoRA hook of tensor-parallel rank {rank}, but its pool is not sharded (LoraManager::shard_pool)")
    }
    /// Host metadata to stage with the batch (`Device::stage_batch`'s `extra`): the row
    /// groupings packed for a device that reads its own copy; empty slices otherwise.
    fn staged(&self) -> [&[u32]; 4] {
        [&[]; 4]
    }
    /// Mixed into the step's shape key: nonzero when the step runs LoRA kernels, whose launches
    /// a recorded step must contain.
    fn shape_key(&self) -> u64 {
        0
    }
}

/// `Device::rms_norm` of `x`, or `Device::add_rms_norm` with `delta`: [`LoraHook::norm`]
/// without a LoRA call.
#[allow(clippy::too_many_arguments)]
pub fn plain_norm(dev: &dyn Device, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, m: usize, dim: usize, out: &mut Tensor) {
    match delta {
        Some(d) => dev.add_rms_norm(x, d, w, eps, m, dim, out),
        None => dev.rms_norm(x, w, eps, m, dim, out),
    }
}

/// The hook for a batch with no adapters at all.
pub struct NoLora;

impl LoraHook for NoLora {
    fn linear(&self, _: &dyn Device, _: usize, _: LinearSite, _: &Tensor, _: usize, _: &mut Tensor) {}
    fn project(&self, dev: &dyn Device, _: usize, _: LinearSite, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        dev.matmul_lora(x, m, w, bias, None, epilogue, y)
    }
    fn embedding(&self, _: &dyn Device, _: &[u32], _: &mut Tensor) {}
    fn lm_head(&self, _: &dyn Device, _: &Tensor, _: &[u32], _: &mut Tensor) {}
    fn is_active(&self) -> bool {
        false
    }
    fn with_rank(&self, _: usize, f: &mut dyn FnMut(&dyn LoraHook)) {
        f(self)
    }
}
