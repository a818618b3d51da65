//! Overlapped scheduling: step N+1 is scheduled, built and queued on the device before step
//! N's draws are collected, so the host's work between two forward passes (accepting tokens,
//! detokenizing, stop strings, streaming, then scheduling, block allocation, prefix matching
//! and staging the next batch) runs while the device computes, as vLLM V1's and SGLang's
//! overlap schedulers do. On a host device (CPU) every op has finished when it returns, so the
//! loop is the same and only the order of the host's work changes.
//!
//! # The loop
//! Each step: schedule N+1 → build its batch → queue its forward → commit its rows → collect
//! N's draws and accept them (`finish_in_flight`) → launch N+1's draws (`launch_in_flight`).
//! A sequence that drew at N and runs again at N+1 has no token to feed yet: its N+1 input is
//! `sample::DRAWN | i` (draw `i` of N's launch), which the device resolves from its own copy
//! of the draws before the embedding (`Device::resolve_drawn`). Between the launch and the
//! collect that id is the sequence's last token on the host too.
//!
//! # Invariants
//! - At most one step's draws are in flight (`in_flight`, in spec order, with each sequence's
//!   `uid`), and only between the end of one step and the collect in the next; then no
//!   sequence holds a `DRAWN` id. A sequence holds at most one, always its last token.
//! - Nothing visible happens for a draw before it is collected: a sequence that ended in the
//!   meantime (EOS or a stop string in N's token, cancellation, an abort) has no live `uid`, so
//!   its N+1 token is dropped unseen and its N+1 row was wasted. Its blocks were freed at once:
//!   the N+1 row may still write its own (unregistered, partial) last block on the device, but
//!   any later owner's writes are queued behind it.
//! - A sequence whose in-flight token is its `max_tokens`-th is not scheduled again.
//! - Prefix-cache blocks are registered only over known tokens (`register_blocks` stops before
//!   a `DRAWN` id), and after acceptance only if the sequence lives on, so the cache holds what
//!   the synchronous engine's would.
//! - The seeded draw counter advances at launch: the next step's spec counts the draw in flight.
//! - A preempted sequence may hold a `DRAWN` id in the waiting queue; nothing is admitted in a
//!   step that preempted, and the id is resolved before the next schedule.
//! - Rows with logit edits (penalties, logit bias, allowed ids, a `min_tokens` ban, a grammar's
//!   mask) overlap like any other. Their edits for N+1 depend on N's token (the counts, the
//!   number generated, the grammar's state), so they are made after N's draws are collected
//!   and accepted, the grammar advanced by its token first (`accept_sampled`), while N+1's
//!   forward runs: only N+1's draw, queued after its edits, waits for them (as vLLM computes
//!   step N+1's grammar bitmask once N's token is known). N+1's forward itself never depends
//!   on them, so no row needs to be held back.
//! - A step that scores prompt rows (prompt logprobs: the only logits that come to the host)
//!   is synchronous: its forward is still queued before N's tokens are accepted, but its own
//!   draws are collected before it ends (`Core::draw_now`). Embedding engines never overlap.

use super::*;
use quiver_kernels::sample::DRAWN;

impl Seq {
    /// Whether the last token is a draw not yet collected (`sample::DRAWN`).
    pub(super) fn draw_in_flight(&self) -> bool {
        self.tokens.last().is_some_and(|&t| t & DRAWN != 0)
    }
}

impl Core {
    /// Launches this step's draws (all on the device) and leaves them in flight: each sequence
    /// gets its `DRAWN` id and its random stream advances now.
    pub(super) fn launch_in_flight(&mut self, draws: &[Draw]) {
        debug_assert!(self.in_flight.is_empty(), "a step's draws launched before the previous step's were collected");
        if self.specs.is_empty() {
            return;
        }
        self.model.sample_launch(&self.ws, &self.specs);
        self.counters.overlapped_steps += 1;
        self.prof(6);
        for d in draws {
            debug_assert_eq!(d.spec as usize, self.in_flight.len(), "every draw of an overlapped step is on the device, in spec order");
            let s = self.seq_mut(d.seq);
            s.tokens.push(DRAWN | d.spec);
            s.sampler.advance();
            self.in_flight.push((d.seq, d.uid));
        }
    }

    /// Collects the draws in flight and accepts each whose sequence is still the one it was
    /// drawn for. False when nothing was in flight.
    pub(super) fn finish_in_flight(&mut self) -> bool {
        if self.in_flight.is_empty() {
            return false;
        }
        let n = self.in_flight.len();
        if self.sampled.len() < n {
            self.sampled.resize(n, SampleOut::default());
        }
        self.model.sample_collect(&mut self.sampled[..n]);
        self.prof(6);
        let in_flight = std::mem::take(&mut self.in_flight);
        for (i, &(si, uid)) in in_flight.iter().enumerate() {
            if !self.live(si, uid) {
                continue;
            }
            let placeholder = self.seq_mut(si).tokens.pop();
            debug_assert_eq!(placeholder, Some(DRAWN | i as u32));
            self.accept_sampled(si, i);
            if self.live(si, uid) {
                self.register_blocks(si);
            }
        }
        let mut in_flight = in_flight;
        in_flight.clear();
        self.in_flight = in_flight;
        self.prof(7);
        true
    }

    /// Whether `si`'s draw in flight is its last allowed token (`max_tokens`): it ends when
    /// collected, so it is not scheduled again.
    pub(super) fn final_draw_in_flight(&self, si: usize) -> bool {
        let s = self.seq(si);
        s.draw_in_flight() && s.tokens.len() - self.req(s.req).prompt_len >= self.req(s.req).max_tokens
    }
}
