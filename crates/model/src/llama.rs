//! The decoder forward pass of every family Quiver runs (Llama 2/3, SmolLM2, Qwen2, Mistral,
//! Qwen3, and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), batched over
//! sequences of different lengths: one call runs prefill chunks and decode rows together,
//! reading and writing the paged KV cache through per-sequence block tables.
//!
//! q/k/v and gate/up are fused into single weights at load, so a dense layer runs four GEMMs;
//! the LoRA hook sees the same four sites (qkv and gate_up as multi-slice expands). An MoE
//! layer's MLP is `moe::forward`.

use crate::batch::ForwardBatch;
use crate::config::ModelConfig;
use crate::moe::{self, Mlp, MoeWorkspace};
use crate::tp::TensorParallel;
use quiver_kernels::{AttnBatch, Device, Epilogue, KvLayout, KvStorage, QkNorm, RopeTable, Tensor, Weight};
use quiver_lora::{LinearSite, LoraHook, LoraMemoryPool, LoraModelDims, TpShard};
use std::sync::Arc;

pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// `[q_out + 2·kv_out, hidden]`
    pub qkv: Weight,
    pub qkv_bias: Option<Tensor>,
    /// RMSNorm of q and k before RoPE (Qwen3, OLMoE).
    pub qk_norm: Option<QkNorm>,
    pub o: Weight,
    /// o_proj's bias (Llama-family checkpoints with `attention_bias: true` have one; Qwen2's
    /// q/k/v biases come without). Under tensor parallelism only rank 0 holds it: o is
    /// row-parallel, so the all-reduce adds it once.
    pub o_bias: Option<Tensor>,
    pub mlp_norm: Tensor,
    pub mlp: Mlp,
}

pub struct LlamaModel {
    pub config: ModelConfig,
    pub device: Arc<dyn Device>,
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Weight>,
    pub rope: RopeTable,
    /// Set when the model is split over tensor-parallel ranks: the weights above are this
    /// rank's shard (`config` stays the whole model's), and rank 0 carries the group.
    pub tp: Option<Box<TensorParallel>>,
}

/// The paged KV cache of a model: its store, and under tensor parallelism the stores of ranks
/// 1.. (each holding only its rank's kv heads).
pub struct KvCache {
    pub storage: KvStorage,
    pub peers: Vec<KvStorage>,
}

/// The widths one rank computes with: the whole model's without tensor parallelism.
struct Widths {
    heads: usize,
    kv_heads: usize,
    q: usize,
    kv: usize,
    inter: usize,
    vocab: usize,
}

/// Activation buffers for up to `max_tokens` rows, reused across steps. They grow (never
/// shrink) when a larger batch arrives, so a steady-state step allocates nothing.
pub struct Workspace {
    max_tokens: usize,
    /// Rows of final-normed hidden states, and of logits, the buffers hold.
    max_out_rows: usize,
    max_logit_rows: usize,
    x: Tensor,
    xn: Tensor,
    qkv: Tensor,
    attn: Tensor,
    delta: Tensor,
    gate_up: Tensor,
    act: Tensor,
    last: Tensor,
    last_n: Tensor,
    logits: Tensor,
    /// Tensor parallelism: this rank's vocab columns of the logits, before the all-gather.
    logits_shard: Tensor,
    /// Tensor parallelism: the workspaces of ranks 1..
    pub(crate) peers: Vec<Workspace>,
    /// Buffers of the expert MLPs (MoE models only).
    moe: Option<MoeWorkspace>,
    /// Host copy of the logits of the requested rows, `[rows, vocab]`.
    pub host_logits: Vec<f32>,
    /// Host copy of the final-normed hidden states of the requested rows, `[rows, hidden]`
    /// ([`LlamaModel::forward_hidden`]).
    pub host_hidden: Vec<f32>,
    /// The step's token ids with the draws they name filled in, on a device that reads ids on
    /// the host (`Device::resolve_drawn`).
    resolved_ids: Vec<u32>,
}

