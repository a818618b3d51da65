//! A step's draws: which happen on the model's device and which on the host, the prompt rows
//! that score the prompt or end it (forking `n > 1` at the first token), and the synchronous
//! path that accepts every token before the step ends. The overlapped path is `overlap.rs`.

use super::*;

impl Core {
    /// This step's draws, once the previous step's tokens have been accepted
    /// (`finish_in_flight`): a sequence that ended with them draws nothing, and every
    /// sequence's state (penalties, grammar, token count) is up to date.
    pub(super) fn draw(&mut self) {
        let mut to_sample = std::mem::take(&mut self.to_sample);
        let prompt_rows = std::mem::take(&mut self.prompt_rows);
        // Rows of sequences that ended with the previous step's token were wasted.
        to_sample.retain(|d| self.live(d.seq, d.uid));
        // The logits come to the host only when a row needs them there (prompt logprobs, or a
        // draw with penalties, a grammar or a min_tokens ban); every other draw happens on the
        // device and only its token (and logprobs) comes back.
        let need_host = prompt_rows.iter().any(|p| p.scored || (p.wants_token && !self.draws_on_device(p.seq))) || to_sample.iter().any(|d| !self.draws_on_device(d.seq));
        self.prepare_masks(&to_sample, &prompt_rows);
        if need_host {
            self.model.logits_to_host(&mut self.ws, self.batch.logits_rows.len());
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
                to_sample.push(Draw { seq: p.seq, uid: self.seq(p.seq).uid, row, spec: HOST_DRAW });
            } else {
                // A request's first token: its n sequences are made now, each drawing from the
                // same row.
                for c in self.fork(p.seq) {
                    to_sample.push(Draw { seq: c, uid: self.seq(c).uid, row, spec: HOST_DRAW });
                }
            }
        }
        self.prof(5);
        self.specs.clear();
        for d in to_sample.iter_mut() {
            if self.draws_on_device(d.seq) {
                d.spec = self.specs.len() as u32;
                let spec = self.device_spec(d.seq, d.row);
                self.specs.push(spec);
            }
        }
        // A step whose rows needed the host runs to its end; so does every step without overlap.
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

    /// Draws and accepts every token of `draws` now: the device's in one call, the host's from
    /// the logits copied down.
    fn draw_now(&mut self, draws: &[Draw]) {
        if !self.specs.is_empty() {
            if self.sampled.len() < self.specs.len() {
                self.sampled.resize(self.specs.len(), SampleOut::default());
            }
            self.model.sample(&self.ws, &self.specs, &mut self.sampled);
        }
        self.prof(6);
        self.host_draws(draws);
        let mut host = std::mem::take(&mut self.host_drawn);
        for d in draws {
            if !self.live(d.seq, d.uid) {
                continue;
            }
            if d.spec == HOST_DRAW {
                let i = host.binary_search_by_key(&d.seq, |h| h.0).expect("host draw made for every live host row");
                match std::mem::replace(&mut host[i].1, HostDraw::Taken) {
                    HostDraw::Token { tok, logprob, grammar_done } => self.accept_token(d.seq, tok, logprob, grammar_done),
                    HostDraw::DeadEnd(e) => {
                        // Never stall the batch on a grammar that cannot go on: end this row.
                        self.seq_mut(d.seq).stop_reason = Some(StopReason::Grammar(format!("grammar dead end: {e}")));
                        self.end_seq(d.seq, FinishReason::Abort);
                    }
                    HostDraw::Taken => unreachable!("a sequence draws once a step"),
                }
            } else {
                self.seq_mut(d.seq).sampler.advance();
                self.accept_sampled(d.seq, d.spec as usize);
            }
        }
        self.host_drawn = host;
    }

