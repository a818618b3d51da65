//! One engine step: build the batch, run the forward pass (with the LoRA hook when any row
//! has an adapter), sample, stream, and publish statistics.

use super::*;

impl Core {
    /// One engine step. False when nothing could be scheduled.
    pub(super) fn step(&mut self) -> bool {
        self.step_no += 1;
        if !self.schedule() {
            return false;
        }
        self.prof(1);
        // Build the batch.
        self.batch.clear(self.stride);
        self.seq_adapters.clear();
        let mean_pooling = self.embedding.as_ref().is_some_and(|e| e.pooling == quiver_model::Pooling::Mean);
        for &(si, chunk) in &self.sched {
            let s = self.seqs[si].as_ref().expect("scheduled sequence");
            let end = s.num_computed + chunk;
            let want = if mean_pooling || self.scores_prompt_rows(si, s.num_computed, end) {
                LogitsFor::All
            } else if end == s.tokens.len() {
                LogitsFor::Last
            } else {
                LogitsFor::None
            };
            self.batch.push_seq(&s.tokens[s.num_computed..end], s.num_computed, &s.blocks, want);
            self.seq_adapters.push(self.reqs[s.req].as_ref().expect("live request").adapter);
            if !(chunk == 1 && end == s.tokens.len()) {
                self.counters.prefill_tokens += chunk as u64;
            }
        }
        self.prof(2);
        // Forward.
        let any_lora = self.seq_adapters.iter().any(|a| a.is_some());
        if any_lora {
            self.count_slot_loads();
            let hook = self.manager.prepare_batch(&self.seq_adapters, &self.batch.seq_starts, &self.batch.logits_rows);
            match hook {
                Ok(hook) => {
                    if self.embedding.is_some() {
                        self.model.forward_hidden(&self.batch, &mut self.kv, &mut self.ws, &hook as &dyn LoraHook);
                    } else {
                        self.model.forward_on_device(&self.batch, &mut self.kv, &mut self.ws, &hook as &dyn LoraHook);
                    }
                }
                Err(e) => {
                    self.fail_unresident(e);
                    for &(si, _) in &self.sched {
                        if let Some(s) = self.seqs[si].as_mut() {
                            s.scheduled = false;
                        }
                    }
                    return true;
                }
            }
        } else if self.embedding.is_some() {
            self.model.forward_hidden(&self.batch, &mut self.kv, &mut self.ws, &NoLora);
        } else {
            self.model.forward_on_device(&self.batch, &mut self.kv, &mut self.ws, &NoLora);
        }
        if self.embedding.is_some() {
            let sched = std::mem::take(&mut self.sched);
            let mut row = 0;
            for &(si, chunk) in &sched {
                let s = self.seq_mut(si);
                s.scheduled = false;
                s.num_computed += chunk;
                self.register_blocks(si);
                row += self.take_embedding_rows(si, chunk, row);
            }
            self.sched = sched;
            self.sched.clear();
            return true;
        }
        // The logits come to the host only when a row needs them there (prompt logprobs, or a
        // draw with penalties, a grammar or a min_tokens ban); every other draw happens on the
        // device and only its token (and logprobs) comes back.
        let need_host = self.sched.iter().any(|&(si, chunk)| {
            let s = self.seq(si);
            let end = s.num_computed + chunk;
            self.scores_prompt_rows(si, s.num_computed, end) || (end == s.tokens.len() && !self.draws_on_device(si))
        });
        self.prepare_masks();
        self.prof(3);
        if need_host {
            self.model.logits_to_host(&mut self.ws, self.batch.logits_rows.len());
        }
        self.prof(4);
        let mut row = 0;
        let sched = std::mem::take(&mut self.sched);
        let mut to_sample = std::mem::take(&mut self.to_sample);
        to_sample.clear();
        for &(si, chunk) in &sched {
            let start = self.seq(si).num_computed;
            let scored = self.scores_prompt_rows(si, start, start + chunk);
            let s = self.seq_mut(si);
            s.scheduled = false;
            s.num_computed += chunk;
            let wants = s.num_computed == s.tokens.len();
            self.register_blocks(si);
            if scored {
                self.score_prompt_rows(si, row, start, start + chunk);
                row += chunk;
            } else if wants {
                row += 1;
            }
            if wants && self.finish_prompt(si) {
                if self.req(self.seq(si).req).forked {
                    to_sample.push((si, row - 1, HOST_DRAW));
                } else {
                    // A request's first token: its n sequences are made now, each drawing
                    // from the same row.
                    to_sample.extend(self.fork(si).into_iter().map(|s| (s, row - 1, HOST_DRAW)));
                }
            }
        }
        self.prof(5);
        // The device's draws, in one call.
        self.specs.clear();
        for d in to_sample.iter_mut() {
            if self.draws_on_device(d.0) {
                d.2 = self.specs.len() as u32;
                let spec = self.device_spec(d.0, d.1);
                self.specs.push(spec);
            }
        }
        if !self.specs.is_empty() {
            self.sampled.resize(self.specs.len(), SampleOut::default());
            self.model.sample(&self.ws, &self.specs, &mut self.sampled);
        }
        self.prof(6);
        let vocab = self.model.config.vocab_size;
        let mut logits = std::mem::take(&mut self.logits_buf);
        for &(si, row, spec) in &to_sample {
            if spec == HOST_DRAW {
                logits.clear();
                logits.extend_from_slice(&self.ws.host_logits[row * vocab..(row + 1) * vocab]);
                self.sample_one(si, &logits);
            } else {
                let o = self.sampled[spec as usize];
                let want_lp = self.req(self.seq(si).req).logprobs.is_some();
                let lp = want_lp.then(|| TokenLogprob { logprob: o.logprob, top: (0..o.n_top as usize).map(|k| (o.top_ids[k], o.top_logprobs[k])).collect(), rank: o.rank });
                self.seq_mut(si).sampler.advance();
                self.accept_token(si, o.token, lp, false);
            }
        }
        self.logits_buf = logits;
        if let Some(p) = self.profile.as_mut() {
            p.end_step(sched.len(), self.batch.tokens.len());
        }
        self.to_sample = to_sample;
        self.sched = sched;
        self.sched.clear();
        true
    }