/// What a forward pass returns for its `logits_rows`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Head {
    Logits,
    /// The final-normed hidden states (what embedding models pool).
    Hidden,
}

impl LlamaModel {
    pub fn lora_dims(&self) -> LoraModelDims {
        let c = &self.config;
        let moe = c.moe.as_ref().map(|m| quiver_lora::MoeLoraDims {
            num_experts: m.num_experts,
            expert_intermediate: m.expert_intermediate,
            shared_intermediate: m.shared_expert_intermediate.unwrap_or(0),
            mixtral_names: c.arch == crate::config::Arch::Mixtral,
            moe_layers: (0..c.num_layers.min(128)).filter(|&l| c.is_moe_layer(l)).fold(0u128, |b, l| b | 1 << l),
        });
        LoraModelDims { num_layers: c.num_layers, hidden: c.hidden_size, q_out: c.q_out(), kv_out: c.kv_out(), intermediate: c.intermediate_size, vocab: c.vocab_size, moe }
    }

    pub fn build_rope(config: &ModelConfig, device: &dyn Device) -> RopeTable {
        let inv = config.rope_inv_freq();
        let half = inv.len();
        let max_pos = config.max_position_embeddings.clamp(1, 1 << 17);
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &f in &inv {
                // transformers multiplies position and frequency in float32, then takes cos/sin.
                let a = (p as f32 * f) as f64;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeTable { head_dim: config.head_dim, rotary_dim: config.head_dim, max_pos, cos: device.tensor_from(&cos), sin: device.tensor_from(&sin) }
    }

    /// The widths of this rank's shard (the whole model's without tensor parallelism).
    fn widths(&self) -> Widths {
        let c = &self.config;
        match &self.tp {
            None => Widths { heads: c.num_heads, kv_heads: c.num_kv_heads, q: c.q_out(), kv: c.kv_out(), inter: c.intermediate_size, vocab: c.vocab_size },
            Some(t) => {
                let s = &t.shard;
                Widths { heads: s.q.len() / c.head_dim, kv_heads: s.kv.len() / c.head_dim, q: s.q.len(), kv: s.kv.len(), inter: s.inter.len(), vocab: s.vocab.len() }
            }
        }
    }

    /// Rank 0 and the other ranks of a tensor-parallel group, in rank order (just `self`
    /// without one).
    fn ranks(&self) -> impl Iterator<Item = &LlamaModel> {
        let peers = self.tp.as_ref().and_then(|t| t.group.as_ref()).map_or(&[][..], |g| &g.peers[..]);
        std::iter::once(self).chain(peers)
    }

    /// Every tensor-parallel rank's shard and device, in rank order (for the LoRA pool's
    /// shards); `None` without tensor parallelism.
    pub fn tp_ranks(&self) -> Option<Vec<(TpShard, Arc<dyn Device>)>> {
        self.tp.as_ref()?;
        Some(self.ranks().map(|m| (m.tp.as_ref().expect("every rank of a group has its shard").shard.clone(), m.device.clone())).collect())
    }

    /// Lets each LoRA site's base weight keep the site's B beside its rows where the device adds
    /// deltas that way (`Device::lora_attach_tail`; nothing elsewhere). At start-up, before any
    /// adapter is resident; not under tensor parallelism, whose ranks hold cuts of each adapter.
    pub fn attach_lora_tails(&mut self, pool: &LoraMemoryPool) {
        if self.tp.is_some() {
            return;
        }
        let dev = self.device.clone();
        let mut added = 0usize;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let mut attach = |site: LinearSite, w: &mut Weight| {
                if let Some((b, _)) = pool.site(l, site) {
                    let before = w.size_bytes();
                    dev.lora_attach_tail(w, b);
                    added += w.size_bytes().saturating_sub(before);
                }
            };
            attach(LinearSite::Qkv, &mut layer.qkv);
            attach(LinearSite::O, &mut layer.o);
            if let Mlp::Dense { gate_up, down } = &mut layer.mlp {
                attach(LinearSite::GateUp, gate_up);
                attach(LinearSite::Down, down);
            }
        }
        // Said at start-up: the tails' memory comes out of what the KV cache is sized from.
        if added > 0 {
            tracing::info!("LoRA tails beside the base weights: {:.0} MiB (long prompts' deltas inside the base GEMMs)", added as f64 / (1 << 20) as f64);
        }
    }

