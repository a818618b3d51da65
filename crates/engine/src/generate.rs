//! Single-sequence generation and scoring straight on the model: the `quiver generate` path and
//! the oracle the batched engine is compared against.

use crate::sampling::{Sampler, SamplingParams};
use quiver_lora::{AdapterKey, LoraHook, LoraManager, NoLora};
use quiver_model::{ForwardBatch, LlamaModel, LogitsFor, Workspace};
use std::time::{Duration, Instant};

/// Supplies the LoRA hook for a step. The hook depends on the batch layout (which rows belong
/// to which adapter), so it is prepared per step and handed to `f`.
pub trait StepLora {
    fn with_hook(&mut self, batch: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook));
}

/// No adapter.
pub struct BaseOnly;

impl StepLora for BaseOnly {
    fn with_hook(&mut self, _: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook)) {
        f(&NoLora)
    }
}

/// One adapter version of a [`LoraManager`] (or the base model with `key: None`).
pub struct AdapterLora<'a> {
    pub manager: &'a mut LoraManager,
    pub key: Option<AdapterKey>,
}

impl StepLora for AdapterLora<'_> {
    fn with_hook(&mut self, batch: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook)) {
        match self.key {
            None => f(&NoLora),
            Some(k) => {
                let keys = [Some(k); 1];
                let hook = self.manager.prepare_batch(&keys, &batch.seq_starts, &batch.logits_rows).unwrap_or_else(|e| panic!("LoRA batch: {e}"));
                f(&hook)
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at any of these ids (usually the tokenizer's EOS ids).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per forward call (chunked prefill).
    pub prefill_chunk: usize,
}

#[derive(Clone, Debug, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl GenerateStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    /// Decode throughput counts tokens after the first (the first comes from the prefill).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

pub struct Generator<'m> {
    model: &'m LlamaModel,
    kv: quiver_model::KvCache,
    ws: Workspace,
    batch: ForwardBatch,
    block_table: Vec<u32>,
    block_size: usize,
    max_ctx: usize,
}

impl<'m> Generator<'m> {
    /// A generator able to hold `max_ctx` tokens of context.
    pub fn new(model: &'m LlamaModel, max_ctx: usize) -> Self {
        let block_size = 16;
        let nblocks = max_ctx.div_ceil(block_size);
        Generator {
            model,
            kv: model.alloc_kv(nblocks, block_size),
            ws: model.new_workspace(256, 1),
            batch: ForwardBatch::with_capacity(256, 1, nblocks),
            block_table: (0..nblocks as u32).collect(),
            block_size,
            max_ctx,
        }
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    fn step<'a>(&'a mut self, tokens: &[u32], start: usize, logits: LogitsFor, lora: &mut dyn StepLora) -> &'a [f32] {
        let stride = self.block_table.len();
        self.batch.clear(stride);
        let need = (start + tokens.len()).div_ceil(self.block_size);
        self.batch.push_seq(tokens, start, &self.block_table[..need], logits);
        let (model, batch, kv, ws) = (self.model, &self.batch, &mut self.kv, &mut self.ws);
        let mut done = false;
        lora.with_hook(batch, &mut |hook| {
            model.forward(batch, kv, ws, hook);
            done = true;
        });
        assert!(done, "StepLora::with_hook must call its continuation");
        let n = batch.logits_rows.len() * model.config.vocab_size;
        &self.ws.host_logits[..n]
    }

    /// Runs `tokens` at positions `start..` after the context run so far and returns the last
    /// one's logits: one step of a caller's own decoding loop (the oracle tests write for the
    /// engine's draws).
    pub fn logits_after(&mut self, tokens: &[u32], start: usize, lora: &mut dyn StepLora) -> &[f32] {
        self.step(tokens, start, LogitsFor::Last, lora)
    }

    /// Logits at every position of `tokens` (teacher forcing), `[len, vocab]`.
    pub fn score(&mut self, tokens: &[u32], lora: &mut dyn StepLora) -> anyhow::Result<Vec<f32>> {
        anyhow::ensure!(tokens.len() <= self.max_ctx, "{} tokens exceed the context of {}", tokens.len(), self.max_ctx);
        Ok(self.step(tokens, 0, LogitsFor::All, lora).to_vec())
    }

    /// Generates up to `opts.max_tokens` tokens after `prompt`, calling `on_token` for each
    /// (return false to stop).
    pub fn generate(&mut self, prompt: &[u32], opts: &GenerateOptions, lora: &mut dyn StepLora, mut on_token: impl FnMut(u32) -> bool) -> anyhow::Result<GenerateStats> {
        anyhow::ensure!(!prompt.is_empty(), "empty prompt");
        anyhow::ensure!(
            prompt.len() + opts.max_tokens <= self.max_ctx,
            "prompt ({} tokens) + max_tokens ({}) exceeds the context window ({})",
            prompt.len(),
            opts.max_tokens,
            self.max_ctx
        );
        let mut stats = GenerateStats { prompt_tokens: prompt.len(), ..Default::default() };
        let mut sampler = Sampler::new(opts.sampling.clone(), prompt);
        let vocab = self.model.config.vocab_size;
        let mut logits = vec![0.0f32; vocab];
        let t0 = Instant::now();
        let chunk = opts.prefill_chunk.max(1);
        let mut pos = 0;
        while pos < prompt.len() {
            let end = (pos + chunk).min(prompt.len());
            let want = if end == prompt.len() { LogitsFor::Last } else { LogitsFor::None };
            let l = self.step(&prompt[pos..end], pos, want, lora);
            if want == LogitsFor::Last {
                logits.copy_from_slice(l);
            }
            pos = end;
        }
        stats.prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut ctx = prompt.len();
        for i in 0..opts.max_tokens {
            sampler.apply_penalties(&mut logits);
            let tok = sampler.sample(&logits);
            sampler.observe(tok);
            stats.generated_tokens += 1;
            let keep_going = on_token(tok);
            if !keep_going || opts.stop_ids.contains(&tok) || i + 1 == opts.max_tokens {
                break;
            }
            let l = self.step(&[tok], ctx, LogitsFor::Last, lora);
            logits.copy_from_slice(l);
            ctx += 1;
        }
        stats.decode_time = t1.elapsed();
        Ok(stats)
    }
}
