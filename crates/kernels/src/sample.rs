//! Sampling as a device op: one semantics, a host reference and a kernel per device.
//!
//! A row's next token is drawn from its logits by [`SampleSpec`]: greedy (lowest id on ties, as
//! `torch.argmax`), or temperature with top-k, min-p and top-p. Every device computes the same
//! thing, so the choice of device never changes a seeded request's output:
//!
//! * the candidates are ordered by *rank*: logit descending, token id ascending on ties;
//! * `q = exp((l - max) · (1/T))` (so the best token has `q = 1`), held as a 40-bit fixed-point
//!   integer `Q = trunc(q · 2^40)` for every sum, so that sums are exact and independent of the
//!   order a device adds in;
//! * the kept set is a prefix of the rank order: the first `min(top_k, #{q ≥ min_p})` tokens,
//!   cut further to the shortest prefix whose mass reaches `ceil(top_p · mass)`;
//! * the draw is counter-based: `u = bits(seed, counter)`, a 24-bit integer, and
//!   `r = floor(S · u / 2^24)` over the kept mass `S`; the token is the first kept one, walking in
//!   token-id order, whose running mass exceeds `r`.
//!
//! Devices may differ only where `exp` rounds differently in the last place.
//!
//! A draw is launched and collected apart ([`Device::sample_launch`], [`Device::sample_collect`]),
//! so a device that computes asynchronously can run the next step before the host has the
//! tokens: that step's input names them as [`DRAWN`] ids, resolved on the device.

use crate::{Device, Tensor};

/// How many top alternatives a device returns with a token (OpenAI's and vLLM's maximum).
pub const TOP_LOGPROBS_MAX: usize = 20;

/// A step's input id may stand for a draw the host has not seen yet: `DRAWN | i` is the token
/// drawn for spec `i` of the device's last [`Device::sample_launch`], replaced by
/// [`Device::resolve_drawn`] before the embedding reads it. Vocabulary ids stay below 2^31.
pub const DRAWN: u32 = 1 << 31;

/// One token to draw from one row of a `[rows, vocab]` logits buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct SampleSpec {
    /// The logits row.
    pub row: u32,
    /// 0 or ≥ vocab: no top-k.
    pub top_k: u32,
    /// 1/T; 0 = greedy.
    pub inv_temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    /// Top alternatives to return with the token's logprob; negative = no logprobs.
    pub logprobs: i32,
    /// The request's seed and the index of this draw in its stream.
    pub seed: u64,
    pub counter: u64,
}

/// What a device returns for one [`SampleSpec`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct SampleOut {
    pub token: u32,
    /// `log_softmax(logits)[token]` (when logprobs were asked for).
    pub logprob: f32,
    /// 1 + the number of logits strictly greater than the token's.
    pub rank: u32,
    /// How many of `top` are filled.
    pub n_top: u32,
    pub top_ids: [u32; TOP_LOGPROBS_MAX],
    pub top_logprobs: [f32; TOP_LOGPROBS_MAX],
}

impl Default for SampleOut {
    fn default() -> Self {
        SampleOut { token: 0, logprob: 0.0, rank: 0, n_top: 0, top_ids: [0; TOP_LOGPROBS_MAX], top_logprobs: [0.0; TOP_LOGPROBS_MAX] }
    }
}

/// 40-bit fixed point of a probability in [0, 1].
const Q_ONE: f32 = 1_099_511_627_776.0;

/// The 24 random bits of draw `counter` of stream `seed` (splitmix64 of the pair): a pure
/// function, so a draw depends only on its request and position, never on batch-mates.
pub fn random_bits(seed: u64, counter: u64) -> u32 {
    let mut z = seed.wrapping_add(counter.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as u32
}

/// `floor(s · u / 2^24)` without overflow, for `s < 2^56`, `u < 2^24`.
pub fn scale_mass(s: u64, u: u32) -> u64 {
    (s >> 24) * u as u64 + (((s & 0xFF_FFFF) * u as u64) >> 24)
}

/// `ceil(top_p · total)`, at least 1, in f64 (the same on every device).
pub fn top_p_target(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).clamp(1, total.max(1))
}

