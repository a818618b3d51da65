//! Per-request sampling: penalties, temperature, top-k, top-p, min-p, seeded RNG.
//!
//! Each request owns its RNG (seeded from its own seed), so its samples do not depend on what
//! else is in the batch.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
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

/// Sampling state of one sequence: its RNG, token counts for penalties and scratch space.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
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
        Sampler { params, rng: StdRng::seed_from_u64(seed), out_counts: Default::default(), seen, scratch: Vec::new() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token for the penalties.
    pub fn observe(&mut self, token: u32) {
        *self.out_counts.entry(token).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
    }

    /// Applies penalties and the logit bias to `logits` in place (used for sampling and for
    /// reported logprobs alike, as vLLM's logits processors were).
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

    /// Picks the next token from (penalised) logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.scratch.clear();
        self.scratch.extend(logits.iter().enumerate().map(|(i, &l)| (((l - max) * inv_t).exp(), i as u32)));
        let cand = &mut self.scratch;
        // Sort descending by probability (ties by token id for determinism).
        let k = if p.top_k > 0 { (p.top_k as usize).min(cand.len()) } else { cand.len() };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            cand.truncate(k);
        }
        cand.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let total: f32 = cand.iter().map(|c| c.0).sum();
        if p.min_p > 0.0 {
            let thresh = cand[0].0 * p.min_p;
            let keep = cand.iter().take_while(|c| c.0 >= thresh).count().max(1);
            cand.truncate(keep);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.0 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        let sum: f32 = cand.iter().map(|c| c.0).sum();
        let mut r = self.rng.random::<f32>() * sum;
        for c in cand.iter() {
            r -= c.0;
            if r <= 0.0 {
                return c.1;
            }
        }
        cand.last().map(|c| c.1).unwrap_or(0)
    }
}

/// Index of the largest logit; the lowest index wins ties (matches torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// The chosen token's logprob, its 1-based rank and the top `n` alternatives.
pub fn token_logprob(logits: &[f32], token: u32, n: usize) -> crate::api::TokenLogprob {
    let mut top = Vec::new();
    let logprob = logprobs(logits, token, n, &mut top);
    let l = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&x| x > l).count() as u32;
    crate::api::TokenLogprob { logprob, top, rank }
}

/// `log_softmax(logits)[token]` and the top-`n` (token, logprob) pairs.
pub fn logprobs(logits: &[f32], token: u32, n: usize, top: &mut Vec<(u32, f32)>) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    top.clear();
    if n > 0 {
        let mut idx: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &l)| (l, i as u32)).collect();
        let n = n.min(idx.len());
        idx.select_nth_unstable_by(n - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        idx.truncate(n);
        idx.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        top.extend(idx.into_iter().map(|(l, i)| (i, l - lse)));
    }
    logits[token as usize] - lse
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
        let mut top = Vec::new();
        let lp = logprobs(&logits, 2, 2, &mut top);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp - (3.0f32.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
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
