//! Logit edits as a device op: what a request asks to change in its row's logits before the
//! draw, applied where the logits are, so that a row with penalties, a logit bias, allowed ids,
//! a `min_tokens` ban or a grammar's mask draws on the device like any other row.
//!
//! A step's edits are one packed description ([`LogitEdits`]): a header per edited row
//! ([`EditRow`]) and one arena of u32 words holding the rows' lists. Every device applies them
//! in the same order, which gives the host path's results (the engine's `Sampler` and the
//! grammar's mask, applied one after the other) bit for bit:
//!
//! 1. the logit bias, `l[t] += b`, entry by entry in list order (a token listed twice gets both);
//! 2. the repetition penalty over every token seen in prompt or output (Hugging Face's rule):
//!    `l > 0 ? l / p : l * p`;
//! 3. presence and frequency penalties over the output's tokens (OpenAI's and vLLM's rule):
//!    `l -= presence + frequency · count`, the product rounded before the sum (no fused
//!    multiply-add: devices must not contract it);
//! 4. bans: each listed token becomes -inf (a `min_tokens` ban on EOS and stop ids);
//! 5. the allowed-token bitmask (bit `t % 32` of word `t / 32` set = allowed): every other token
//!    becomes -inf. `allowed_token_ids` and a grammar's mask are one mask, their intersection.
//!
//! The host applies allowed ids right after the bias, and the ban and the grammar's mask after
//! the penalties; moving the -inf edits to the end changes nothing, since -inf stays -inf under
//! every finite edit (`-inf · p` and `-inf / p` with `p > 0`, `-inf - x`), so the finite results
//! are the same arithmetic on the same values.
//!
//! Within a row the repetition and count lists name each token once (they come from a set and a
//! map), so a device may apply their entries in any order or at once; a row appears at most once
//! a step. A row whose every token ends at -inf draws token 0 (`sample::draw`'s argmax over no
//! finite value, the same on every device).

/// No bitmask for this row (`EditRow::mask`).
pub const NO_MASK: u32 = u32::MAX;

/// u32 words of one [`EditRow`] in the packed upload (`LOGIT_EDIT_ROW_WORDS` in the kernels).
pub const ROW_WORDS: usize = 13;

/// A list in the arena: its first word and its number of entries (an entry is one word, or two
/// for the pairs of the bias and count lists).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Span {
    pub at: u32,
    pub len: u32,
}

/// One edited row's header: its logits row, the penalties, and where its lists lie.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct EditRow {
    pub row: u32,
    /// 1 = none.
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
    /// `(token, bias as f32 bits)` pairs.
    pub bias: Span,
    /// Tokens the repetition penalty applies to (each once).
    pub seen: Span,
    /// `(token, count)` pairs of the output (each token once).
    pub counts: Span,
    /// Tokens set to -inf.
    pub banned: Span,
    /// Word offset of the row's `ceil(vocab / 32)`-word allowed mask, or [`NO_MASK`].
    pub mask: u32,
}

const _: () = assert!(std::mem::size_of::<EditRow>() == ROW_WORDS * 4);

impl EditRow {
    fn new(row: u32) -> EditRow {
        EditRow { row, repetition: 1.0, presence: 0.0, frequency: 0.0, bias: Span::default(), seen: Span::default(), counts: Span::default(), banned: Span::default(), mask: NO_MASK }
    }

    /// The header as the words a device reads.
    fn words(&self) -> [u32; ROW_WORDS] {
        let s = |s: Span| [s.at, s.len];
        let [b0, b1] = s(self.bias);
        let [s0, s1] = s(self.seen);
        let [c0, c1] = s(self.counts);
        let [n0, n1] = s(self.banned);
        [self.row, self.repetition.to_bits(), self.presence.to_bits(), self.frequency.to_bits(), b0, b1, s0, s1, c0, c1, n0, n1, self.mask]
    }
}

/// Words of an allowed-token bitmask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether bit `t` of `mask` is set.
pub fn mask_allows(mask: &[u32], t: usize) -> bool {
    mask[t / 32] >> (t % 32) & 1 != 0
}

/// A step's edits. The engine keeps one and refills it every step: its buffers only grow, so a
/// steady step allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct LogitEdits {
    vocab: usize,
    rows: Vec<EditRow>,
    arena: Vec<u32>,
}

impl LogitEdits {
    pub fn new() -> LogitEdits {
        LogitEdits::default()
    }

    /// Empties it for a step over rows of `vocab` logits.
    pub fn clear(&mut self, vocab: usize) {
        self.vocab = vocab;
        self.rows.clear();
        self.arena.clear();
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn rows(&self) -> &[EditRow] {
        &self.rows
    }

    pub fn arena(&self) -> &[u32] {
        &self.arena
    }

    /// Whether logits row `row` has edits already this step.
    pub fn has_row(&self, row: u32) -> bool {
        self.rows.iter().any(|r| r.row == row)
    }

    /// Starts the edits of logits row `row` (at most once a step: see [`Self::has_row`]).
    pub fn row(&mut self, row: u32) -> RowEdits<'_> {
        debug_assert!(!self.has_row(row), "logits row {row} edited twice in one step");
        self.rows.push(EditRow::new(row));
        let start = self.arena.len();
        RowEdits { e: self, start }
    }