fn fixed(q: f32) -> u64 {
    (q * Q_ONE) as u64
}

/// Index of the largest logit, the lowest index on ties.
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

/// The token `spec` draws from `logits` (the host reference every device kernel matches).
/// `scratch` is reused between calls.
pub fn draw(logits: &[f32], spec: &SampleSpec, scratch: &mut Vec<(f32, u32)>) -> u32 {
    let best = argmax(logits);
    let max = logits[best as usize];
    if spec.inv_temperature == 0.0 || max == f32::NEG_INFINITY {
        return best;
    }
    let inv_t = spec.inv_temperature;
    let q = |l: f32| ((l - max) * inv_t).exp();
    let u = random_bits(spec.seed, spec.counter);
    let v = logits.len();
    let finite = |l: f32| l > f32::NEG_INFINITY;
    let top_k = if spec.top_k == 0 { v } else { spec.top_k as usize };
    let filtered = top_k < v || spec.min_p > 0.0 || spec.top_p < 1.0;
    if !filtered {
        // Every finite token is kept: walk them in id order.
        let s: u64 = logits.iter().map(|&l| if finite(l) { fixed(q(l)) } else { 0 }).sum();
        let r = scale_mass(s, u);
        let mut acc = 0u64;
        for (i, &l) in logits.iter().enumerate() {
            if finite(l) {
                acc += fixed(q(l));
                if acc > r {
                    return i as u32;
                }
            }
        }
        return best;
    }
    scratch.clear();
    scratch.extend(logits.iter().enumerate().filter(|(_, &l)| finite(l)).map(|(i, &l)| (l, i as u32)));
    scratch.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut keep = top_k.min(scratch.len());
    if spec.min_p > 0.0 {
        keep = keep.min(scratch.iter().take_while(|c| q(c.0) >= spec.min_p).count());
    }
    if spec.top_p < 1.0 {
        let total: u64 = scratch[..keep].iter().map(|c| fixed(q(c.0))).sum();
        let target = top_p_target(spec.top_p, total);
        let mut acc = 0u64;
        for (i, c) in scratch[..keep].iter().enumerate() {
            acc += fixed(q(c.0));
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
    }
    let kept = &mut scratch[..keep.max(1)];
    kept.sort_unstable_by_key(|c| c.1);
    let s: u64 = kept.iter().map(|c| fixed(q(c.0))).sum();
    let r = scale_mass(s, u);
    let mut acc = 0u64;
    for c in kept.iter() {
        acc += fixed(q(c.0));
        if acc > r {
            return c.1;
        }
    }
    kept.last().map(|c| c.1).unwrap_or(best)
}

/// The token's logprob (`log_softmax`, the sum in f64), its rank and the `n` best alternatives
/// (rank order: logit descending, id ascending) into `out`; `scratch` is reused between calls.
pub fn logprobs_into(logits: &[f32], token: u32, n: usize, out: &mut SampleOut, scratch: &mut Vec<(f32, u32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    let l = logits[token as usize];
    out.token = token;
    out.logprob = l - lse;
    out.rank = 1 + logits.iter().filter(|&&x| x > l).count() as u32;
    let n = n.min(TOP_LOGPROBS_MAX).min(logits.len());
    out.n_top = n as u32;
    if n == 0 {
        return;
    }
    let rank_order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &x)| (x, i as u32)));
    scratch.select_nth_unstable_by(n - 1, rank_order);
    let best = &mut scratch[..n];
    best.sort_unstable_by(rank_order);
    for (k, &(x, i)) in best.iter().enumerate() {
        out.top_ids[k] = i;
        out.top_logprobs[k] = x - lse;
    }
}

/// The sampling op on a device that draws on the host (the CPU; OpenCL reads the rows back
/// first): [`Device::sample_launch`] draws at once and keeps the results here until
/// [`Device::sample_collect`] hands them out, and [`Device::resolve_drawn`] reads the tokens
/// from here. Buffers only grow: a steady step allocates nothing.
#[derive(Default)]
pub struct HostDraws {
    state: std::sync::Mutex<HostDrawState>,
}

