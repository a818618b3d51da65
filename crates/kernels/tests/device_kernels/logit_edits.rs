//! Logit edits (`Device::edit_logits`) against the host path the engine drew through before
//! the op existed: the `Sampler`'s bias, allowed ids and penalties, then the `min_tokens` ban,
//! then the grammar's mask, each written out here as the engine wrote it. Random logits and
//! random edit sets (duplicate bias entries, negative and positive penalised logits, rows with
//! nothing edited, a row with every token banned), bit for bit; then the draws from the edited
//! rows, and the all-banned row's token (0, on every device).

use super::*;
use quiver_kernels::logit_edits::{mask_allows, mask_words, LogitEdits};

/// One row's edit set, in the request's own terms.
#[derive(Default)]
struct RowSet {
    bias: Vec<(u32, f32)>,
    /// Sorted; empty = every token.
    allowed: Vec<u32>,
    repetition: f32,
    seen: Vec<u32>,
    presence: f32,
    frequency: f32,
    counts: Vec<(u32, u32)>,
    banned: Vec<u32>,
    /// A grammar's mask, when the row has one.
    grammar: Option<Vec<u32>>,
}

/// `n` distinct tokens below `vocab`.
fn distinct(r: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n * 2).map(|_| r.below(vocab) as u32).collect();
    v.sort_unstable();
    v.dedup();
    v.truncate(n);
    v
}

fn random_set(r: &mut Rng, vocab: usize) -> RowSet {
    let mut s = RowSet { repetition: 1.0, ..Default::default() };
    if r.below(2) == 0 {
        s.bias = (0..1 + r.below(6)).map(|_| (r.below(vocab) as u32, r.vec(1, 5.0)[0])).collect();
        // The same token twice: both additions, in order.
        s.bias.push((s.bias[0].0, 0.375));
    }
    if r.below(4) == 0 {
        let n = 1 + r.below(vocab / 2);
        s.allowed = distinct(r, n, vocab);
    }
    if r.below(2) == 0 {
        s.repetition = [0.5, 0.9, 1.1, 1.3, 2.0][r.below(5)];
        let n = 1 + r.below(vocab / 3);
        s.seen = distinct(r, n, vocab);
    }
    if r.below(2) == 0 {
        (s.presence, s.frequency) = (r.vec(1, 2.0)[0], r.vec(1, 2.0)[0]);
        let n = 1 + r.below(40);
        s.counts = distinct(r, n, vocab).into_iter().map(|t| (t, 1 + r.below(9) as u32)).collect();
    }
    if r.below(3) == 0 {
        s.banned = (0..1 + r.below(4)).map(|_| r.below(vocab) as u32).collect();
    }
    if r.below(3) == 0 {
        let mut m: Vec<u32> = (0..mask_words(vocab)).map(|_| r.0.random()).collect();
        m[0] |= 1;
        s.grammar = Some(m);
    }
    s
}

/// The engine's host path over one row, as it was: `Sampler::apply_penalties`, the ban, then
/// `Guide::mask`.
fn old_host_path(l: &mut [f32], s: &RowSet) {
    for &(t, b) in &s.bias {
        l[t as usize] += b;
    }
    if !s.allowed.is_empty() {
        for (t, x) in l.iter_mut().enumerate() {
            if s.allowed.binary_search(&(t as u32)).is_err() {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    if s.repetition != 1.0 {
        for &t in &s.seen {
            let x = &mut l[t as usize];
            *x = if *x > 0.0 { *x / s.repetition } else { *x * s.repetition };
        }
    }
    if s.presence != 0.0 || s.frequency != 0.0 {
        for &(t, c) in &s.counts {
            l[t as usize] -= s.presence + s.frequency * c as f32;
        }
    }
    for &t in &s.banned {
        l[t as usize] = f32::NEG_INFINITY;
    }
    if let Some(m) = &s.grammar {
        for (t, x) in l.iter_mut().enumerate() {
            if !mask_allows(m, t) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// `s` as the op's packed edits of `row` (what the engine writes).
fn push_set(e: &mut LogitEdits, row: u32, s: &RowSet) {
    let mut w = e.row(row);
    w.bias(&s.bias);
    if s.repetition != 1.0 {
        w.repetition(s.repetition, s.seen.iter().copied());
    }
    if s.presence != 0.0 || s.frequency != 0.0 {
        w.presence_frequency(s.presence, s.frequency, s.counts.iter().copied());
    }
    w.ban(s.banned.iter().copied());
    if !s.allowed.is_empty() {
        let m = w.mask();
        m.fill(0);
        for &t in &s.allowed {
            m[t as usize / 32] |= 1 << (t % 32);
        }
    }
    if let Some(g) = &s.grammar {
        for (m, &g) in w.mask().iter_mut().zip(g) {
            *m &= g;
        }
    }
}

/// `got` and `want` hold the same bits (-inf included).
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits(), "{what}: element {i}: {g} against {w}");
    }
}

/// Random edits on `g` against the old host path and the host reference, bit for bit, over a
/// small vocabulary, SmolLM2's (+5, not a whole number of mask words) and one under a word;
/// then greedy and seeded draws from the edited rows against the host's, and the row with every
/// token banned drawing token 0.
pub fn logit_edits_match_the_host_path(g: &dyn Device) {
    let mut r = Rng::fresh("logit_edits");
    for (rows, vocab) in [(9, 1000), (4, 49_157), (3, 31)] {
        let logits = r.vec(rows * vocab, 6.0);
        let mut e = LogitEdits::new();
        e.clear(vocab);
        let mut old = logits.clone();
        let banned_row = rows - 1;
        // Rows in a scrambled order; row 1 keeps its logits.
        for row in (0..rows).rev().filter(|&row| row != 1) {
            let s = if row == banned_row { RowSet { repetition: 1.0, grammar: Some(vec![0; mask_words(vocab)]), ..Default::default() } } else { random_set(&mut r, vocab) };
            old_host_path(&mut old[row * vocab..(row + 1) * vocab], &s);
            push_set(&mut e, row as u32, &s);
        }
        let mut reference = logits.clone();
        e.apply_host(&mut reference);
        assert_bits(&format!("host reference, vocab {vocab}"), &reference, &old);
        let mut t = g.tensor_from(&logits);
        g.edit_logits(&mut t, &e);
        assert_bits(&format!("{:?} edits, vocab {vocab}", g.kind()), &host(g, &t, rows * vocab), &old);
        // Draws from the edited rows, greedy and seeded, against the host's from the old path.
        let specs: Vec<SampleSpec> = (0..rows as u32)
            .flat_map(|row| [SampleSpec { row, top_p: 1.0, logprobs: 2, ..Default::default() }, SampleSpec { row, inv_temperature: 1.0, top_k: 50, top_p: 0.9, logprobs: -1, seed: 7, counter: row as u64, ..Default::default() }])
            .collect();
        let mut got = vec![SampleOut::default(); specs.len()];
        g.sample(&t, vocab, &specs, &mut got);
        let mut want = vec![SampleOut::default(); specs.len()];
        sample::sample_rows_host(&old, vocab, &specs, &mut want, &mut Vec::new());
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.token, b.token, "vocab {vocab}: draw {k} from row {}", specs[k].row);
        }
        for o in &got[2 * banned_row..] {
            assert_eq!(o.token, 0, "a row with every token banned draws token 0");
        }
        assert_eq!(got[2 * banned_row].rank, 1);
    }
}
