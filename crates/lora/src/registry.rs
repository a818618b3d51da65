//! Names, versions, in-flight counts and the host-memory cache of adapter weights.
//!
//! Every load (including a replace of an existing name) creates a new *version* with a fresh,
//! monotonically increasing `u64`; a name keeps its [`AdapterId`] across replaces. The engine
//! keys its prefix cache on the whole [`AdapterKey`] `(id, version)`, so a replaced adapter
//! never reuses the old weights' KV blocks. Old versions stay usable by requests that hold
//! them (in-flight count) and are dropped when the last one releases.
//!
//! Host memory holds at most `max_loaded_loras` adapters' weights (LRU; pinned exempt); a
//! version whose weights were dropped is reloaded from its path when next needed, after
//! checking that the weights file was not rewritten in between.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::adapter::{FileStamp, LoraAdapter, WEIGHTS_FILE};
use crate::error::{LoraError, Result};
use crate::LoraModelDims;

/// Stable identity of an adapter name (survives replace).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u32);

/// One loaded version of an adapter: what requests hold and what the prefix cache keys on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterKey {
    pub id: AdapterId,
    /// Unique across all loads of this manager, monotonically increasing.
    pub version: u64,
}

/// A snapshot of one version for listing endpoints and metrics.
#[derive(Clone, Debug)]
pub struct AdapterInfo {
    pub name: String,
    pub key: AdapterKey,
    pub path: PathBuf,
    /// False for a version superseded by a replace or unloaded, still held by requests.
    pub current: bool,
    pub pinned: bool,
    pub in_flight: usize,
    pub in_host_memory: bool,
    pub slot: Option<usize>,
    pub max_rank: usize,
}

pub(crate) struct VersionEntry {
    pub id: AdapterId,
    pub name: String,
    pub path: PathBuf,
    pub weights: Option<Arc<LoraAdapter>>,
    pub stamp: Option<FileStamp>,
    pub max_rank: usize,
    pub in_flight: usize,
    pub pinned: bool,
    pub current: bool,
    pub last_used: u64,
}

pub struct LoraRegistry {
    names: HashMap<String, AdapterKey>,
    pub(crate) versions: HashMap<u64, VersionEntry>,
    ids: HashMap<String, AdapterId>,
    next_id: u32,
    next_version: u64,
    clock: u64,
    max_loaded: usize,
}

impl LoraRegistry {
    pub fn new(max_loaded: usize) -> Self {
        LoraRegistry { names: HashMap::new(), versions: HashMap::new(), ids: HashMap::new(), next_id: 0, next_version: 1, clock: 0, max_loaded: max_loaded.max(1) }
    }

    /// The current version of `name`.
    pub fn resolve(&self, name: &str) -> Option<AdapterKey> {
        self.names.get(name).copied()
    }

    /// Registers a new version for `name` (a new name, or a replace of an existing one). Returns
    /// the new key and the superseded key, if any.
    pub(crate) fn insert(&mut self, name: &str, path: &Path, adapter: LoraAdapter, pinned: bool) -> (AdapterKey, Option<AdapterKey>) {
        let id = *self.ids.entry(name.to_string()).or_insert_with(|| {
            self.next_id += 1;
            AdapterId(self.next_id)
        });
        let key = AdapterKey { id, version: self.next_version };
        self.next_version += 1;
        self.clock += 1;
        let old = self.names.insert(name.to_string(), key);
        if let Some(o) = old {
            if let Some(e) = self.versions.get_mut(&o.version) {
                e.current = false;
                e.pinned = false;
            }
        }
        self.versions.insert(
            key.version,
            VersionEntry {
                id,
                name: name.to_string(),
                path: path.to_path_buf(),
                stamp: adapter.stamp,
                max_rank: adapter.max_rank(),
                weights: Some(Arc::new(adapter)),
                in_flight: 0,
                pinned,
                current: true,
                last_used: self.clock,
            },
        );
        (key, old)
    }

    /// Removes the name; returns its current key. The version itself goes when unused.
    pub(crate) fn remove_name(&mut self, name: &str) -> Result<AdapterKey> {
        let key = self.names.remove(name).ok_or_else(|| LoraError::UnknownAdapter(name.to_string()))?;
        if let Some(e) = self.versions.get_mut(&key.version) {
            e.current = false;
            e.pinned = false;
        }
        Ok(key)
    }

    /// Drops `key` if it is neither current nor held by a request. Returns true if dropped.
    pub(crate) fn collect(&mut self, key: AdapterKey) -> bool {
        match self.versions.get(&key.version) {
            Some(e) if !e.current && e.in_flight == 0 => {
                self.versions.remove(&key.version);
                true
            }
            _ => false,
        }
    }

    pub fn acquire(&mut self, name: &str) -> Result<AdapterKey> {
        let key = self.resolve(name).ok_or_else(|| LoraError::UnknownAdapter(name.to_string()))?;
        self.versions.get_mut(&key.version).expect("current version is registered").in_flight += 1;
        Ok(key)
    }