#[derive(Default)]
struct HostDrawState {
    /// The rows read back from a device that keeps its logits in its own memory.
    logits: Vec<f32>,
    scratch: Vec<(f32, u32)>,
    /// The last launch's results (the first `n`), and whether they were collected.
    outs: Vec<SampleOut>,
    n: usize,
    pending: bool,
}

impl HostDraws {
    /// [`Device::sample_launch`]: draws `specs` from `logits` now.
    pub fn launch<D: Device + ?Sized>(&self, dev: &D, logits: &Tensor, vocab: usize, specs: &[SampleSpec]) {
        let mut st = self.state.lock().unwrap();
        assert!(!st.pending, "sample_launch: the previous launch's results were not collected");
        let HostDrawState { logits: host, scratch, outs, n, pending } = &mut *st;
        if outs.len() < specs.len() {
            outs.resize(specs.len(), SampleOut::default());
        }
        let rows = specs.iter().map(|s| s.row as usize + 1).max().unwrap_or(0);
        if logits.is_host() {
            sample_rows_host(logits.as_cpu(), vocab, specs, outs, scratch);
        } else {
            host.resize(rows * vocab, 0.0);
            dev.to_host(logits, rows * vocab, host);
            sample_rows_host(host, vocab, specs, outs, scratch);
        }
        *n = specs.len();
        *pending = true;
    }

    /// [`Device::sample_collect`]: the last launch's results into `out[..n]`.
    pub fn collect(&self, out: &mut [SampleOut]) {
        let mut st = self.state.lock().unwrap();
        assert!(st.pending, "sample_collect without a launch to collect");
        st.pending = false;
        let n = st.n;
        assert!(out.len() >= n, "sample_collect: {} outputs for {n} draws", out.len());
        out[..n].copy_from_slice(&st.outs[..n]);
    }

    /// [`Device::resolve_drawn`]: `ids` with every `DRAWN | i` replaced by the token of draw
    /// `i` of the last launch (in `resolved`), or `ids` itself when it names no draw.
    pub fn resolve<'a>(&self, ids: &'a [u32], resolved: &'a mut Vec<u32>) -> &'a [u32] {
        if !ids.iter().any(|&t| t & DRAWN != 0) {
            return ids;
        }
        let st = self.state.lock().unwrap();
        resolved.clear();
        resolved.extend(ids.iter().map(|&t| {
            if t & DRAWN == 0 {
                return t;
            }
            let i = (t & !DRAWN) as usize;
            assert!(i < st.n, "token id names draw {i} of a launch of {}", st.n);
            st.outs[i].token
        }));
        resolved
    }
}