    /// Grammar masks of this step's constrained draws, computed in parallel while the device
    /// runs the forward pass (a mask depends on the grammar's state, not on the logits).
    fn prepare_masks(&mut self) {
        use rayon::prelude::*;
        let mut guided = std::mem::take(&mut self.guided_buf);
        guided.clear();
        for &(si, chunk) in &self.sched {
            let s = self.seq(si);
            if s.guide.is_some() && s.num_computed + chunk == s.tokens.len() {
                guided.push(si);
            }
        }
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

    pub(super) fn count_slot_loads(&mut self) {
        self.keys_buf.clear();
        for k in self.seq_adapters.iter().flatten() {
            if !self.keys_buf.contains(&Some(*k)) {
                self.keys_buf.push(Some(*k));
            }
        }
        let mut loads = 0;
        for k in self.keys_buf.iter().flatten() {
            if !self.manager.is_resident(*k) {
                loads += 1;
            }
        }
        if loads > 0 {
            let resident = self.manager.resident().len();
            let free = self.manager.pool().num_slots() - resident;
            self.counters.slot_loads += loads;
            self.counters.slot_evictions += loads.saturating_sub(free as u64);
        }
    }

    /// `prepare_batch` failed (e.g. an evicted adapter's files changed on disk): fail the
    /// requests whose adapter could not be made resident.
    pub(super) fn fail_unresident(&mut self, e: LoraError) {
        tracing::warn!("LoRA batch preparation failed: {e}");
        let bad: Vec<AdapterKey> = self.seq_adapters.iter().flatten().copied().filter(|k| !self.manager.is_resident(*k)).collect();
        for ri in 0..self.reqs.len() {
            let hit = self.reqs[ri].as_ref().is_some_and(|r| r.adapter.is_some_and(|k| bad.contains(&k)));
            if hit {
                self.abort_request(ri, Some(format!("LoRA adapter could not be loaded into a slot: {e}")));
            }
        }
    }

    pub(super) fn register_blocks(&mut self, si: usize) {
        if !self.pool.prefix_cache_enabled() {
            return;
        }
        let bs = self.pool.block_size();
        let s = self.seqs[si].as_mut().expect("live sequence");
        if !s.chain_ok {
            return;
        }
        let root = self.reqs[s.req].as_ref().expect("live request").adapter;
        let full = s.num_computed / bs;
        while s.num_registered < full {
            let b = s.num_registered;
            let parent = if b == 0 { Parent::Root(root) } else { Parent::Block(s.blocks[b - 1]) };
            if !self.pool.register(s.blocks[b], parent, &s.tokens[b * bs..(b + 1) * bs]) {
                s.chain_ok = false;
                return;
            }
            s.num_registered += 1;
        }
    }

    pub(super) fn sample_one(&mut self, si: usize, logits: &[f32]) {
        let mut work = std::mem::take(&mut self.work_buf);
        work.clear();
        work.extend_from_slice(logits);
        let ri = self.seq(si).req;
        let (tok, logprob, grammar_done) = {
            let s = self.seqs[si].as_mut().expect("live sequence");
            let r = self.reqs[ri].as_ref().expect("live request");
            s.sampler.apply_penalties(&mut work);
            if s.tokens.len() - r.prompt_len < r.min_tokens {
                // vLLM's min_tokens: no token that would end the sequence may be drawn yet.
                let eos: &[u32] = if r.ignore_eos { &[] } else { &self.eos };
                for &t in r.stop_ids.iter().chain(eos) {
                    work[t as usize] = f32::NEG_INFINITY;
                }
            }
            if let Some(g) = s.guide.as_mut() {
                if let Err(e) = g.mask(&mut work) {
                    // Never stall the batch on a grammar that cannot go on: end this row.
                    s.stop_reason = Some(StopReason::Grammar(format!("grammar dead end: {e}")));
                    self.work_buf = work;
                    self.end_seq(si, FinishReason::Abort);
                    return;
                }
            }
            let tok = s.sampler.sample(&work);
            let lp = r.logprobs.map(|k| sampling::token_logprob(&work, tok, k));
            let grammar_done = match s.guide.as_mut().map(|g| g.advance(tok).map(|()| g.is_finished())) {
                Some(Err(e)) => {
                    tracing::warn!("constraint refused its own token {tok}: {e}");
                    true
                }
                Some(Ok(done)) => done,
                None => false,
            };
            (tok, lp, grammar_done)
        };
        self.work_buf = work;
        self.accept_token(si, tok, logprob, grammar_done);
    }

    /// Appends the drawn token `tok` to sequence `si`, streams its text and ends the sequence
    /// when a stop condition holds.
    pub(super) fn accept_token(&mut self, si: usize, tok: u32, logprob: Option<TokenLogprob>, grammar_done: bool) {
        let ri = self.seq(si).req;
        let tokenizer = self.tokenizer.clone();
        let (eos_hit, stop_id_hit) = {
            let s = self.seqs[si].as_mut().expect("live sequence");
            let r = self.reqs[ri].as_ref().expect("live request");
            s.sampler.observe(tok);
            s.tokens.push(tok);
            let stop_id_hit = r.stop_ids.contains(&tok);
            (stop_id_hit || (!r.ignore_eos && self.eos.contains(&tok)), stop_id_hit)
        };
        self.counters.generated += 1;
        let s = self.seqs[si].as_mut().expect("live sequence");
        let r = self.reqs[ri].as_ref().expect("live request");
        let completion = s.tokens.len() - r.prompt_len;
        let mut text = String::new();
        let mut finish = None;
        // Stop strings are searched only in text generated after min_tokens (as vLLM does).
        let checked = completion > r.min_tokens;
        let push = |stop: &mut StopScan, t: &str, text: &mut String| -> Option<StopReason> {
            if !checked {
                stop.push_unchecked(t, text);
                return None;
            }
            stop.push(t, &r.stop, r.include_stop, text).map(|i| StopReason::Text(r.stop[i].clone()))
        };
        if eos_hit {
            // The stop token's own text is shown only with include_stop_str_in_output; release
            // what was held back.
            let n = s.tokens.len() - usize::from(!r.include_stop);
            if let Some(t) = s.detok.flush(&tokenizer, &s.tokens[..n]) {
                s.stop_reason = push(&mut s.stop, &t, &mut text);
            }
            s.stop.flush(&mut text);
            if s.stop_reason.is_none() && stop_id_hit {
                s.stop_reason = Some(StopReason::Token(tok));
            }
            finish = Some(FinishReason::Stop);
        } else {
            if let Some(t) = s.detok.step(&tokenizer, &s.tokens) {
                s.stop_reason = push(&mut s.stop, &t, &mut text);
                if s.stop_reason.is_some() {
                    finish = Some(FinishReason::Stop);
                }
            }
            // A complete grammar ends the output like a length limit (its text is kept).
            if finish.is_none() && (completion >= r.max_tokens || grammar_done) {
                if let Some(t) = s.detok.flush(&tokenizer, &s.tokens) {
                    s.stop_reason = push(&mut s.stop, &t, &mut text);
                    if s.stop_reason.is_some() {
                        finish = Some(FinishReason::Stop);
                    }
                }
                if finish.is_none() {
                    s.stop.flush(&mut text);
                    finish = Some(if completion < r.max_tokens { FinishReason::Stop } else { FinishReason::Length });
                }
            }
        }
        let _ = r.tx.send(StreamEvent::Token { index: s.index, token_id: tok, text, logprob });
        if let Some(reason) = finish {
            self.end_seq(si, reason);
        }
    }

    pub(super) fn publish_stats(&mut self) {
        let mut st = self.shared.stats.lock().unwrap();
        st.running_seqs = self.running.len();
        st.kv_blocks_used = self.pool.num_in_use();
        st.kv_blocks_cached = self.pool.num_cached_idle();
        st.kv_blocks_free = self.pool.num_free();
        st.prefix_cache_queries = self.counters.prefix_queries;
        st.prefix_cache_hits = self.counters.prefix_hits;
        st.adapter_loads = self.counters.adapter_loads;
        st.adapter_load_failures = self.counters.adapter_load_failures;
        st.lora_slot_loads = self.counters.slot_loads;
        st.lora_slot_evictions = self.counters.slot_evictions;
        st.preemptions = self.counters.preemptions;
        st.steps = self.step_no;
        st.generated_tokens = self.counters.generated;
        st.prefill_tokens = self.counters.prefill_tokens;
        st.running = 0;
        st.waiting = 0;
        for a in st.per_adapter.iter_mut() {
            a.running = 0;
            a.waiting = 0;
        }
        let pending: usize = self.pending_load.values().map(|v| v.len()).sum();
        st.waiting += pending;
        for r in self.reqs.iter().flatten() {
            let running = r.seq_ids.iter().any(|&s| self.seqs[s].as_ref().is_some_and(|s| s.running));
            if running {
                st.running += 1;
            } else {
                st.waiting += 1;
            }
            if let Some(name) = &r.adapter_name {
                let e = match st.per_adapter.iter().position(|a| a.name == **name) {
                    Some(p) => &mut st.per_adapter[p],
                    None => {
                        st.per_adapter.push(AdapterStats { name: name.to_string(), ..Default::default() });
                        st.per_adapter.last_mut().unwrap()
                    }
                };
                if running {
                    e.running += 1;
                } else {
                    e.waiting += 1;
                }
            }
        }
        for (name, v) in &self.pending_load {
            match st.per_adapter.iter().position(|a| a.name == *name) {
                Some(p) => st.per_adapter[p].waiting += v.len(),
                None => st.per_adapter.push(AdapterStats { name: name.clone(), running: 0, waiting: v.len() }),
            }
        }
        st.per_adapter.retain(|a| a.running + a.waiting > 0);
    }
}