    /// Decrements the in-flight count; true if the version should now be dropped.
    pub(crate) fn release(&mut self, key: AdapterKey) -> bool {
        if let Some(e) = self.versions.get_mut(&key.version) {
            e.in_flight = e.in_flight.saturating_sub(1);
            return !e.current && e.in_flight == 0;
        }
        false
    }

    pub fn in_flight(&self, key: AdapterKey) -> usize {
        self.versions.get(&key.version).map_or(0, |e| e.in_flight)
    }

    pub(crate) fn set_pinned(&mut self, key: AdapterKey, pinned: bool) {
        if let Some(e) = self.versions.get_mut(&key.version) {
            e.pinned = pinned;
        }
    }

    pub(crate) fn touch(&mut self, key: AdapterKey) {
        self.clock += 1;
        if let Some(e) = self.versions.get_mut(&key.version) {
            e.last_used = self.clock;
        }
    }

    /// The weights of `key`. If the host cache dropped them they are read from disk again
    /// when `disk_reload` allows it; the engine forbids it (its thread must never do file I/O)
    /// and restores them through [`Self::restore`] from its loader thread instead.
    pub(crate) fn weights(&mut self, key: AdapterKey, dims: &LoraModelDims, disk_reload: bool) -> Result<Arc<LoraAdapter>> {
        let e = self.versions.get_mut(&key.version).ok_or_else(|| LoraError::Invalid(format!("LoRA adapter version {} is no longer loaded", key.version)))?;
        if let Some(w) = &e.weights {
            return Ok(w.clone());
        }
        if !disk_reload {
            return Err(LoraError::Invalid(format!("LoRA adapter `{}` (version {}) is not in host memory; it must be reloaded first", e.name, key.version)));
        }
        if e.stamp.is_some() && FileStamp::of_path(&e.path.join(WEIGHTS_FILE)) != e.stamp {
            return Err(Self::changed(e));
        }
        tracing::info!(adapter = %e.name, version = key.version, "reloading LoRA adapter evicted from host memory");
        let w = LoraAdapter::load(&e.name, &e.path, dims)?;
        let w = Arc::new(Self::check_stamp(e, w)?);
        e.weights = Some(w.clone());
        Ok(w)
    }

    /// What a reload of `key` reads, if its weights are not in memory: the name, the
    /// directory, and the weights file's stamp at the first load.
    pub(crate) fn reload_source(&self, key: AdapterKey) -> Option<(String, PathBuf, Option<FileStamp>)> {
        self.versions.get(&key.version).filter(|e| e.weights.is_none()).map(|e| (e.name.clone(), e.path.clone(), e.stamp))
    }

    /// Puts reloaded weights back, if they are the ones this version was loaded with.
    pub(crate) fn restore(&mut self, key: AdapterKey, adapter: LoraAdapter) -> Result<()> {
        let Some(e) = self.versions.get_mut(&key.version) else { return Ok(()) };
        if e.weights.is_none() {
            e.weights = Some(Arc::new(Self::check_stamp(e, adapter)?));
        }
        Ok(())
    }

    fn check_stamp(e: &VersionEntry, w: LoraAdapter) -> Result<LoraAdapter> {
        if e.stamp.is_some() && w.stamp != e.stamp {
            return Err(Self::changed(e));
        }
        Ok(w)
    }

    fn changed(e: &VersionEntry) -> LoraError {
        LoraError::File {
            adapter: e.name.clone(),
            file: WEIGHTS_FILE.into(),
            reason: "changed on disk since this version was loaded; load it again (replace) to serve the new weights".into(),
        }
    }

    /// Drops host weights of least recently used, unpinned versions beyond the cap, never
    /// those in `protect`.
    pub(crate) fn enforce_host_cap(&mut self, protect: &[AdapterKey]) {
        loop {
            let held = self.versions.values().filter(|e| e.weights.is_some()).count();
            if held <= self.max_loaded {
                return;
            }
            let victim = self
                .versions
                .iter()
                .filter(|(v, e)| e.weights.is_some() && !e.pinned && !protect.iter().any(|k| k.version == **v))
                .min_by_key(|(_, e)| e.last_used)
                .map(|(v, _)| *v);
            match victim {
                Some(v) => {
                    let e = self.versions.get_mut(&v).expect("just found");
                    tracing::debug!(adapter = %e.name, version = v, "dropping LoRA weights from host memory (max_loaded_loras)");
                    e.weights = None;
                }
                None => return,
            }
        }
    }

    pub fn in_host_memory(&self, key: AdapterKey) -> bool {
        self.versions.get(&key.version).is_some_and(|e| e.weights.is_some())
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = (AdapterKey, &VersionEntry)> {
        self.versions.iter().map(|(v, e)| (AdapterKey { id: e.id, version: *v }, e))
    }
}
