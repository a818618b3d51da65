//! Adapter loads: the loader thread does every file read (first loads, replaces, and reloads
//! of versions the host cache dropped), bounded in size and time and cancelled at shutdown;
//! the engine thread only installs finished weights and releases the requests that waited for
//! them, so a slow, huge or hostile file never stalls a step.

use super::*;

/// The longest one load may read for; a file that takes longer (a slow or wedged filesystem)
/// fails its load instead of holding the name busy.
const LOAD_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) enum LoaderJob {
    /// A first load or a replace, from the HTTP layer or startup.
    Load(LoadJob),
    /// A version whose host weights were dropped (`max_loaded_loras`) is needed again.
    Reload { key: AdapterKey, name: String, path: PathBuf, stamp: Option<FileStamp> },
}

/// What the loader thread needs to read and validate adapters for this engine.
pub(super) struct Loader {
    pub dims: LoraModelDims,
    pub max_rank: usize,
    pub modules: Vec<LoraModule>,
    /// Canonical `--lora-dir`: adapters under it are read with the file sandbox.
    pub sandbox: Option<PathBuf>,
    /// Set at shutdown: a load in progress stops at its next read.
    pub cancel: Arc<AtomicBool>,
    /// The model, for modules an adapter names that it does not have.
    pub model: ModelConfig,
    /// Makes each adapter's device image as it is read (CUDA: its bf16 in page-locked memory,
    /// 100+ ms for an 8B adapter), so the engine thread only installs it.
    pub images: quiver_lora::LoraImageMaker,
}

impl Loader {
    /// The largest weights file a valid adapter can be for this pool: every module of every
    /// layer at the pool's rank in f32, plus the header.
    fn max_weights_bytes(&self) -> u64 {
        let d = &self.dims;
        let experts = d.moe.map_or(0, |m| m.num_experts);
        let per_rank: usize = LoraModule::ALL
            .iter()
            .chain(&LoraModule::MOE)
            .map(|&m| {
                let (i, o) = d.module_dims(m);
                let copies = if m.is_expert() { experts } else { 1 };
                (i + o) * copies * if m.is_projection() { d.num_layers } else { 1 }
            })
            .sum();
        (per_rank * self.max_rank * 4) as u64 + (16 << 20) + 8
    }

    fn limits(&self, path: &Path) -> ReadLimits {
        // The sandbox applies to adapters under the root; the HTTP layer only passes such
        // paths, and operator-given startup paths elsewhere keep following symlinks.
        let sandbox = self.sandbox.clone().filter(|root| path.canonicalize().is_ok_and(|p| p.starts_with(root)));
        ReadLimits {
            max_rank: Some(self.max_rank),
            max_weights_bytes: self.max_weights_bytes(),
            deadline: Some(Instant::now() + LOAD_TIMEOUT),
            cancel: Some(self.cancel.clone()),
            sandbox,
            ..Default::default()
        }
    }

    fn read(&self, name: &str, path: &Path) -> Result<LoraAdapter, LoraError> {
        let a = LoraAdapter::load_with(name, path, &self.dims, &self.limits(path))?;
        a.check_compatible(self.max_rank, &self.modules)?;
        quiver_model::check_adapter(&self.model, &a)?;
        self.images.prepare(&a);
        Ok(a)
    }
}

pub(super) fn loader_loop(rx: Receiver<LoaderJob>, engine: Sender<Msg>, loader: Loader) {
    // Reading and converting an adapter is CPU work competing with the engine's step threads;
    // on Linux a thread has its own nice value, so the loader yields to them.
    #[cfg(target_os = "linux")]
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
    while let Ok(job) = rx.recv() {
        // A bug in reading one hostile file must fail that load, not end every later one.
        let guarded = |f: &dyn Fn() -> Result<LoraAdapter, LoraError>| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| Err(LoraError::Invalid("internal error while reading the adapter (see the server log)".into())))
        };
        let msg = match job {
            LoaderJob::Load(job) => {
                let result = guarded(&|| loader.read(&job.name, &job.path));
                Msg::AdapterLoaded { job, result }
            }
            LoaderJob::Reload { key, name, path, stamp } => {
                let wfile = path.join(quiver_lora::adapter::WEIGHTS_FILE);
                let result = if stamp.is_some() && FileStamp::of_path(&wfile) != stamp {
                    Err(LoraError::File {
                        adapter: name.clone(),
                        file: quiver_lora::adapter::WEIGHTS_FILE.into(),
                        reason: "changed on disk since this version was loaded; load it again (replace) to serve the new weights".into(),
                    })
                } else {
                    tracing::info!(adapter = %name, version = key.version, "reloading LoRA adapter evicted from host memory");
                    guarded(&|| loader.read(&name, &path))
                };
                Msg::AdapterReloaded { key, result }
            }
        };
        if engine.send(msg).is_err() {
            return;
        }
    }
}

impl Core {
    /// True if `key`'s weights can join a batch now (in a slot or in host memory); otherwise
    /// asks the loader thread to read them again (once) and the caller skips the sequence.
    pub(super) fn adapter_ready(&mut self, key: AdapterKey) -> bool {
        if self.manager.weights_available(key) {
            return true;
        }
        if self.reloading.insert(key) {
            match self.manager.reload_source(key) {
                Some((name, path, stamp)) => {
                    if self.loader.send(LoaderJob::Reload { key, name, path, stamp }).is_err() {
                        self.reloading.remove(&key);
                    }
                }
                None => {
                    self.reloading.remove(&key);
                }
            }
        }
        false
    }

    pub(super) fn finish_reload(&mut self, key: AdapterKey, result: Result<LoraAdapter, LoraError>) {
        self.reloading.remove(&key);
        if let Err(e) = result.and_then(|a| self.manager.restore_weights(key, a)) {
            tracing::warn!(version = key.version, "LoRA adapter reload failed: {e}");
            self.fail_adapter(key, &format!("LoRA adapter could not be reloaded into host memory: {e}"));
        }
    }

    /// Fails every request bound to `key`.
    pub(super) fn fail_adapter(&mut self, key: AdapterKey, msg: &str) {
        for ri in 0..self.reqs.len() {
            if self.reqs[ri].as_ref().is_some_and(|r| r.adapter == Some(key)) {
                self.abort_request(ri, Some(msg.to_string()));
            }
        }
    }

    /// At shutdown nothing waits on a reload (the loader may be stuck in a read).
    pub(super) fn abandon_reloads(&mut self) {
        for key in std::mem::take(&mut self.reloading) {
            self.fail_adapter(key, "the engine shut down before the adapter was reloaded");
        }
    }

    pub(super) fn finish_load(&mut self, job: LoadJob, result: Result<LoraAdapter, LoraError>) {
        // The weights were read and validated on the loader thread; installing them only
        // moves them into the registry.
        let r = result.and_then(|adapter| {
            if job.replace {
                let k = self.manager.install_replacement(&job.name, adapter)?;
                if job.pinned {
                    self.manager.pin(&job.name, true)?;
                }
                Ok(k)
            } else {
                self.manager.install_adapter(&job.name, adapter, job.pinned)
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