/// The host implementation of the op over `[rows, vocab]` logits in host memory.
pub fn sample_rows_host(logits: &[f32], vocab: usize, specs: &[SampleSpec], out: &mut [SampleOut], scratch: &mut Vec<(f32, u32)>) {
    for (s, o) in specs.iter().zip(out.iter_mut()) {
        let row = &logits[s.row as usize * vocab..(s.row as usize + 1) * vocab];
        let tok = draw(row, s, scratch);
        o.token = tok;
        o.n_top = 0;
        if s.logprobs >= 0 {
            logprobs_into(row, tok, s.logprobs as usize, o, scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(t: f32, top_k: u32, top_p: f32, min_p: f32, counter: u64) -> SampleSpec {
        SampleSpec { row: 0, top_k, inv_temperature: if t == 0.0 { 0.0 } else { 1.0 / t }, top_p, min_p, logprobs: -1, seed: 7, counter }
    }

    #[test]
    fn greedy_takes_the_lowest_id_of_a_tie() {
        let l = [0.5, 2.0, 2.0, -1.0];
        assert_eq!(draw(&l, &spec(0.0, 0, 1.0, 0.0, 0), &mut Vec::new()), 1);
    }

    #[test]
    fn draws_follow_the_distribution() {
        // p = softmax(l): 0.0900, 0.2447, 0.6652.
        let l = [0.0f32, 1.0, 2.0];
        let mut counts = [0usize; 3];
        let n = 30_000;
        for c in 0..n {
            counts[draw(&l, &spec(1.0, 0, 1.0, 0.0, c), &mut Vec::new()) as usize] += 1;
        }
        let z: f32 = l.iter().map(|x| x.exp()).sum();
        for (i, &k) in counts.iter().enumerate() {
            let p = l[i].exp() / z;
            let f = k as f32 / n as f32;
            assert!((f - p).abs() < 0.01, "token {i}: frequency {f}, probability {p}");
        }
    }

    #[test]
    fn filters_cut_the_rank_order() {
        let l = [0.0f32, 1.0, 2.0, 1.0];
        let mut s = Vec::new();
        // top_k 1 and tiny top_p are greedy; top_k 2 keeps ids 2 and 1 (the lower id of the tie).
        for c in 0..200 {
            assert_eq!(draw(&l, &spec(1.0, 1, 1.0, 0.0, c), &mut s), 2);
            assert_eq!(draw(&l, &spec(1.0, 0, 0.01, 0.0, c), &mut s), 2);
            let t = draw(&l, &spec(1.0, 2, 1.0, 0.0, c), &mut s);
            assert!(t == 2 || t == 1, "top_k 2 drew {t}");
            // min_p 0.5 keeps q ≥ 0.5: only id 2 (q of the others is e^-1 = 0.37).
            assert_eq!(draw(&l, &spec(1.0, 0, 1.0, 0.5, c), &mut s), 2);
        }
        // Masked tokens are never drawn.
        let m = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        for c in 0..50 {
            assert_eq!(draw(&m, &spec(1.0, 0, 1.0, 0.0, c), &mut s), 1);
            assert_eq!(draw(&m, &spec(1.0, 2, 0.9, 0.1, c), &mut s), 1);
        }
    }

    #[test]
    fn same_seed_and_counter_same_token() {
        let l: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 113) as f32 / 17.0).collect();
        let mut s = Vec::new();
        let a: Vec<u32> = (0..64).map(|c| draw(&l, &spec(0.8, 40, 0.9, 0.01, c), &mut s)).collect();
        let b: Vec<u32> = (0..64).map(|c| draw(&l, &spec(0.8, 40, 0.9, 0.01, c), &mut s)).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn host_draws_resolve_ids_naming_the_last_launch() {
        let d = crate::cpu::CpuDevice::new();
        let logits = crate::Tensor::cpu(vec![0.0, 3.0, 1.0, /* row 1 */ 2.0, 0.0, 1.0]);
        let specs = [SampleSpec { row: 1, ..spec(0.0, 0, 1.0, 0.0, 0) }, SampleSpec { row: 0, ..spec(0.0, 0, 1.0, 0.0, 0) }];
        d.sample_launch(&logits, 3, &specs);
        let mut resolved = Vec::new();
        assert_eq!(d.resolve_drawn(&[7, DRAWN | 1, DRAWN], &mut resolved), &[7, 1, 0]);
        let plain = [7, 8];
        assert!(std::ptr::eq(d.resolve_drawn(&plain, &mut resolved), &plain[..]), "ids naming no draw are used as they are");
        let mut out = [SampleOut::default(); 2];
        d.sample_collect(&mut out);
        assert_eq!((out[0].token, out[1].token), (0, 1));
        // The draws stay resolvable after the collect, until the next launch.
        assert_eq!(d.resolve_drawn(&[DRAWN | 1], &mut resolved), &[1]);
    }

    #[test]
    fn logprobs_normalise_and_rank() {
        let l = [1.0f32, 3.0, 2.0, 3.0];
        let mut o = SampleOut::default();
        logprobs_into(&l, 2, 3, &mut o, &mut Vec::new());
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((o.logprob as f64 - (2.0f64.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(o.rank, 3);
        assert_eq!(&o.top_ids[..3], &[1, 3, 2]);
    }
}
