//! A step's draws: every one on the model's device, after the logit edits its row needs
//! (penalties, logit bias, allowed ids, a `min_tokens` ban, a grammar's mask; one packed
//! description for the step, `quiver_kernels::logit_edits`); the prompt rows that score the
//! prompt (the only rows whose logits come to the host) or end it (forking `n > 1` at the first
//! token); and the synchronous path that accepts every token before the step ends. The
//! overlapped path is `overlap.rs`.

use super::*;

impl Core {
    /// This step's draws, once the previous step's tokens have been accepted
    /// (`finish_in_flight`): a sequence that ended with them draws nothing, and every
    /// sequence's state (penalties, grammar, token count) is up to date, so its edits are.
    pub(super) fn draw(&mut self) {
        let mut to_sample = std::mem::take(&mut self.to_sample);
        let prompt_rows = std::mem::take(&mut self.prompt_rows);
        // Rows of sequences that ended with the previous step's token were wasted.
        to_sample.retain(|d| self.live(d.seq, d.uid));
        // The logits come to the host only to score prompt rows (prompt logprobs); every draw
        // happens on the device and only its token (and logprobs) comes back.
        let need_host = prompt_rows.iter().any(|p| p.scored);
        self.prepare_masks(&to_sample, &prompt_rows);
        if need_host {
            self.model.logits_to_host(&mut self.ws, self.batch.logits_rows.len());
            self.counters.logits_to_host_steps += 1;
        }
        self.prof(4);
        for p in &prompt_rows {
            if p.scored {
                self.score_prompt_rows(p.seq, p.row, p.start, p.end);
            }
            if !p.wants_token || !self.finish_prompt(p.seq) {
                continue;
            }
            // The prompt's last row: the chunk's last when every row has logits.
            let row = if p.scored { p.row + (p.end - p.start) - 1 } else { p.row };
            if self.req(self.seq(p.seq).req).forked {
                to_sample.push(Draw { seq: p.seq, uid: self.seq(p.seq).uid, row, spec: NO_SPEC });
            } else {
                // A request's first token: its n sequences are made now, each drawing from the
                // same row.
                for c in self.fork(p.seq) {
                    to_sample.push(Draw { seq: c, uid: self.seq(c).uid, row, spec: NO_SPEC });
                }
            }
        }
        self.prof(5);
        self.specs.clear();
        self.edits.clear(self.model.config.vocab_size);
        for d in to_sample.iter_mut() {
            match self.push_edits(d.seq, d.row) {
                Ok(()) => {
                    d.spec = self.specs.len() as u32;
                    let spec = self.device_spec(d.seq, d.row);
                    self.specs.push(spec);
                }
                Err(e) => {
                    // Never stall the batch on a grammar that cannot go on: end this row.
                    self.seq_mut(d.seq).stop_reason = Some(StopReason::Grammar(format!("grammar dead end: {e}")));
                    self.end_seq(d.seq, FinishReason::Abort);
                }
            }
        }
        to_sample.retain(|d| d.spec != NO_SPEC);
        if !self.edits.is_empty() {
            self.model.edit_logits(&mut self.ws, &self.edits);
            self.counters.edited_rows += self.edits.rows().len() as u64;
        }
        // A step whose prompt rows were scored runs to its end; so does every step without overlap.
        if self.overlap && !need_host {
            self.launch_in_flight(&to_sample);
        } else {
            self.draw_now(&to_sample);
        }
        self.to_sample = to_sample;
        let mut prompt_rows = prompt_rows;
        prompt_rows.clear();
        self.prompt_rows = prompt_rows;
    }

    /// Draws and accepts every token of `draws` now, in one call to the device.
    fn draw_now(&mut self, draws: &[Draw]) {
        if !self.specs.is_empty() {
            if self.sampled.len() < self.specs.len() {
                self.sampled.resize(self.specs.len(), SampleOut::default());
            }
            self.model.sample(&self.ws, &self.specs, &mut self.sampled);
        }
        self.prof(6);
        for d in draws {
            if !self.live(d.seq, d.uid) {
                continue;
            }
            self.seq_mut(d.seq).sampler.advance();
            self.accept_sampled(d.seq, d.spec as usize);
        }
    }