    /// Words of the packed upload: every header, then the arena.
    pub fn packed_words(&self) -> usize {
        self.rows.len() * ROW_WORDS + self.arena.len()
    }

    /// Writes the packed upload into `out` (`packed_words` long). A device reads the headers
    /// at word 0 and the arena at word `rows · ROW_WORDS`, to which every arena offset is
    /// relative.
    pub fn pack_into(&self, out: &mut [u32]) {
        let (head, arena) = out.split_at_mut(self.rows.len() * ROW_WORDS);
        for (h, r) in head.chunks_exact_mut(ROW_WORDS).zip(&self.rows) {
            h.copy_from_slice(&r.words());
        }
        arena.copy_from_slice(&self.arena);
    }

    /// The op on logits in host memory, `[rows, vocab]`: the semantics every device matches.
    pub fn apply_host(&self, logits: &mut [f32]) {
        let v = self.vocab;
        for r in &self.rows {
            let at = r.row as usize * v;
            apply_row(&mut logits[at..at + v], r, &self.arena);
        }
    }
}

/// The list `s` of `arena`, `width` words an entry.
fn list(arena: &[u32], s: Span, width: usize) -> &[u32] {
    &arena[s.at as usize..s.at as usize + s.len as usize * width]
}

/// One row's edits on its `vocab` logits, in the order of the module's docs.
pub fn apply_row(l: &mut [f32], r: &EditRow, arena: &[u32]) {
    for p in list(arena, r.bias, 2).chunks_exact(2) {
        l[p[0] as usize] += f32::from_bits(p[1]);
    }
    let rp = r.repetition;
    for &t in list(arena, r.seen, 1) {
        let x = &mut l[t as usize];
        *x = if *x > 0.0 { *x / rp } else { *x * rp };
    }
    for p in list(arena, r.counts, 2).chunks_exact(2) {
        l[p[0] as usize] -= r.presence + r.frequency * p[1] as f32;
    }
    for &t in list(arena, r.banned, 1) {
        l[t as usize] = f32::NEG_INFINITY;
    }
    if r.mask != NO_MASK {
        let mask = &arena[r.mask as usize..r.mask as usize + mask_words(l.len())];
        for (t, x) in l.iter_mut().enumerate() {
            if !mask_allows(mask, t) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The edits of one row being written ([`LogitEdits::row`]); each list is set at most once.
pub struct RowEdits<'a> {
    e: &'a mut LogitEdits,
    /// Where the row's lists begin in the arena.
    start: usize,
}

impl RowEdits<'_> {
    fn header(&mut self) -> &mut EditRow {
        self.e.rows.last_mut().expect("a row was started")
    }

    /// Appends `words` entries of `width` words to the arena as a list.
    fn push_list(&mut self, width: usize, words: impl Iterator<Item = u32>) -> Span {
        let at = self.e.arena.len();
        self.e.arena.extend(words);
        Span { at: at as u32, len: ((self.e.arena.len() - at) / width) as u32 }
    }

    /// `logit_bias`: `(token, bias)` added in order.
    pub fn bias(&mut self, bias: &[(u32, f32)]) -> &mut Self {
        debug_assert_eq!(self.header().bias.len, 0);
        let s = self.push_list(2, bias.iter().flat_map(|&(t, b)| [t, b.to_bits()]));
        self.header().bias = s;
        self
    }

    /// The repetition penalty `penalty` over `seen` (prompt and output tokens, each once).
    pub fn repetition(&mut self, penalty: f32, seen: impl Iterator<Item = u32>) -> &mut Self {
        debug_assert_eq!(self.header().seen.len, 0);
        let s = self.push_list(1, seen);
        let h = self.header();
        h.repetition = penalty;
        h.seen = s;
        self
    }

    /// Presence and frequency penalties over the output's `(token, count)`s (each token once).
    pub fn presence_frequency(&mut self, presence: f32, frequency: f32, counts: impl Iterator<Item = (u32, u32)>) -> &mut Self {
        debug_assert_eq!(self.header().counts.len, 0);
        let s = self.push_list(2, counts.flat_map(|(t, c)| [t, c]));
        let h = self.header();
        (h.presence, h.frequency, h.counts) = (presence, frequency, s);
        self
    }

    /// Tokens that may not be drawn.
    pub fn ban(&mut self, tokens: impl Iterator<Item = u32>) -> &mut Self {
        debug_assert_eq!(self.header().banned.len, 0);
        let s = self.push_list(1, tokens);
        self.header().banned = s;
        self
    }

    /// The row's allowed-token bitmask, every token allowed when first asked for: callers clear
    /// the bits of what they disallow, so several restrictions intersect.
    pub fn mask(&mut self) -> &mut [u32] {
        let n = mask_words(self.e.vocab);
        if self.header().mask == NO_MASK {
            let at = self.e.arena.len();
            self.e.arena.resize(at + n, u32::MAX);
            self.header().mask = at as u32;
        }
        let at = self.header().mask as usize;
        &mut self.e.arena[at..at + n]
    }

    /// Disallows every token not in `ids` (ascending, below the vocabulary).
    pub fn allow_only(&mut self, ids: &[u32]) -> &mut Self {
        let mut k = 0;
        for (w, word) in self.mask().iter_mut().enumerate() {
            let mut keep = 0u32;
            while k < ids.len() && ids[k] as usize / 32 == w {
                keep |= 1 << (ids[k] % 32);
                k += 1;
            }
            *word &= keep;
        }
        self
    }

    /// Disallows every token whose bit is clear in `bits`, a bitmask of `len` tokens; tokens
    /// from `len` on too (a grammar's mask over a vocabulary shorter than the logits row).
    pub fn allow_mask(&mut self, bits: &[u32], len: usize) -> &mut Self {
        for (w, word) in self.mask().iter_mut().enumerate() {
            let valid = len.saturating_sub(w * 32).min(32);
            let in_len = if valid == 32 { u32::MAX } else { (1u32 << valid) - 1 };
            *word &= bits.get(w).copied().unwrap_or(0) & in_len;
        }
        self
    }

    /// Whether some token of the vocabulary is neither masked out nor banned: on finite logits,
    /// whether the draw has a finite choice.
    pub fn any_allowed(&mut self) -> bool {
        let vocab = self.e.vocab;
        let h = *self.header();
        let banned = list(&self.e.arena, h.banned, 1);
        let allowed = |t: usize| t < vocab && !banned.contains(&(t as u32));
        if h.mask == NO_MASK {
            return (0..vocab).any(allowed);
        }
        let mask = &self.e.arena[h.mask as usize..h.mask as usize + mask_words(vocab)];
        mask.iter().enumerate().any(|(w, &bits)| bits != 0 && (0..32).any(|b| bits >> b & 1 != 0 && allowed(w * 32 + b)))
    }

    /// Drops the row's edits (it will not be drawn).
    pub fn cancel(self) {
        self.e.rows.pop();
        self.e.arena.truncate(self.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_apply_in_order_and_pack_their_lists() {
        let mut e = LogitEdits::new();
        e.clear(40);
        e.row(1).bias(&[(3, 1.5), (3, 0.25), (7, -2.0)]).repetition(2.0, [3, 4, 5].into_iter()).presence_frequency(0.5, 0.25, [(4, 2)].into_iter()).ban([9].into_iter());
        let mut r = e.row(0);
        let m = r.mask();
        m.fill(0);
        m[1] = 1 << 2; // token 34 only
        let mut l: Vec<f32> = (0..80).map(|i| (i % 40) as f32 - 4.0).collect();
        let before = l.clone();
        e.apply_host(&mut l);
        let row1 = &l[40..];
        assert_eq!(row1[3], (-1.0f32 + 1.5 + 0.25) / 2.0, "biased twice, then positive: divided");
        assert_eq!(row1[4], 0.0 * 2.0 - (0.5 + 0.25 * 2.0), "not positive: multiplied, then the count penalties");
        assert_eq!(row1[5], 1.0 / 2.0);
        assert_eq!(row1[7], 3.0 - 2.0);
        assert_eq!(row1[9], f32::NEG_INFINITY);
        assert_eq!(row1[10], before[50]);
        assert!(l[..40].iter().enumerate().all(|(t, &x)| if t == 34 { x == 30.0 } else { x == f32::NEG_INFINITY }));
        let mut packed = vec![0u32; e.packed_words()];
        e.pack_into(&mut packed);
        assert_eq!(packed[0], 1);
        assert_eq!(f32::from_bits(packed[1]), 2.0);
        assert_eq!(packed[ROW_WORDS], 0);
        assert_eq!(packed[2 * ROW_WORDS..], e.arena()[..]);
        assert!(e.has_row(0) && e.has_row(1) && !e.has_row(2));
    }

    #[test]
    fn allowed_ids_and_masks_intersect_and_a_banned_rest_is_seen() {
        let mut e = LogitEdits::new();
        e.clear(70);
        let mut r = e.row(0);
        r.allow_only(&[1, 33, 40, 69]);
        // A grammar's mask of 64 tokens: 69 is past it, 40 is not in it.
        r.allow_mask(&[1 << 1, 1 << 1 | 1 << 2], 64);
        assert_eq!(r.mask(), &[1 << 1, 1 << 1, 0]);
        assert!(r.any_allowed());
        r.ban([1, 33].into_iter());
        assert!(!r.any_allowed(), "every token the mask allows is banned");
        r.cancel();
        assert!(e.is_empty() && e.arena().is_empty());
        let mut r = e.row(3);
        r.ban([0, 1].into_iter());
        assert!(r.any_allowed());
    }
}
