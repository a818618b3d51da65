//! Adapter loads: the loader thread reads and validates files; the engine thread installs
//! the result and releases the requests that waited for it.

use super::*;

pub(super) fn loader_loop(rx: Receiver<LoadJob>, engine: Sender<Msg>, dims: LoraModelDims, max_rank: usize, modules: Vec<LoraModule>, model: ModelConfig) {
    while let Ok(job) = rx.recv() {
        let result = LoraAdapter::load(&job.name, &job.path, &dims)
            .and_then(|a| a.check_compatible(max_rank, &modules).map(|_| a))
            .and_then(|a| quiver_model::check_adapter(&model, &a).map(|_| a));
        if engine.send(Msg::AdapterLoaded { job, result }).is_err() {
            return;
        }
    }
}

impl Core {
    pub(super) fn finish_load(&mut self, job: LoadJob, result: Result<LoraAdapter, LoraError>) {
        // The manager re-reads the files here (it has no API taking pre-read weights yet); the
        // loader thread already validated them, so failures here are rare races.
        let r = result.and_then(|_adapter| {
            if job.replace {
                let k = self.manager.replace_adapter(&job.name, &job.path)?;
                if job.pinned {
                    self.manager.pin(&job.name, true)?;
                }
                Ok(k)
            } else {
                self.manager.load_adapter_with(&job.name, &job.path, job.pinned)
            }
        });
        let r = r.map(|key| {
            let a = self.manager.adapters().into_iter().find(|a| a.key == key);
            AdapterInfo {
                name: job.name.clone(),
                path: job.path.clone(),
                version: key.version,
                pinned: a.as_ref().is_some_and(|a| a.pinned),
                rank: a.map_or(0, |a| a.max_rank),
            }
        });
        {
            let mut table = self.shared.adapters.lock().unwrap();
            let entry = table.entry(job.name.clone()).or_default();
            entry.loading = false;
            match &r {
                Ok(info) => entry.info = Some(info.clone()),
                Err(_) => {
                    if entry.info.is_none() {
                        table.remove(&job.name);
                    }
                }
            }
        }
        match &r {
            Ok(info) => {
                self.counters.adapter_loads += 1;
                tracing::info!(adapter = %info.name, version = info.version, rank = info.rank, "LoRA adapter loaded");
            }
            Err(e) => {
                self.counters.adapter_load_failures += 1;
                tracing::warn!(adapter = %job.name, "LoRA adapter load failed: {e}");
            }
        }
        let pending = self.pending_load.remove(&job.name).unwrap_or_default();
        for nr in pending {
            match &r {
                Ok(_) => self.accept(nr),
                Err(e) => {
                    let msg = format!("loading LoRA adapter `{}` failed: {e}", job.name);
                    self.reject(nr, msg);
                }
            }
        }
        let _ = job.reply.send(r.map_err(|e| match e {
            LoraError::AlreadyLoaded(n) => AdapterError::AlreadyLoaded(n),
            LoraError::UnknownAdapter(n) => AdapterError::NotFound(n),
            e => AdapterError::Invalid(e.to_string()),
        }));
    }
}
