//! The scheduler: decode rows, prefill chunks and admissions within the step's limits,
//! preemption when KV blocks run out (see the module docs of `engine`).

use super::*;

impl Core {
    pub(super) fn preempt(&mut self, si: usize) {
        tracing::debug!(request = self.req(self.seq(si).req).id, seq = si, "preempting sequence (recompute)");
        self.counters.preemptions += 1;
        self.release_blocks(si);
        self.remove_running(si);
        // Recomputed from its first token: what it had pooled goes too.
        let ri = self.seq(si).req;
        if let Some(e) = self.req_mut(ri).embed.as_mut() {
            e.pool.reset();
        }
        let step = self.step_no;
        let s = self.seq_mut(si);
        s.num_computed = 0;
        s.num_registered = 0;
        s.chain_ok = true;
        s.waiting_since = step;
        if s.scheduled {
            s.scheduled = false;
            if let Some(p) = self.sched.iter().position(|&(x, _)| x == si) {
                self.sched.remove(p);
            }
        }
        self.waiting.push_front(si);
    }

    /// Makes sure `si` has blocks for `upto` tokens, preempting newer sequences if needed.
    /// False if `si` itself had to be preempted.
    pub(super) fn grow_blocks(&mut self, si: usize, upto: usize) -> bool {
        let bs = self.pool.block_size();
        let need = upto.div_ceil(bs).saturating_sub(self.seq(si).blocks.len());
        while self.pool.available() < need {
            let victim = *self.running.last().expect("si is running");
            self.preempt(victim);
            if victim == si {
                return false;
            }
        }
        for _ in 0..need {
            let b = self.pool.allocate().expect("checked available");
            self.seq_mut(si).blocks.push(b);
        }
        true
    }

    /// The token budget of a step whose decode rows take `decode` tokens of it
    /// (`EngineConfig::mixed_step_tokens`).
    fn step_token_limit(&self, decode: usize) -> usize {
        let (mixed, max) = (self.cfg.mixed_step_tokens, self.cfg.max_num_batched_tokens);
        if mixed > 0 && decode + crate::config::MIXED_STEP_MIN_PROMPT <= mixed {
            mixed.min(max)
        } else {
            max
        }
    }