    /// The logit edits of `si`'s draw from logits row `row`, into `edits`: its sampler's bias,
    /// allowed ids and penalties, vLLM's `min_tokens` ban on ending tokens, its grammar's mask
    /// (taken now, so the grammar's next mask is computed after its next token). Err: the
    /// grammar is at a dead end, an error state or nothing it allows left to draw (on the
    /// host that was "no allowed token with a finite logit"; here the logits are taken as
    /// finite, which the model's always are).
    fn push_edits(&mut self, si: usize, row: usize) -> Result<(), String> {
        let Core { seqs, reqs, eos, edits, .. } = self;
        let s = seqs[si].as_mut().expect("live sequence");
        let r = reqs[s.req].as_ref().expect("live request");
        let ban = s.tokens.len() - r.prompt_len < r.min_tokens;
        let mask = s.guide.as_mut().map(|g| g.next_mask()).transpose()?;
        // A fork's samples draw their first token from one row with the same edits (one
        // request, nothing generated yet, grammars in one state): the row is edited once.
        if !(ban || mask.is_some() || s.sampler.needs_edits()) || edits.has_row(row as u32) {
            return Ok(());
        }
        let mut e = edits.row(row as u32);
        s.sampler.push_edits(&mut e);
        if ban {
            let eos: &[u32] = if r.ignore_eos { &[] } else { eos };
            e.ban(r.stop_ids.iter().chain(eos).copied());
        }
        if let Some(m) = mask {
            e.allow_mask(m.as_slice(), m.len());
            if !e.any_allowed() {
                e.cancel();
                return Err("no token the grammar allows can be drawn".into());
            }
        }
        Ok(())
    }

    /// Accepts the device's draw `i` (in `sampled`) for sequence `si`, with its logprobs when
    /// the request asked for them.
    pub(super) fn accept_sampled(&mut self, si: usize, i: usize) {
        let o = self.sampled[i];
        let want_lp = self.req(self.seq(si).req).logprobs.is_some();
        let lp = want_lp.then(|| TokenLogprob { logprob: o.logprob, top: (0..o.n_top as usize).map(|k| (o.top_ids[k], o.top_logprobs[k])).collect(), rank: o.rank });
        // The grammar advances with the token before anything else sees it: its next mask
        // depends on it.
        let grammar_done = match self.seq_mut(si).guide.as_mut().map(|g| g.advance(o.token).map(|()| g.is_finished())) {
            Some(Err(e)) => {
                tracing::warn!("constraint refused its own token {}: {e}", o.token);
                true
            }
            Some(Ok(done)) => done,
            None => false,
        };
        self.accept_token(si, o.token, lp, grammar_done);
    }

    /// Whether `si` is the sequence `uid` names (alive, its slot not reused since).
    pub(super) fn live(&self, si: usize, uid: u64) -> bool {
        self.seqs[si].as_ref().is_some_and(|s| s.uid == uid)
    }

    /// Grammar masks of this step's constrained draws, computed in parallel (a mask depends on
    /// the grammar's state, not on the logits) while the device runs the forward pass.
    fn prepare_masks(&mut self, draws: &[Draw], prompt_rows: &[PromptRows]) {
        use rayon::prelude::*;
        let mut guided = std::mem::take(&mut self.guided_buf);
        guided.clear();
        let drawing = draws.iter().map(|d| d.seq).chain(prompt_rows.iter().filter(|p| p.wants_token).map(|p| p.seq));
        guided.extend(drawing.filter(|&si| self.seq(si).guide.is_some()));
        if !guided.is_empty() {
            guided.sort_unstable();
            self.seqs.par_iter_mut().enumerate().filter(|(i, _)| guided.binary_search(i).is_ok()).for_each(|(_, s)| {
                if let Some(g) = s.as_mut().and_then(|s| s.guide.as_mut()) {
                    g.prepare();
                }
            });
        }
        self.guided_buf = guided;
    }

    fn device_spec(&self, si: usize, row: usize) -> SampleSpec {
        let s = self.seq(si);
        let lp = self.req(s.req).logprobs.map_or(-1, |k| k as i32);
        s.sampler.spec(row as u32, lp)
    }
}