    /// The host's draws of `draws` (penalties, the min_tokens ban, the grammar's mask, the
    /// sample, its logprobs) into `host_drawn`, sorted by sequence. Each is its row's own work
    /// over its own sampler and grammar, so rows run in parallel (a 256-row GPU step with half
    /// its rows under a grammar spent ~40 ms drawing them one after another over a 128k
    /// vocabulary); accepting the tokens stays in draw order (`draw_now`).
    fn host_draws(&mut self, draws: &[Draw]) {
        use rayon::prelude::*;
        let mut rows = std::mem::take(&mut self.host_rows);
        rows.clear();
        rows.extend(draws.iter().filter(|d| d.spec == HOST_DRAW && self.live(d.seq, d.uid)).map(|d| (d.seq, d.row)));
        rows.sort_unstable();
        let mut out = std::mem::take(&mut self.host_drawn);
        out.clear();
        if !rows.is_empty() {
            let vocab = self.model.config.vocab_size;
            let (reqs, eos, logits, rows) = (&self.reqs, &self.eos, &self.ws.host_logits, &rows);
            let drawn = self.seqs.par_iter_mut().enumerate().filter_map(|(si, s)| {
                let k = rows.binary_search_by_key(&si, |r| r.0).ok()?;
                let s = s.as_mut().expect("live sequence");
                let r = reqs[s.req].as_ref().expect("live request");
                let row = rows[k].1;
                Some((si, host_draw(s, r, eos, &logits[row * vocab..(row + 1) * vocab])))
            });
            out.par_extend(drawn);
        }
        self.host_rows = rows;
        self.host_drawn = out;
    }

    /// Accepts the device's draw `i` (in `sampled`) for sequence `si`, with its logprobs when
    /// the request asked for them.
    pub(super) fn accept_sampled(&mut self, si: usize, i: usize) {
        let o = self.sampled[i];
        let want_lp = self.req(self.seq(si).req).logprobs.is_some();
        let lp = want_lp.then(|| TokenLogprob { logprob: o.logprob, top: (0..o.n_top as usize).map(|k| (o.top_ids[k], o.top_logprobs[k])).collect(), rank: o.rank });
        self.accept_token(si, o.token, lp, false);
    }

    /// Whether `si` is the sequence `uid` names (alive, its slot not reused since).
    pub(super) fn live(&self, si: usize, uid: u64) -> bool {
        self.seqs[si].as_ref().is_some_and(|s| s.uid == uid)
    }

    /// Grammar masks of this step's constrained draws, computed in parallel (a mask depends on
    /// the grammar's state, not on the logits) before the logits are waited for.
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

    /// Whether sequence `si`'s next draw can happen on the model's device: nothing about it
    /// needs the host's view of the logits.
    pub(super) fn draws_on_device(&self, si: usize) -> bool {
        let s = self.seq(si);
        let r = self.req(s.req);
        s.guide.is_none() && !s.sampler.needs_host() && s.tokens.len() - r.prompt_len >= r.min_tokens
    }

    fn device_spec(&self, si: usize, row: usize) -> SampleSpec {
        let s = self.seq(si);
        let lp = self.req(s.req).logprobs.map_or(-1, |k| k as i32);
        s.sampler.spec(row as u32, lp)
    }
}

/// A host draw's outcome, before it is accepted.
pub(super) enum HostDraw {
    Token { tok: u32, logprob: Option<TokenLogprob>, grammar_done: bool },
    /// The grammar allows no token: the row ends.
    DeadEnd(String),
    /// Accepted already (the slot is reused next step).
    Taken,
}

thread_local! {
    /// A row's logits as the draw edits them (penalties, bans, mask); one per thread, reused.
    static WORK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Sequence `s`'s next token from its row's `logits`, on the host: penalties, vLLM's min_tokens
/// ban on ending tokens, the grammar's mask, the draw and its logprobs, and the grammar advanced.
fn host_draw(s: &mut Seq, r: &Req, eos: &[u32], logits: &[f32]) -> HostDraw {
    WORK.with_borrow_mut(|work| {
        work.clear();
        work.extend_from_slice(logits);
        s.sampler.apply_penalties(work);
        if s.tokens.len() - r.prompt_len < r.min_tokens {
            // vLLM's min_tokens: no token that would end the sequence may be drawn yet.
            let eos: &[u32] = if r.ignore_eos { &[] } else { eos };
            for &t in r.stop_ids.iter().chain(eos) {
                work[t as usize] = f32::NEG_INFINITY;
            }
        }
        if let Some(g) = s.guide.as_mut() {
            if let Err(e) = g.mask(work) {
                return HostDraw::DeadEnd(e.to_string());
            }
        }
        let tok = s.sampler.sample(work);
        let logprob = r.logprobs.map(|k| sampling::token_logprob(work, tok, k));
        let grammar_done = match s.guide.as_mut().map(|g| g.advance(tok).map(|()| g.is_finished())) {
            Some(Err(e)) => {
                tracing::warn!("constraint refused its own token {tok}: {e}");
                true
            }
            Some(Ok(done)) => done,
            None => false,
        };
        HostDraw::Token { tok, logprob, grammar_done }
    })
}
