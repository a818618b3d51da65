//! [`EngineHandle`]: what the server and the CLI hold. Submitting checks a request and queues
//! it; adapter loads go to the loader thread; nothing here touches the model.

use super::*;

impl EngineHandle {
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.shared.tokenizer
    }
    pub fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        self.inner.shared.tokenizer.clone()
    }
    pub fn config(&self) -> &EngineConfig {
        &self.inner.shared.cfg
    }
    /// The context window requests are checked against.
    pub fn max_model_len(&self) -> usize {
        self.inner.shared.max_model_len
    }

    /// Queues a request. Fails at once (nothing queued) on invalid input, an unknown adapter
    /// (a name still loading is accepted and waits), a full queue, or shutdown.
    pub fn submit(&self, mut req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let sh = &self.inner.shared;
        // The draw's mask is built from the ids in order.
        req.sampling.allowed_token_ids.sort_unstable();
        req.sampling.allowed_token_ids.dedup();
        if sh.embedding.is_some() {
            return Err(SubmitError::Invalid("this server serves embeddings (--task embed): use /v1/embeddings".into()));
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("prompt is empty".into()));
        }
        if req.max_tokens == 0 && (req.prompt_logprobs.is_none() || req.n != 1) {
            return Err(SubmitError::Invalid("max_tokens must be at least 1 (0 only scores the prompt: with prompt_logprobs and n = 1)".into()));
        }
        if req.min_tokens > req.max_tokens {
            return Err(SubmitError::Invalid(format!("min_tokens ({}) must be at most max_tokens ({})", req.min_tokens, req.max_tokens)));
        }
        if req.n == 0 || req.n > sh.cfg.max_running_requests {
            return Err(SubmitError::Invalid(format!("n must be in 1..={}, got {}", sh.cfg.max_running_requests, req.n)));
        }
        for (name, k) in [("top_logprobs", req.logprobs), ("prompt_logprobs", req.prompt_logprobs)] {
            if k.is_some_and(|k| k > quiver_kernels::sample::TOP_LOGPROBS_MAX) {
                return Err(SubmitError::Invalid(format!("{name} must be at most {}, got {}", quiver_kernels::sample::TOP_LOGPROBS_MAX, k.unwrap_or_default())));
            }
        }
        req.sampling.validate().map_err(SubmitError::Invalid)?;
        for (name, mut ids) in [("logit_bias", Box::new(req.sampling.logit_bias.iter().map(|b| b.0)) as Box<dyn Iterator<Item = u32>>), ("allowed_token_ids", Box::new(req.sampling.allowed_token_ids.iter().copied()))] {
            if let Some(bad) = ids.find(|&t| t as usize >= sh.vocab) {
                return Err(SubmitError::Invalid(format!("{name}: token id {bad} is outside the vocabulary ({} tokens)", sh.vocab)));
            }
        }
        if let Some(&bad) = req.prompt.iter().chain(&req.stop_token_ids).find(|&&t| t as usize >= sh.vocab) {
            return Err(SubmitError::Invalid(format!("token id {bad} is outside the vocabulary ({} tokens)", sh.vocab)));
        }
        let total = req.prompt.len() + req.max_tokens;
        if total > sh.max_model_len {
            return Err(SubmitError::PromptTooLong { prompt_tokens: req.prompt.len(), max_tokens: req.max_tokens, max_model_len: sh.max_model_len });
        }
        if total > sh.kv_capacity_tokens {
            return Err(SubmitError::Invalid(format!(
                "prompt + max_tokens ({total} tokens) exceeds the whole KV cache ({} tokens); raise --kv-cache-memory",
                sh.kv_capacity_tokens
            )));
        }
        // Compiled here, on the caller's thread, so a bad grammar is refused before queuing.
        let guide = match &req.constraint {
            None => None,
            Some(c) => Some(sh.grammars.as_ref().map_err(|e| SubmitError::InvalidConstraint(e.clone()))?.compile(c).map_err(SubmitError::InvalidConstraint)?),
        };
        self.enqueue(req, None, guide)
    }

    /// Queues a checked request: refuses it when shutting down, for an unknown adapter or a
    /// full queue, otherwise hands it to the engine thread.
    pub(super) fn enqueue(&self, req: GenerateRequest, embed: Option<EmbedJob>, guide: Option<Guide>) -> Result<RequestStream, SubmitError> {
        let sh = &self.inner.shared;
        // The adapter table lock orders this submit against unloads.
        let table = sh.adapters.lock().unwrap();
        if !sh.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        if let Some(name) = &req.adapter {
            match table.get(name) {
                Some(e) if e.info.is_some() || e.loading => {}
                _ => return Err(SubmitError::UnknownAdapter(name.clone())),
            }
        }
        let max = sh.cfg.max_queued_requests;
        if sh.queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < max).then_some(q + 1)).is_err() {
            return Err(SubmitError::QueueFull { max });
        }
        let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let (n, prompt_tokens) = (req.n, req.prompt.len());
        if self.inner.tx.send(Msg::Submit(Box::new(NewRequest { id, req, tx: etx, cancel: cancel.clone(), guide, embed }))).is_err() {
            sh.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        drop(table);
        Ok(RequestStream { id, rx: erx, cancel: CancelGuard { flag: cancel, wake: self.inner.tx.clone() }, n, prompt_tokens })
    }

    /// Compiles `c` for this model's vocabulary and drops it: whether a request carrying it
    /// would be taken, the error saying why not.
    pub fn check_constraint(&self, c: &crate::structured::Constraint) -> Result<(), String> {
        self.inner.shared.grammars.as_ref().map_err(|e| e.clone())?.compile(c).map(drop)
    }

    /// Loads (or, with `load_inplace`, replaces) an adapter. Reading and validating the files
    /// happens on the loader thread; requests for a new name submitted meanwhile wait for it.
    /// `expected_version` makes a replace a compare-and-swap.
    ///
    /// The load starts when this is called (not when the future is first polled), so a request
    /// submitted right after it waits for the adapter instead of being refused.
    pub fn load_adapter(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> impl std::future::Future<Output = Result<AdapterInfo, AdapterError>> + Send + 'static {
        let started = self.start_load(name, path, pinned, load_inplace, expected_version);
        async move {
            match started {
                Ok(rx) => rx.await.unwrap_or(Err(AdapterError::ShuttingDown)),
                Err(e) => Err(e),
            }
        }
    }

    /// [`Self::load_adapter`] for threads outside an async runtime.
    pub fn load_adapter_blocking(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<AdapterInfo, AdapterError> {
        let rx = self.start_load(name, path, pinned, load_inplace, expected_version)?;
        rx.blocking_recv().unwrap_or(Err(AdapterError::ShuttingDown))
    }

    pub(super) fn start_load(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<oneshot::Receiver<Result<AdapterInfo, AdapterError>>, AdapterError> {
        let sh = &self.inner.shared;
        if name.is_empty() {
            return Err(AdapterError::Invalid("adapter name is empty".into()));
        }
        if !self.config().lora_enabled {
            return Err(AdapterError::Invalid(format!("LoRA adapter `{name}`: LoRA is not enabled in this engine (start the server with --enable-lora)")));
        }
        let mut table = sh.adapters.lock().unwrap();
        if !sh.accepting.load(Ordering::SeqCst) {
            return Err(AdapterError::ShuttingDown);
        }
        let replace = match table.get(name) {
            Some(e) if e.loading => return Err(AdapterError::Busy(name.into())),
            Some(e) => {
                let cur = e.info.as_ref().map(|i| i.version);
                if !load_inplace {
                    return Err(AdapterError::AlreadyLoaded(name.into()));
                }
                if let Some(exp) = expected_version {
                    if Some(exp) != cur {
                        return Err(AdapterError::VersionMismatch { name: name.into(), expected: exp, actual: cur });
                    }
                }
                true
            }
            None => {
                if let Some(exp) = expected_version {
                    return Err(AdapterError::VersionMismatch { name: name.into(), expected: exp, actual: None });
                }
                false
            }
        };
        let (reply, rx) = oneshot::channel();
        let job = LoadJob { name: name.into(), path: path.to_path_buf(), pinned, replace, reply };
        let loader = self.inner.loader.lock().unwrap();
        let Some(l) = loader.as_ref() else { return Err(AdapterError::ShuttingDown) };
        l.send(LoaderJob::Load(job)).map_err(|_| AdapterError::ShuttingDown)?;
        table.entry(name.into()).or_default().loading = true;
        Ok(rx)
    }

    /// Removes `name`: new requests for it are refused from now on; accepted ones finish on
    /// the weights they were given; the weights are freed when the last of them finishes.
    pub fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        let sh = &self.inner.shared;
        let mut table = sh.adapters.lock().unwrap();
        match table.get(name) {
            None => return Err(AdapterError::NotFound(name.into())),
            Some(e) if e.loading => return Err(AdapterError::Busy(name.into())),
            Some(_) => {}
        }
        table.remove(name);
        self.inner.tx.send(Msg::Unload(name.into())).map_err(|_| AdapterError::ShuttingDown)
    }

    /// Current versions of loaded adapters, by name.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        let table = self.inner.shared.adapters.lock().unwrap();
        let mut v: Vec<AdapterInfo> = table.values().filter_map(|e| e.info.clone()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().unwrap().clone()
    }

    /// A consistent snapshot of the engine's internals (waits for the current step).
    pub fn debug_state(&self) -> Option<DebugState> {
        let (tx, rx) = mpsc::channel();
        self.inner.tx.send(Msg::Debug(tx)).ok()?;
        rx.recv().ok()
    }

    /// Stops accepting requests and loads; accepted requests run to completion, then the
    /// engine thread exits.
    pub fn shutdown(&self) {
        {
            let _t = self.inner.shared.adapters.lock().unwrap();
            self.inner.shared.accepting.store(false, Ordering::SeqCst);
        }
        let _ = self.inner.tx.send(Msg::Shutdown);
        self.inner.loader.lock().unwrap().take();
        // A load in progress stops at its next read; nothing waits for it.
        self.inner.cancel_loads.store(true, Ordering::SeqCst);
    }

    /// [`Self::shutdown`], then waits for the engine thread to finish.
    pub fn shutdown_and_join(&self) {
        self.shutdown();
        if let Some(t) = self.inner.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}
