//! Request and sequence lifecycle on the engine thread: acceptance (binding the adapter
//! version), cancellation, finishing, freeing, and forking the samples of `n > 1`.

use super::*;

impl Core {
    pub(super) fn reject(&self, nr: NewRequest, msg: String) {
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        let _ = nr.tx.send(StreamEvent::Error(msg));
        for index in 0..nr.req.n {
            let _ = nr.tx.send(StreamEvent::Finished { index, reason: FinishReason::Abort, stop_reason: None, prompt_tokens: nr.req.prompt.len(), completion_tokens: 0 });
        }
    }

    /// A submitted request enters the engine: bind its adapter version now (so an unload or
    /// replace after acceptance does not affect it) and queue it.
    pub(super) fn accept(&mut self, nr: NewRequest) {
        let (key, name) = match &nr.req.adapter {
            None => (None, None),
            Some(name) => match self.manager.acquire(name) {
                Ok(k) => (Some(k), Some(Arc::<str>::from(name.as_str()))),
                Err(_) => {
                    let loading = self.shared.adapters.lock().unwrap().get(name).is_some_and(|e| e.loading);
                    if loading {
                        self.pending_load.entry(name.clone()).or_default().push(nr);
                    } else {
                        let msg = format!("LoRA adapter `{name}` is not loaded");
                        self.reject(nr, msg);
                    }
                    return;
                }
            },
        };
        let NewRequest { id, req, tx, cancel, guide, embed } = nr;
        let ri = match self.free_reqs.pop() {
            Some(i) => i,
            None => {
                self.reqs.push(None);
                self.reqs.len() - 1
            }
        };
        let prompt_len = req.prompt.len();
        let sampler = Sampler::new(req.sampling.clone(), &req.prompt);
        let si = self.new_seq(Seq {
            req: ri,
            index: 0,
            uid: 0,
            detok: Detok::new(prompt_len, req.skip_special_tokens),
            tokens: req.prompt,
            num_computed: 0,
            blocks: Vec::new(),
            num_registered: 0,
            chain_ok: true,
            sampler,
            stop: StopScan::default(),
            order: 0,
            running: false,
            waiting_since: self.step_no,
            scheduled: false,
            stop_reason: None,
            guide,
        });
        self.reqs[ri] = Some(Req {
            id,
            adapter: key,
            adapter_name: name,
            params: req.sampling,
            max_tokens: req.max_tokens,
            stop: req.stop,
            stop_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            n: req.n,
            prompt_len,
            prompt_logprobs: req.prompt_logprobs,
            prompt_lp_next: 1,
            prompt_lps: Vec::new(),
            prompt_lps_sent: false,
            min_tokens: req.min_tokens,
            include_stop: req.include_stop_str_in_output,
            skip_special: req.skip_special_tokens,
            tx,
            cancel,
            seq_ids: vec![si],
            live: req.n,
            forked: req.n == 1,
            started: false,
            embed: embed.map(|job| EmbedState { job: Some(job), pool: Default::default() }),
        });
        self.waiting.push_back(si);
    }

    pub(super) fn new_seq(&mut self, mut s: Seq) -> usize {
        s.uid = self.next_uid;
        self.next_uid += 1;
        match self.free_seqs.pop() {
            Some(i) => {
                self.seqs[i] = Some(s);
                i
            }
            None => {
                self.seqs.push(Some(s));
                self.seqs.len() - 1
            }
        }
    }

    pub(super) fn check_cancellations(&mut self) {
        for ri in 0..self.reqs.len() {
            let cancelled = match &self.reqs[ri] {
                Some(r) => r.cancel.load(Ordering::Relaxed) || r.tx.is_closed(),
                None => false,
            };
            if cancelled {
                self.abort_request(ri, None);
            }
        }
        // Requests waiting for an adapter load can be cancelled too.
        for v in self.pending_load.values_mut() {
            let before = v.len();
            v.retain(|nr| !(nr.cancel.load(Ordering::Relaxed) || nr.tx.is_closed()));
            self.shared.queued.fetch_sub(before - v.len(), Ordering::SeqCst);
        }
    }

    pub(super) fn abort_request(&mut self, ri: usize, error: Option<String>) {
        let seq_ids = std::mem::take(&mut self.req_mut(ri).seq_ids);
        if let Some(e) = error {
            let _ = self.req(ri).tx.send(StreamEvent::Error(e));
        }
        for si in seq_ids {
            if self.seqs[si].is_some() {
                self.end_seq(si, FinishReason::Abort);
            }
        }
        // Samples not forked yet.
        while self.reqs[ri].as_ref().is_some_and(|r| r.live > 0) {
            let r = self.req_mut(ri);
            r.live -= 1;
            let (index, pl) = (r.n - r.live - 1, r.prompt_len);
            let _ = r.tx.send(StreamEvent::Finished { index, reason: FinishReason::Abort, stop_reason: None, prompt_tokens: pl, completion_tokens: 0 });
        }
        if self.reqs[ri].is_some() {
            self.drop_request(ri);
        }
    }