    pub(super) fn schedule(&mut self) -> bool {
        let mut limit = self.cfg.max_num_batched_tokens;
        let mut budget = limit;
        self.sched.clear();
        let mut preempted = false;
        // Decode rows first, then running prefills, both oldest first.
        for pass in 0..2 {
            if pass == 1 {
                // The decode rows are in: what is left of this step's budget is for prompts.
                let decode: usize = self.sched.iter().map(|x| x.1).sum();
                limit = self.step_token_limit(decode);
                budget = limit.saturating_sub(decode);
            }
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let si = self.running[i];
                let s = self.seq(si);
                let remaining = s.tokens.len() - s.num_computed;
                let is_decode = remaining == 1;
                if (pass == 0) != is_decode || s.scheduled || (is_decode && self.final_draw_in_flight(si)) {
                    i += 1;
                    continue;
                }
                // Weights dropped from host memory and out of their slot: they are being read
                // again on the loader thread; the sequence waits, everyone else runs.
                if let Some(k) = self.req(s.req).adapter {
                    if !self.adapter_ready(k) {
                        i += 1;
                        continue;
                    }
                }
                let s = self.seq(si);
                let chunk = remaining.min(budget).min(if is_decode { 1 } else { self.prefill_cap(si) });
                let upto = s.num_computed + chunk;
                let before = self.preemptions_now();
                if !self.grow_blocks(si, upto) {
                    preempted = true;
                    break;
                }
                if self.preemptions_now() != before {
                    preempted = true;
                    // Victims scheduled earlier gave their budget back.
                    budget = limit.saturating_sub(self.sched.iter().map(|x| x.1).sum::<usize>());
                }
                self.sched.push((si, chunk));
                self.seq_mut(si).scheduled = true;
                budget -= chunk;
                i += 1;
            }
        }
        if !preempted {
            self.admit(&mut budget);
        }
        !self.sched.is_empty()
    }

    pub(super) fn preemptions_now(&self) -> u64 {
        self.counters.preemptions
    }

    /// Admission from the waiting queue (see the module docs for the rules).
    pub(super) fn admit(&mut self, budget: &mut usize) {
        if self.waiting.is_empty() {
            return;
        }
        let bs = self.pool.block_size();
        let head = self.waiting[0];
        let strict = self.step_no.saturating_sub(self.seq(head).waiting_since) >= self.cfg.aging_steps;
        // Candidate order: queue order, or longest prefix match first.
        self.cand_buf.clear();
        let scan = self.waiting.len().min(256);
        for qi in 0..scan {
            self.cand_buf.push((qi, 0));
        }
        if self.cfg.schedule_policy == SchedulePolicy::Lpm && !strict && self.pool.prefix_cache_enabled() {
            for c in 0..self.cand_buf.len() {
                let si = self.waiting[self.cand_buf[c].0];
                let max_blocks = self.max_prefix_blocks(si);
                let s = self.seqs[si].as_ref().expect("waiting sequence");
                let key = self.reqs[s.req].as_ref().expect("live request").adapter;
                self.pool.match_prefix(key, &s.tokens, max_blocks, &mut self.match_buf);
                self.cand_buf[c].1 = self.match_buf.len();
            }
            self.cand_buf.sort_by_key(|&(qi, m)| (std::cmp::Reverse(m), qi));
        }
        let watermark = if self.running.is_empty() { 0 } else { (self.pool.num_blocks() / 100).max(1) };
        let mut admitted_q: Vec<usize> = Vec::new();
        for c in 0..self.cand_buf.len() {
            if *budget == 0 {
                break;
            }
            let qi = self.cand_buf[c].0;
            let si = self.waiting[qi];
            let (max_match, chunk_cap) = (self.max_prefix_blocks(si), self.prefill_cap(si));
            let s = self.seqs[si].as_ref().expect("waiting sequence");
            let ri = s.req;
            let r = self.reqs[ri].as_ref().expect("live request");
            let reserve = if !r.forked { r.n } else { 1 };
            if self.running.len() + reserve > self.cfg.max_running_requests {
                break;
            }
            // Adapter slots: the running set plus this one must fit.
            if let Some(k) = r.adapter {
                if !self.running_adapters.contains_key(&k) {
                    self.keys_buf.clear();
                    self.keys_buf.extend(self.running_adapters.keys().map(|&k| Some(k)));
                    self.keys_buf.push(Some(k));
                    if self.manager.validate_batch(&self.keys_buf).is_err() {
                        if strict {
                            break;
                        }
                        continue;
                    }
                }
            }
            if let Some(k) = r.adapter {
                if !self.adapter_ready(k) {
                    if strict {
                        break;
                    }
                    continue;
                }
            }
            let s = self.seqs[si].as_ref().expect("waiting sequence");
            let r = self.reqs[ri].as_ref().expect("live request");
            // KV blocks for the first chunk after prefix-cache hits.
            self.pool.match_prefix(r.adapter, &s.tokens, max_match, &mut self.match_buf);
            let matched = self.match_buf.len();
            let idle_matched = self.match_buf.iter().filter(|&&b| self.pool.refs(b) == 0).count();
            let start = matched * bs;
            let chunk = (s.tokens.len() - start).min(*budget).min(chunk_cap);
            let need = (start + chunk).div_ceil(bs) - matched;
            if self.pool.available() < idle_matched + need + watermark {
                break;
            }
            // Admit.
            self.counters.prefix_queries += max_match as u64;
            self.counters.prefix_hits += matched as u64;
            let matched_blocks = std::mem::take(&mut self.match_buf);
            for &b in &matched_blocks {
                self.pool.retain(b);
            }
            let order = self.next_order;
            self.next_order += 1;
            let s = self.seq_mut(si);
            s.blocks.extend_from_slice(&matched_blocks);
            s.num_computed = start;
            s.num_registered = matched;
            s.chain_ok = true;
            if s.order == 0 {
                s.order = order;
            }
            self.match_buf = matched_blocks;
            for _ in 0..need {
                let b = self.pool.allocate().expect("checked available");
                self.seq_mut(si).blocks.push(b);
            }
            self.insert_running(si);
            let r = self.req_mut(ri);
            if !r.started {
                r.started = true;
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.sched.push((si, chunk));
            self.seq_mut(si).scheduled = true;
            *budget -= chunk;
            admitted_q.push(qi);
        }
        if !admitted_q.is_empty() {
            admitted_q.sort_unstable();
            for &qi in admitted_q.iter().rev() {
                self.waiting.remove(qi);
            }
        }
    }
}
