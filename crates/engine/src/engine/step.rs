//! One engine step: build the batch, run the forward pass (with the LoRA hook when any row
//! has an adapter), commit its rows, accept the previous step's tokens (`overlap.rs`), draw
//! (`draw.rs`), stream, and publish statistics.

use super::*;

impl Core {
    /// One engine step. False when nothing could be scheduled and nothing was in flight.
    pub(super) fn step(&mut self) -> bool {
        self.step_no += 1;
        if !self.schedule() {
            // Nothing new can run; the step in flight (if any) still ends.
            return self.finish_in_flight();
        }
        self.prof(1);
        self.build_batch();
        self.prof(2);
        if !self.run_forward() {
            self.finish_in_flight();
            return true;
        }
        if self.embedding.is_some() {
            self.finish_embedding_step();
            return true;
        }
        self.prof(3);
        self.commit_rows();
        self.prof(5);
        // The previous step's tokens while this one runs (see `overlap.rs`), then this step's draws.
        self.finish_in_flight();
        self.draw();
        if let Some(p) = self.profile.as_mut() {
            p.end_step(self.sched.len(), self.batch.tokens.len(), || self.model.device.stats());
        }
        self.sched.clear();
        true
    }

    fn build_batch(&mut self) {
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
            // A decode row's token may still be a draw on the device (`sample::DRAWN`).
            self.batch.push_seq(&s.tokens[s.num_computed..end], s.num_computed, &s.blocks, want);
            self.seq_adapters.push(self.reqs[s.req].as_ref().expect("live request").adapter);
            if !(chunk == 1 && end == s.tokens.len()) {
                self.counters.prefill_tokens += chunk as u64;
            }
        }
    }

    /// Queues the forward pass of the built batch (with the LoRA hook when any row has an
    /// adapter). False when the adapters could not be made resident: their requests were
    /// failed and nothing ran.
    fn run_forward(&mut self) -> bool {
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
                    self.sched.clear();
                    return false;
                }
            }
        } else if self.embedding.is_some() {
            self.model.forward_hidden(&self.batch, &mut self.kv, &mut self.ws, &NoLora);
        } else {
            self.model.forward_on_device(&self.batch, &mut self.kv, &mut self.ws, &NoLora);
        }
        true
    }

    fn finish_embedding_step(&mut self) {
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
    }

    /// The scheduled rows are computed (queued on the device: nothing here reads their
    /// results). Decode rows go to `to_sample`; prompt rows that score prompt tokens or end the
    /// prompt to `prompt_rows`, handled in `draw` (scored rows need the logits on the host).
    fn commit_rows(&mut self) {
        let mut row = 0;
        self.to_sample.clear();
        self.prompt_rows.clear();
        for i in 0..self.sched.len() {
            let (si, chunk) = self.sched[i];
            let start = self.seq(si).num_computed;
            let scored = self.scores_prompt_rows(si, start, start + chunk);
            let prompt_len = self.req(self.seq(si).req).prompt_len;
            let s = self.seq_mut(si);
            s.scheduled = false;
            s.num_computed += chunk;
            let wants_token = s.num_computed == s.tokens.len();
            let uid = s.uid;
            self.register_blocks(si);
            if scored || (wants_token && start + chunk <= prompt_len) {
                self.prompt_rows.push(PromptRows { seq: si, row, start, end: start + chunk, scored, wants_token });
            } else if wants_token {
                self.to_sample.push(Draw { seq: si, uid, row, spec: NO_SPEC });
            }
            row += if scored { chunk } else { usize::from(wants_token) };
        }
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
        // A block is keyed by its tokens: one holding a draw still on the device waits for it.
        let known = s.tokens.len() - usize::from(s.draw_in_flight());
        let full = s.num_computed.min(known) / bs;
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
        st.overlapped_steps = self.counters.overlapped_steps;
        st.logits_to_host_steps = self.counters.logits_to_host_steps;
        st.edited_rows = self.counters.edited_rows;
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