    pub(super) fn release_blocks(&mut self, si: usize) {
        let blocks = std::mem::take(&mut self.seq_mut(si).blocks);
        for &b in blocks.iter().rev() {
            self.pool.release(b);
        }
        let mut blocks = blocks;
        blocks.clear();
        self.seq_mut(si).blocks = blocks;
    }

    pub(super) fn remove_running(&mut self, si: usize) {
        if let Some(p) = self.running.iter().position(|&x| x == si) {
            self.running.remove(p);
            let key = self.req(self.seq(si).req).adapter;
            if let Some(k) = key {
                let c = self.running_adapters.get_mut(&k).expect("running adapter counted");
                *c -= 1;
                if *c == 0 {
                    self.running_adapters.remove(&k);
                }
            }
        }
        self.seq_mut(si).running = false;
    }

    pub(super) fn insert_running(&mut self, si: usize) {
        let order = self.seq(si).order;
        let pos = self.running.partition_point(|&x| self.seq(x).order < order);
        self.running.insert(pos, si);
        self.seq_mut(si).running = true;
        if let Some(k) = self.req(self.seq(si).req).adapter {
            *self.running_adapters.entry(k).or_insert(0) += 1;
        }
    }

    /// Sequence `si` is done: free everything it holds and tell the client.
    pub(super) fn end_seq(&mut self, si: usize, reason: FinishReason) {
        self.release_blocks(si);
        if self.seq(si).running {
            self.remove_running(si);
        } else if let Some(p) = self.waiting.iter().position(|&x| x == si) {
            self.waiting.remove(p);
        }
        let seq = self.seqs[si].take().expect("live sequence");
        self.free_seqs.push(si);
        let ri = seq.req;
        let r = self.req_mut(ri);
        // A draw still in flight was never shown.
        let completion = seq.tokens.len() - r.prompt_len - usize::from(seq.draw_in_flight());
        let _ = r.tx.send(StreamEvent::Finished { index: seq.index, reason, stop_reason: seq.stop_reason, prompt_tokens: r.prompt_len, completion_tokens: completion });
        r.live -= 1;
        r.seq_ids.retain(|&x| x != si);
        if r.live == 0 {
            self.drop_request(ri);
        }
    }

    pub(super) fn drop_request(&mut self, ri: usize) {
        let r = self.reqs[ri].take().expect("live request");
        self.free_reqs.push(ri);
        if !r.started {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        }
        if let Some(k) = r.adapter {
            self.manager.release(k);
        }
    }

    /// The first sample of an `n > 1` request forks the other samples, sharing the prompt's
    /// full blocks; each recomputes only the partial last prompt block in its own block.
    pub(super) fn fork(&mut self, si: usize) -> Vec<usize> {
        let ri = self.seq(si).req;
        let bs = self.pool.block_size();
        let (n, prompt_len, params, skip_special) = {
            let r = self.req(ri);
            (r.n, r.prompt_len, r.params.clone(), r.skip_special)
        };
        self.req_mut(ri).forked = true;
        let full = prompt_len / bs;
        let (shared, registered, chain_ok, prompt) = {
            let s = self.seq(si);
            (s.blocks[..full].to_vec(), s.num_registered.min(full), s.chain_ok || s.num_registered >= full, s.tokens[..prompt_len].to_vec())
        };
        let mut out = vec![si];
        for index in 1..n {
            for &b in &shared {
                self.pool.retain(b);
            }
            let p = SamplingParams { seed: params.seed.map(|x| x.wrapping_add(index as u64)), ..params.clone() };
            let order = self.next_order;
            self.next_order += 1;
            let guide = self.seq(si).guide.as_ref().map(|g| g.fork());
            let child = self.new_seq(Seq {
                req: ri,
                index,
                uid: 0,
                tokens: prompt.clone(),
                num_computed: full * bs,
                blocks: shared.clone(),
                num_registered: registered,
                chain_ok,
                sampler: Sampler::new(p, &prompt),
                detok: Detok::new(prompt_len, skip_special),
                stop: StopScan::default(),
                order,
                running: false,
                waiting_since: self.step_no,
                scheduled: false,
                stop_reason: None,
                guide,
            });
            self.insert_running(child);
            self.req_mut(ri).seq_ids.push(child);
            out.push(child);
        }
        out
    }
}