    /// Ranks in the tensor-parallel group (1 without one).
    pub fn tp_size(&self) -> usize {
        self.tp.as_ref().map_or(1, |t| t.shard.ranks)
    }

    fn kv_layout(&self, num_blocks: usize, block_size: usize) -> KvLayout {
        let c = &self.config;
        KvLayout { num_layers: c.num_layers, num_blocks, block_size, n_kv_heads: self.widths().kv_heads, head_dim: c.head_dim }
    }

    /// A paged KV cache for this model: on each rank's device, its kv heads.
    pub fn alloc_kv(&self, num_blocks: usize, block_size: usize) -> KvCache {
        let mut ranks = self.ranks().map(|m| m.device.alloc_kv(m.kv_layout(num_blocks, block_size)));
        let storage = ranks.next().expect("rank 0");
        KvCache { storage, peers: ranks.collect() }
    }

    /// Bytes of one KV block over every rank.
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        self.ranks().map(|m| m.kv_layout(1, block_size).bytes_per_block(m.device.kv_elem_bytes())).sum()
    }

    /// KV blocks that fit the devices' memory, `budget(free, total)` bytes on each: every
    /// rank's budget over its own block bytes, the fewest over the ranks (a device shared by
    /// several ranks reports its share). `None` on devices that do not report memory (the
    /// CPU, whose simulated ranks share the host's).
    pub fn kv_blocks_in_memory(&self, block_size: usize, budget: &dyn Fn(usize, usize) -> usize) -> Option<usize> {
        self.ranks()
            .map(|m| {
                let (free, total) = m.device.memory_info()?;
                Some(budget(free, total) / m.kv_layout(1, block_size).bytes_per_block(m.device.kv_elem_bytes()).max(1))
            })
            .min()
            .flatten()
    }

    pub fn new_workspace(&self, max_tokens: usize, max_logit_rows: usize) -> Workspace {
        self.workspace_for(max_tokens, max_logit_rows, Head::Logits)
    }

    /// A workspace for [`Self::forward_hidden`] only: no logits buffers (an embedding model's
    /// steps return hidden states of many rows, whose logits would be vocab-wide).
    pub fn new_hidden_workspace(&self, max_tokens: usize, max_rows: usize) -> Workspace {
        self.workspace_for(max_tokens, max_rows, Head::Hidden)
    }

    fn workspace_for(&self, max_tokens: usize, max_rows: usize, head: Head) -> Workspace {
        let mut ws = Workspace {
            max_tokens: 0,
            max_out_rows: 0,
            max_logit_rows: 0,
            x: self.device.alloc(0),
            xn: self.device.alloc(0),
            qkv: self.device.alloc(0),
            attn: self.device.alloc(0),
            delta: self.device.alloc(0),
            gate_up: self.device.alloc(0),
            act: self.device.alloc(0),
            last: self.device.alloc(0),
            last_n: self.device.alloc(0),
            logits: self.device.alloc(0),
            logits_shard: self.device.alloc(0),
            peers: Vec::new(),
            moe: None,
            host_logits: Vec::new(),
            host_hidden: Vec::new(),
            resolved_ids: Vec::new(),
        };
        self.ensure_workspace(&mut ws, max_tokens, max_rows, head);
        ws.peers = self.ranks().skip(1).map(|p| p.workspace_for(max_tokens, max_rows, head)).collect();
        ws
    }

    fn ensure_workspace(&self, ws: &mut Workspace, tokens: usize, out_rows: usize, head: Head) {
        let c = &self.config;
        let d = &self.device;
        let w = self.widths();
        if tokens > ws.max_tokens {
            let t = tokens.next_power_of_two().max(16);
            ws.x = d.alloc(t * c.hidden_size);
            ws.xn = d.alloc(t * c.hidden_size);
            ws.qkv = d.alloc(t * (w.q + 2 * w.kv));
            ws.attn = d.alloc(t * w.q);
            ws.delta = d.alloc(t * c.hidden_size);
            ws.gate_up = d.alloc(t * 2 * w.inter);
            ws.act = d.alloc(t * w.inter);
            ws.moe = c.moe.as_ref().map(|mc| MoeWorkspace::new(&**d, mc, c.hidden_size, t));
            ws.resolved_ids = Vec::with_capacity(t);
            ws.max_tokens = t;
        }
        if out_rows > ws.max_out_rows {
            let r = out_rows.next_power_of_two().max(4);
            ws.last = d.alloc(r * c.hidden_size);
            ws.last_n = d.alloc(r * c.hidden_size);
            ws.host_hidden = vec![0.0; r * c.hidden_size];
            ws.max_out_rows = r;
        }
        if head == Head::Logits && out_rows > ws.max_logit_rows {
            let r = out_rows.next_power_of_two().max(4);
            ws.logits = d.alloc(r * c.vocab_size);
            if self.tp.is_some() {
                ws.logits_shard = d.alloc(r * w.vocab);
            }
            ws.host_logits = vec![0.0; r * c.vocab_size];
            ws.max_logit_rows = r;
        }
    }

    /// Runs one batched step. Returns the logits of `batch.logits_rows`, `[rows, vocab]`, in
    /// `ws.host_logits`.
    pub fn forward<'w>(&self, batch: &ForwardBatch, kv: &mut KvCache, ws: &'w mut Workspace, lora: &dyn LoraHook) -> &'w [f32] {
        self.forward_on_device(batch, kv, ws, lora);
        self.logits_to_host(ws, batch.logits_rows.len())
    }

    /// The first `rows` rows of the last step's logits, copied into `ws.host_logits`.
    pub fn logits_to_host<'w>(&self, ws: &'w mut Workspace, rows: usize) -> &'w [f32] {
        let n = rows * self.config.vocab_size;
        if n == 0 {
            return &ws.host_logits[..0];
        }
        self.device.to_host(&ws.logits, n, &mut ws.host_logits[..n]);
        &ws.host_logits[..n]
    }

    /// Applies `edits` (penalties, logit bias, bans, allowed-token masks) to the last step's
    /// logits in place, on the model's device, before the draws that read them.
    pub fn edit_logits(&self, ws: &mut Workspace, edits: &quiver_kernels::logit_edits::LogitEdits) {
        debug_assert_eq!(edits.vocab(), self.config.vocab_size);
        self.device.edit_logits(&mut ws.logits, edits);
    }

    /// Draws the tokens `specs` ask for from the last step's logits, on the model's device.
    pub fn sample(&self, ws: &Workspace, specs: &[quiver_kernels::sample::SampleSpec], out: &mut [quiver_kernels::sample::SampleOut]) {
        self.device.sample(&ws.logits, self.config.vocab_size, specs, out);
    }

    /// [`Self::sample`] without waiting: the results come from [`Self::sample_collect`], and a
    /// later step's ids may name them (`sample::DRAWN`, `Device::sample_launch`).
    pub fn sample_launch(&self, ws: &Workspace, specs: &[quiver_kernels::sample::SampleSpec]) {
        self.device.sample_launch(&ws.logits, self.config.vocab_size, specs);
    }

    /// The results of the last [`Self::sample_launch`] into `out`, waiting for them if needed.
    pub fn sample_collect(&self, out: &mut [quiver_kernels::sample::SampleOut]) {
        self.device.sample_collect(out);
    }

    /// Runs one batched step, leaving the logits of `batch.logits_rows` on the device in
    /// `ws.logits` (`[rows, vocab]`): for sampling there, or [`Self::logits_to_host`].
    pub fn forward_on_device(&self, batch: &ForwardBatch, kv: &mut KvCache, ws: &mut Workspace, lora: &dyn LoraHook) {
        assert!(self.config.has_lm_head, "forward for logits on a model without an LM head (an embedding model)");
        self.run(batch, kv, ws, lora, Head::Logits)
    }

    /// Runs one batched step like [`Self::forward`] but returns the final-normed hidden states of
    /// `batch.logits_rows`, `[rows, hidden]` (in `ws.host_hidden`), skipping the LM head.
    pub fn forward_hidden<'w>(&self, batch: &ForwardBatch, kv: &mut KvCache, ws: &'w mut Workspace, lora: &dyn LoraHook) -> &'w [f32] {
        self.run(batch, kv, ws, lora, Head::Hidden);
        let n = batch.logits_rows.len() * self.config.hidden_size;
        if n == 0 {
            return &ws.host_hidden[..0];
        }
        self.device.to_host(&ws.last_n, n, &mut ws.host_hidden[..n]);
        &ws.host_hidden[..n]
    }

    fn run(&self, batch: &ForwardBatch, kv: &mut KvCache, ws: &mut Workspace, lora: &dyn LoraHook, head_kind: Head) {
        match self.tp.as_ref().and_then(|t| t.group.as_ref()) {
            None => self.run_rank(batch, &mut kv.storage, ws, lora, head_kind),
            Some(group) => group.forward(self, batch, kv, ws, lora, head_kind),
        }
    }

    /// One step of this rank (of the whole model without tensor parallelism). Under tensor
    /// parallelism every rank runs it at once on its own shard, KV store and workspace, and
    /// the collectives join them: the embedding and the row-parallel projections (o, down) are
    /// all-reduced, the vocab-parallel logits all-gathered.
    pub(crate) fn run_rank(&self, batch: &ForwardBatch, kv: &mut KvStorage, ws: &mut Workspace, lora: &dyn LoraHook, head_kind: Head) {
        let c = &self.config;
        let d = &*self.device;
        let w = self.widths();
        let tp = self.tp.as_deref();
        let m = batch.tokens.len();
        let nl = batch.logits_rows.len();
        self.ensure_workspace(ws, m, nl, head_kind);
        let h = c.hidden_size;
        let lora_on = lora.is_active();
        let attn_batch = AttnBatch {
            seq_starts: &batch.seq_starts,
            positions: &batch.positions,
            ctx_lens: &batch.ctx_lens,
            block_tables: &batch.block_tables,
            block_table_stride: batch.block_table_stride,
        };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        d.stage_batch(&batch.tokens, &attn_batch, &batch.logits_rows, &lora.staged());
        // Ids naming the last step's draws (`sample::DRAWN`) get their tokens, on the device.
        let ids = d.resolve_drawn(&batch.tokens, &mut ws.resolved_ids);

        // Launches depend only on the batch's layout (and on whether LoRA kernels run, and on the
        // head), so equal layouts may replay a recording (CUDA graphs): which adapters the rows
        // use is data.
        let head_key = if head_kind == Head::Hidden { 0x9E37_79B9_7F4A_7C15 } else { 0 };
        let shape = Some(batch.shape_key() ^ lora.shape_key() ^ head_key);
        d.run_step(m, shape, &mut || {
            match tp {
                None => d.embedding(&self.embed, ids, &mut ws.x),
                Some(t) => d.embedding_vocab_range(&self.embed, ids, t.shard.vocab.start, &mut ws.x),
            }
            if lora_on {
                lora.embedding(d, ids, &mut ws.x);
            }
            if let Some(t) = tp {
                t.comm.all_reduce_sum(&mut ws.x, m * h);
            }
            for (li, l) in self.layers.iter().enumerate() {
                // The norm making a projection's input goes through the hook too, so a device
                // may start the projection's LoRA delta in the norm's pass.
                let prev = if li == 0 { None } else { Some(&ws.delta) };
                lora.norm(d, li, LinearSite::Qkv, &mut ws.x, prev, &l.attn_norm, c.rms_norm_eps, m, h, &mut ws.xn);
                // Each projection is one hook call: the projection, the batch's LoRA delta (none
                // without adapters) and the epilogue, which the device may fuse.
                let rope = Epilogue::RopeQk { positions: &batch.positions, n_heads: w.heads, n_kv_heads: w.kv_heads, table: &self.rope };
                let qkv_epilogue = if l.qk_norm.is_some() { Epilogue::Plain } else { rope };
                lora.project(d, li, LinearSite::Qkv, &ws.xn, m, &l.qkv, l.qkv_bias.as_ref(), qkv_epilogue, &mut ws.qkv);
                if let Some(norm) = &l.qk_norm {
                    d.qk_norm(&mut ws.qkv, m, w.heads, w.kv_heads, c.head_dim, norm);
                    d.rope_qk(&mut ws.qkv, m, &batch.positions, w.heads, w.kv_heads, &self.rope);
                }
                d.paged_attention(&ws.qkv, &attn_batch, kv, li, w.heads, scale, &mut ws.attn);
                // Under tensor parallelism the output is a partial sum whose LoRA delta must
                // stay in it for the all-reduce (`Residual` would let the device add it into the
                // replicated residual on every rank).
                match tp {
                    None => lora.project(d, li, LinearSite::O, &ws.attn, m, &l.o, l.o_bias.as_ref(), Epilogue::Residual { resid: &mut ws.x }, &mut ws.delta),
                    Some(t) => {
                        lora.project(d, li, LinearSite::O, &ws.attn, m, &l.o, l.o_bias.as_ref(), Epilogue::Plain, &mut ws.delta);
                        t.comm.all_reduce_sum(&mut ws.delta, m * h);
                    }
                }
                let (gate_up, down) = match &l.mlp {
                    Mlp::Dense { gate_up, down } => {
                        lora.norm(d, li, LinearSite::GateUp, &mut ws.x, Some(&ws.delta), &l.mlp_norm, c.rms_norm_eps, m, h, &mut ws.xn);
                        (gate_up, down)
                    }
                    Mlp::Moe(w) => {
                        d.add_rms_norm(&mut ws.x, &ws.delta, &l.mlp_norm, c.rms_norm_eps, m, h, &mut ws.xn);
                        let mc = c.moe.as_ref().expect("an MoE layer in a model with an MoE config");
                        let mws = ws.moe.as_mut().expect("MoE buffers in the workspace of an MoE model");
                        let lora = if lora_on { Some((lora, li)) } else { None };
                        moe::forward(d, w, mc, &ws.xn, m, h, mws, &mut ws.delta, lora);
                        continue;
                    }
                };
                lora.project(d, li, LinearSite::GateUp, &ws.xn, m, gate_up, None, Epilogue::SiluMul { out: &mut ws.act }, &mut ws.gate_up);
                match tp {
                    None => lora.project(d, li, LinearSite::Down, &ws.act, m, down, None, Epilogue::Residual { resid: &mut ws.x }, &mut ws.delta),
                    Some(t) => {
                        lora.project(d, li, LinearSite::Down, &ws.act, m, down, None, Epilogue::Plain, &mut ws.delta);
                        t.comm.all_reduce_sum(&mut ws.delta, m * h);
                    }
                }
            }
            d.add_inplace(&mut ws.x, &ws.delta, m * h);
            if nl == 0 {
                return;
            }
            // Only the rows that need logits go through the final norm and the LM head.
            d.gather_rows(&ws.x, &batch.logits_rows, h, &mut ws.last);
            d.rms_norm(&ws.last, &self.final_norm, c.rms_norm_eps, nl, h, &mut ws.last_n);
            if head_kind == Head::Hidden {
                return;
            }
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            let logits = if tp.is_some() { &mut ws.logits_shard } else { &mut ws.logits };
            d.matmul(&ws.last_n, nl, head, None, logits);
            if lora_on {
                lora.lm_head(d, &ws.last_n, &batch.logits_rows, logits);
            }
            if let Some(t) = tp {
                t.comm.all_gather_cols(&ws.logits_shard, nl, w.vocab, &mut ws.logits);
            }
        });
    }
}
