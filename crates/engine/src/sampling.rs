//! Per-request sampling: penalties, temperature, top-k, top-p, min-p, seeded RNG.
//!
//! Each request owns its RNG (seeded from its own seed), so its samples do not depend on what
//! else is in the batch.

use quiver_kernels::logit_edits::RowEdits;
use quiver_kernels::sample::SampleSpec;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 or negative = disabled.
    pub top_k: i32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1.0 = disabled; >1 discourages tokens already in prompt or output (HF semantics).
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// `(token id, bias)` added to the logits before sampling (OpenAI's `logit_bias`; ids are
    /// checked against the vocabulary at submission).
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these ids may be drawn when non-empty (vLLM's `allowed_token_ids`), sorted.
    pub allowed_token_ids: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, presence_penalty: 0.0, frequency_penalty: 0.0, repetition_penalty: 1.0, seed: None, logit_bias: Vec::new(), allowed_token_ids: Vec::new() }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        if self.temperature.is_nan() || self.temperature < 0.0 || !self.temperature.is_finite() {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.repetition_penalty.is_nan() || self.repetition_penalty <= 0.0 || !self.repetition_penalty.is_finite() {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (n, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{n} must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(format!("logit_bias for token {t} must be a finite number, got {b}"));
        }
        Ok(())
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Sampling state of one sequence: its random stream (seed and draw counter), token counts for
/// penalties and scratch space. Draws follow `quiver_kernels::sample`'s semantics, the same on
/// the host and on every device.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    /// Draws made so far: the position in the counter-based random stream.
    counter: u64,
    /// Count of each token generated so far (presence/frequency penalties).
    out_counts: std::collections::HashMap<u32, u32>,
    /// Tokens seen in prompt or output (repetition penalty).
    seen: std::collections::HashSet<u32>,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let seen = if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { Default::default() };
        Sampler { params, seed, counter: 0, out_counts: Default::default(), seen, scratch: Vec::new() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the logits must be edited before a draw (bias, allowed ids, penalties).
    pub fn needs_edits(&self) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty() || !p.allowed_token_ids.is_empty() || p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// Writes what [`Self::apply_penalties`] does as a row's logit edits, the device op's form
    /// (the same results bit for bit: `quiver_kernels::logit_edits`).
    pub fn push_edits(&self, e: &mut RowEdits<'_>) {
        let p = &self.params;
        e.bias(&p.logit_bias);
        if !p.allowed_token_ids.is_empty() {
            e.allow_only(&p.allowed_token_ids);
        }
        if p.repetition_penalty != 1.0 {
            e.repetition(p.repetition_penalty, self.seen.iter().copied());
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            e.presence_frequency(p.presence_penalty, p.frequency_penalty, self.out_counts.iter().map(|(&t, &c)| (t, c)));
        }
    }

    /// The next draw as a device op: from logits row `row`, with `logprobs` alternatives
    /// (negative: none). Call [`Self::advance`] once it is drawn.
    pub fn spec(&self, row: u32, logprobs: i32) -> SampleSpec {
        let p = &self.params;
        SampleSpec {
            row,
            top_k: p.top_k.max(0) as u32,
            inv_temperature: if p.is_greedy() { 0.0 } else { 1.0 / p.temperature },
            top_p: p.top_p,
            min_p: p.min_p,
            logprobs,
            seed: self.seed,
            counter: self.counter,
        }
    }

    /// A draw was made elsewhere (on the device) from [`Self::spec`].
    pub fn advance(&mut self) {
        self.counter += 1;
    }

    /// Records a generated token for the penalties.
    pub fn observe(&mut self, token: u32) {
        *self.out_counts.entry(token).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
    }

    /// Applies penalties and the logit bias to `logits` in place (used for sampling and for
    /// reported logprobs alike, as vLLM's logits processors were): the host path of the
    /// single-sequence `Generator`, and the reference of [`Self::push_edits`].
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            logits[t as usize] += b;
        }
        if !p.allowed_token_ids.is_empty() {
            for (t, l) in logits.iter_mut().enumerate() {
                if p.allowed_token_ids.binary_search(&(t as u32)).is_err() {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.out_counts {
                logits[t as usize] -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }

    /// Picks the next token from (penalised) logits on the host.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let spec = self.spec(0, -1);
        self.counter += 1;
        quiver_kernels::sample::draw(logits, &spec, &mut self.scratch)
    }
}

/// Index of the largest logit; the lowest index wins ties (matches torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    quiver_kernels::sample::argmax(logits)
}

/// The chosen token's logprob, its 1-based rank and the top `n` alternatives (the same
/// reference the devices' sampling op returns them by).
pub fn token_logprob(logits: &[f32], token: u32, n: usize) -> crate::api::TokenLogprob {
    let mut out = quiver_kernels::sample::SampleOut::default();
    quiver_kernels::sample::logprobs_into(logits, token, n, &mut out, &mut Vec::new());
    let top = (0..out.n_top as usize).map(|k| (out.top_ids[k], out.top_logprobs[k])).collect();
    crate::api::TokenLogprob { logprob: out.logprob, top, rank: out.rank }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_seed_reproduces() {
        let logits = vec![0.1, 2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&logits), 1);
        let p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        let a: Vec<u32> = { let mut s = Sampler::new(p.clone(), &[]); (0..50).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(p, &[]); (0..50).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 over near-equal logits must vary");
    }

    #[test]
    fn top_k_one_is_greedy_and_penalties_apply() {
        let logits = vec![0.1, 2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 1, seed: Some(1), ..Default::default() }, &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 1.0, ..Default::default() }, &[]);
        s.observe(1);
        let mut l = logits.clone();
        s.apply_penalties(&mut l);
        assert_eq!(argmax(&l), 2);
        let s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }, &[1, 3]);
        let mut l = logits.clone();
        s.apply_penalties(&mut l);
        assert_eq!(l[1], 1.0);
        assert_eq!(l[3], -2.0);
    }

    #[test]
    fn logprobs_normalise() {
        let logits = vec![1.0f32, 2.0, 3.0];
        let t = token_logprob(&logits, 2, 2);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((t.logprob - (3.0f32.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        let t = token_logprob(&logits, 0, 1);
        assert_eq!((t.rank, t.top.len()), (3, 1));
        assert!((t.logprob - (1.0f32.exp() / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn logit_bias_shifts_and_can_ban() {
        let p = SamplingParams { logit_bias: vec![(0, 5.0), (1, -100.0)], ..Default::default() };
        let s = Sampler::new(p, &[]);
        let mut l = vec![0.1, 2.0, 1.9, -1.0];
        s.apply_penalties(&mut l);
        assert_eq!(argmax(&l), 0);
        assert_eq!(l[1], -98.0);
        let s = Sampler::new(SamplingParams { allowed_token_ids: vec![2, 3], ..Default::default() }, &[]);
        let mut l = vec![0.1, 2.0, 1.9, -1.0];
        s.apply_penalties(&mut l);
        assert_eq!((argmax(&l), l[1]), (2, f32::NEG_INFINITY));
        let bad = SamplingParams { logit_bias: vec![(0, f32::NAN)], ..Default::default() };
        assert!(bad.validate().is_err());
    }
}
