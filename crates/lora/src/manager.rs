//! [`LoraManager`]: the object the engine owns. It holds the registry (names, versions,
//! in-flight counts, host cache), the slot pool, the chosen backend and the reused batch
//! metadata; [`LoraManager::prepare_batch`] makes a batch's adapters resident and returns the
//! [`BatchHook`] the model's forward pass calls.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use quiver_kernels::lora::GroupRows;
use quiver_kernels::moe::HostRouting;
use quiver_kernels::{Device, DeviceKind, Epilogue, LoraExpertCall, LoraX, MoeRouting, Tensor, Weight};

use crate::backend::{create_backend, LoraBackend, SiteRef, DEFAULT_BACKEND};
use crate::batch::{LoraBatchInfo, RowGrouping, DEFAULT_CHUNK_SIZE};
use crate::config::LoraModule;
use crate::error::{LoraError, Result};
use crate::eviction_policy::EvictionPolicy;
use crate::mem_pool::LoraMemoryPool;
use crate::registry::{AdapterInfo, AdapterKey, LoraRegistry};
use crate::shard::TpShard;
use crate::{ExpertSite, LinearSite, LoraAdapter, LoraHook, LoraModelDims};

/// Serving-time LoRA settings (the CLI flags).
#[derive(Clone, Debug)]
pub struct LoraConfig {
    /// Slots `S`: distinct adapters in one batch (base rows take no slot).
    pub max_loras_per_batch: usize,
    /// Pool rank `R`; adapters above it are refused.
    pub max_lora_rank: usize,
    /// Adapters whose weights stay in host memory (LRU beyond; pinned exempt).
    pub max_loaded_loras: usize,
    pub eviction_policy: EvictionPolicy,
    /// Backend name (see [`crate::backend_names`]).
    pub backend: String,
    /// Modules the pool has buffers for; adapters targeting others are refused.
    pub target_modules: Vec<LoraModule>,
    /// Rows per chunk of the chunked backend.
    pub chunk_size: usize,
    /// Token rows the batch buffers are preallocated for (larger batches grow them once).
    pub max_batch_tokens: usize,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            max_loras_per_batch: 8,
            max_lora_rank: 64,
            max_loaded_loras: 64,
            eviction_policy: EvictionPolicy::Lru,
            backend: DEFAULT_BACKEND.to_string(),
            target_modules: LoraModule::PROJECTIONS.to_vec(),
            chunk_size: DEFAULT_CHUNK_SIZE,
            max_batch_tokens: 2048,
        }
    }
}

pub struct LoraManager {
    dims: LoraModelDims,
    config: LoraConfig,
    device: DeviceKind,
    pool: LoraMemoryPool,
    /// Tensor parallelism: the pools of ranks 1.. (`pool` is rank 0's), each slot filled and
    /// freed with rank 0's, so every rank's slot holds its cut of the same adapter.
    rank_pools: Vec<LoraMemoryPool>,
    registry: LoraRegistry,
    backend: Box<dyn LoraBackend>,
    batch: LoraBatchInfo,
    batch_keys: Vec<AdapterKey>,
    seq_slots: Vec<Option<u32>>,
    /// See [`LoraManager::set_disk_reload`].
    disk_reload: bool,
    /// The host grouping of an MoE layer's routed positions (devices whose routing is in host
    /// memory), rebuilt per layer (a hook is `&self` and the model calls it one layer at a
    /// time, so the lock is never contended).
    expert_rows: std::sync::Mutex<RowGrouping>,
}

impl LoraManager {
    /// Validates the configuration and allocates the slot pool once, on `device` (the model's).
    pub fn new(dims: LoraModelDims, config: LoraConfig, device: Arc<dyn Device>) -> Result<Self> {
        let kind = device.kind();
        let backend = create_backend(&config.backend, kind).map_err(LoraError::Invalid)?;
        if config.max_loaded_loras < config.max_loras_per_batch {
            return Err(LoraError::Invalid(format!(
                "max_loaded_loras ({}) must be at least max_loras_per_batch ({})",
                config.max_loaded_loras, config.max_loras_per_batch
            )));
        }
        if config.target_modules.is_empty() {
            return Err(LoraError::Invalid("LoRA target_modules is empty".into()));
        }
        let tile_rows = device.lora_tile_rows();
        let pool = LoraMemoryPool::new(device, dims, config.max_loras_per_batch, config.max_lora_rank, &config.target_modules, config.eviction_policy)?;
        tracing::info!(bytes = pool.size_bytes(), slots = config.max_loras_per_batch, rank = config.max_lora_rank, device = %kind, "allocated LoRA memory pool");
        let s = config.max_loras_per_batch;
        Ok(LoraManager {
            batch: LoraBatchInfo::with_capacity(s, config.max_batch_tokens, config.chunk_size, tile_rows),
            registry: LoraRegistry::new(config.max_loaded_loras),
            batch_keys: Vec::with_capacity(s + 1),
            seq_slots: Vec::with_capacity(config.max_batch_tokens),
            disk_reload: true,
            expert_rows: std::sync::Mutex::new(RowGrouping::with_capacity(config.max_batch_tokens, s * dims.moe.map_or(1, |m| m.num_experts))),
            dims,
            config,
            device: kind,
            pool,
            rank_pools: Vec::new(),
            backend,
        })
    }

    pub fn dims(&self) -> &LoraModelDims {
        &self.dims
    }
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }
    pub fn device(&self) -> DeviceKind {
        self.device
    }
    pub fn pool(&self) -> &LoraMemoryPool {
        &self.pool
    }

    /// Shards the pool over a tensor-parallel group: rank r's pool is allocated on `ranks[r]`'s
    /// device and holds its cut of every adapter ([`crate::shard`]). Called at start-up, before
    /// any adapter is resident.
    pub fn shard_pool(&mut self, ranks: &[(TpShard, Arc<dyn Device>)]) -> Result<()> {
        if (0..self.pool.num_slots()).any(|s| self.pool.owner(s).is_some()) {
            return Err(LoraError::Invalid("the LoRA pool is sharded before any adapter is resident".into()));
        }
        let c = &self.config;
        let mut pools = ranks
            .iter()
            .map(|(shard, dev)| LoraMemoryPool::new_shard(dev.clone(), self.dims, shard, c.max_loras_per_batch, c.max_lora_rank, &c.target_modules, c.eviction_policy))
            .collect::<Result<Vec<_>>>()?;
        if pools.is_empty() {
            return Err(LoraError::Invalid("a tensor-parallel group of no ranks".into()));
        }
        self.pool = pools.remove(0);
        self.rank_pools = pools;
        Ok(())
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// What makes adapter images for this manager's pools (every rank's under tensor
    /// parallelism), for the thread that reads adapters: an adapter whose images it made
    /// installs without converting anything.
    pub fn image_maker(&self) -> crate::LoraImageMaker {
        self.pool.image_maker().join(self.rank_pools.iter().map(LoraMemoryPool::image_maker))
    }

    /// Makes `adapter`'s images for every rank's pool now (off the path of any step), as the
    /// loader thread's maker does.
    fn prepare_images(&self, adapter: &LoraAdapter) {
        self.image_maker().prepare(adapter);
    }

    /// Loads the PEFT adapter at `path` under a new name. Refuses a name already loaded.
    pub fn load_adapter(&mut self, name: &str, path: impl AsRef<Path>) -> Result<AdapterKey> {
        self.load_adapter_with(name, path, false)
    }

    /// Like [`Self::load_adapter`]; a pinned adapter takes a slot now and is never evicted
    /// (from its slot or from host memory).
    pub fn load_adapter_with(&mut self, name: &str, path: impl AsRef<Path>, pinned: bool) -> Result<AdapterKey> {
        if self.registry.resolve(name).is_some() {
            return Err(LoraError::AlreadyLoaded(name.to_string()));
        }
        let adapter = self.read_adapter(name, path.as_ref())?;
        self.install_adapter(name, adapter, pinned)
    }

    /// [`Self::load_adapter_with`] for weights already read (by the engine's loader thread, so
    /// that the thread owning the manager does no file I/O). Its `path` is recorded.
    pub fn install_adapter(&mut self, name: &str, adapter: LoraAdapter, pinned: bool) -> Result<AdapterKey> {
        if self.registry.resolve(name).is_some() {
            return Err(LoraError::AlreadyLoaded(name.to_string()));
        }
        if pinned {
            self.check_can_pin()?;
        }
        adapter.check_compatible(self.pool.max_rank(), self.pool.modules())?;
        self.prepare_images(&adapter);
        let path = adapter.path.clone();
        let (key, _) = self.registry.insert(name, &path, adapter, false);
        if pinned {
            if let Err(e) = self.pin(name, true) {
                self.remove_version(key);
                return Err(e);
            }
        }
        self.registry.enforce_host_cap(&[key]);
        Ok(key)
    }

    /// Loads new weights under an existing name: a new version; requests holding the old one
    /// keep it until they release it. Pinning carries over.
    pub fn replace_adapter(&mut self, name: &str, path: impl AsRef<Path>) -> Result<AdapterKey> {
        self.registry.resolve(name).ok_or_else(|| LoraError::UnknownAdapter(name.to_string()))?;
        let adapter = self.read_adapter(name, path.as_ref())?;
        self.install_replacement(name, adapter)
    }

    /// [`Self::replace_adapter`] for weights already read.
    pub fn install_replacement(&mut self, name: &str, adapter: LoraAdapter) -> Result<AdapterKey> {
        let old = self.registry.resolve(name).ok_or_else(|| LoraError::UnknownAdapter(name.to_string()))?;
        let was_pinned = self.registry.versions.get(&old.version).is_some_and(|e| e.pinned);
        adapter.check_compatible(self.pool.max_rank(), self.pool.modules())?;
        self.prepare_images(&adapter);
        let path = adapter.path.clone();
        let (key, _) = self.registry.insert(name, &path, adapter, false);
        if let Some(s) = self.pool.slot_of(old) {
            self.pool.set_pinned(s, false);
        }
        self.collect(old);
        if was_pinned {
            self.pin(name, true)?;
        }
        self.registry.enforce_host_cap(&[key]);
        Ok(key)
    }

    /// Whether a host-cache miss may read the adapter's files again on the calling thread
    /// (default: yes). The engine turns it off and restores evicted weights through
    /// [`Self::reload_source`] / [`Self::restore_weights`] from its loader thread; a batch
    /// needing weights that are neither in a slot nor in host memory then fails instead.
    pub fn set_disk_reload(&mut self, on: bool) {
        self.disk_reload = on;
    }

    /// True if `key` can join a batch without reading files: slot-resident or in host memory.
    pub fn weights_available(&self, key: AdapterKey) -> bool {
        self.is_resident(key) || self.in_host_memory(key)
    }

    /// `(name, directory, weights-file stamp at load)` to read `key`'s weights from again,
    /// when they are not in host memory.
    pub fn reload_source(&self, key: AdapterKey) -> Option<(String, PathBuf, Option<crate::adapter::FileStamp>)> {
        self.registry.reload_source(key)
    }

    /// Puts back weights of `key` read again from its directory; refused (naming the file) if
    /// the file is not the one this version was loaded from. A no-op for a version that is
    /// gone or already in memory.
    pub fn restore_weights(&mut self, key: AdapterKey, adapter: LoraAdapter) -> Result<()> {
        self.prepare_images(&adapter);
        self.registry.restore(key, adapter)
    }

    /// Removes `name`. Its weights go now if no request holds them, else at the last release.
    pub fn unload_adapter(&mut self, name: &str) -> Result<()> {
        let key = self.registry.remove_name(name)?;
        if let Some(s) = self.pool.slot_of(key) {
            self.pool.set_pinned(s, false);
        }
        self.collect(key);
        Ok(())
    }

    /// Pins or unpins the current version of `name`. Pinning may not take the last slot.
    pub fn pin(&mut self, name: &str, pinned: bool) -> Result<()> {
        let key = self.registry.resolve(name).ok_or_else(|| LoraError::UnknownAdapter(name.to_string()))?;
        let slot = self.pool.slot_of(key);
        if !pinned {
            self.registry.set_pinned(key, false);
            if let Some(s) = slot {
                self.pool.set_pinned(s, false);
            }
            return Ok(());
        }
        if slot.is_some_and(|s| self.pool.is_pinned(s)) {
            return Ok(());
        }
        self.check_can_pin()?;
        let s = match slot {
            Some(s) => s,
            None => self.make_resident(key, &[])?,
        };
        self.pool.set_pinned(s, true);
        self.registry.set_pinned(key, true);
        Ok(())
    }

    /// Marks a request as using the current version of `name`; the returned key is what the
    /// request keeps (and what the prefix cache keys on). Pair with [`Self::release`].
    pub fn acquire(&mut self, name: &str) -> Result<AdapterKey> {
        self.registry.acquire(name)
    }

    /// A request holding `key` finished.
    pub fn release(&mut self, key: AdapterKey) {
        if self.registry.release(key) {
            self.collect(key);
        }
    }

    /// The current version of `name`.
    pub fn resolve(&self, name: &str) -> Option<AdapterKey> {
        self.registry.resolve(name)
    }
    pub fn in_flight(&self, key: AdapterKey) -> usize {
        self.registry.in_flight(key)
    }
    /// `(slot, key)` of every slot-resident adapter.
    pub fn resident(&self) -> Vec<(usize, AdapterKey)> {
        (0..self.pool.num_slots()).filter_map(|s| self.pool.owner(s).map(|k| (s, k))).collect()
    }
    pub fn is_resident(&self, key: AdapterKey) -> bool {
        self.pool.slot_of(key).is_some()
    }
    pub fn in_host_memory(&self, key: AdapterKey) -> bool {
        self.registry.in_host_memory(key)
    }
    /// Every registered version (current ones and superseded ones still in use), by version.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        let mut v: Vec<AdapterInfo> = self
            .registry
            .all()
            .map(|(key, e)| AdapterInfo {
                name: e.name.clone(),
                key,
                path: PathBuf::from(&e.path),
                current: e.current,
                pinned: e.pinned,
                in_flight: e.in_flight,
                in_host_memory: e.weights.is_some(),
                slot: self.pool.slot_of(key),
                max_rank: e.max_rank,
            })
            .collect();
        v.sort_by_key(|a| a.key.version);
        v
    }

    /// Checks that a batch with these adapters could be made resident (admission control):
    /// distinct adapters not resident-and-pinned must fit the unpinned slots.
    pub fn validate_batch(&self, keys: &[Option<AdapterKey>]) -> Result<()> {
        let mut distinct: Vec<AdapterKey> = keys.iter().flatten().copied().collect();
        distinct.sort();
        distinct.dedup();
        let pinned_in_batch = distinct.iter().filter(|k| self.pool.slot_of(**k).is_some_and(|s| self.pool.is_pinned(s))).count();
        let free_for_batch = self.pool.num_slots() - self.pool.pinned_count();
        if distinct.len() - pinned_in_batch > free_for_batch {
            return Err(LoraError::NoSlot(format!(
                "batch uses {} distinct adapters ({} pinned) but only {} unpinned slots exist",
                distinct.len(),
                pinned_in_batch,
                free_for_batch
            )));
        }
        Ok(())
    }

    /// Makes the batch's adapters slot-resident and builds the batch metadata.
    /// `seq_adapters[s]` is sequence `s`'s adapter (None = base model), its token rows are
    /// `seq_starts[s]..seq_starts[s+1]`; `logits_rows` are the rows the LM head runs on.
    pub fn prepare_batch(&mut self, seq_adapters: &[Option<AdapterKey>], seq_starts: &[u32], logits_rows: &[u32]) -> Result<BatchHook<'_>> {
        self.batch_keys.clear();
        for k in seq_adapters.iter().flatten() {
            if !self.batch_keys.contains(k) {
                if self.batch_keys.len() == self.pool.num_slots() {
                    return Err(LoraError::NoSlot(format!(
                        "batch uses more than {} distinct adapters (max_loras_per_batch)",
                        self.pool.num_slots()
                    )));
                }
                self.batch_keys.push(*k);
            }
        }
        for i in 0..self.batch_keys.len() {
            let k = self.batch_keys[i];
            match self.pool.slot_of(k) {
                Some(s) => {
                    self.pool.mark_used(s);
                    self.registry.touch(k);
                }
                None => {
                    let keys = std::mem::take(&mut self.batch_keys);
                    let r = self.make_resident(k, &keys);
                    self.batch_keys = keys;
                    r?;
                }
            }
        }
        self.seq_slots.clear();
        for k in seq_adapters {
            self.seq_slots.push(k.map(|k| self.pool.slot_of(k).expect("made resident above") as u32));
        }
        let pool = &self.pool;
        self.batch.build(&self.seq_slots, seq_starts, logits_rows, |s| pool.slot_max_rank(s))?;
        Ok(BatchHook { pool: &self.pool, rank_pools: &self.rank_pools, info: &self.batch, backend: &*self.backend, expert_rows: &self.expert_rows })
    }

    /// The metadata of the last prepared batch.
    pub fn batch_info(&self) -> &LoraBatchInfo {
        &self.batch
    }

    // ---- internals --------------------------------------------------------------------------

    fn read_adapter(&self, name: &str, path: &Path) -> Result<LoraAdapter> {
        let a = LoraAdapter::load(name, path, &self.dims)?;
        a.check_compatible(self.pool.max_rank(), self.pool.modules())?;
        Ok(a)
    }

    fn check_can_pin(&self) -> Result<()> {
        if self.pool.pinned_count() + 1 >= self.pool.num_slots() {
            return Err(LoraError::Invalid(format!(
                "not allowed to pin all LoRA slots: {} of {} slots are pinned and at least one must stay free for unpinned adapters",
                self.pool.pinned_count(),
                self.pool.num_slots()
            )));
        }
        Ok(())
    }

    /// Puts `key` into a slot (free first, else the policy's victim outside `protect`).
    fn make_resident(&mut self, key: AdapterKey, protect: &[AdapterKey]) -> Result<usize> {
        let weights = self.registry.weights(key, &self.dims, self.disk_reload)?;
        let slot = self.pool.choose_slot(|o| protect.contains(&o))?;
        if let Some(old) = self.pool.owner(slot) {
            tracing::debug!(slot, evicted = old.version, loaded = key.version, "LoRA slot eviction");
            self.free_slot(slot);
        }
        self.pool.load(slot, key, &weights)?;
        for p in &mut self.rank_pools {
            p.load(slot, key, &weights)?;
        }
        self.registry.touch(key);
        self.registry.enforce_host_cap(protect);
        Ok(slot)
    }

    /// Drops `key` entirely if nothing uses it any more, freeing its slot.
    fn collect(&mut self, key: AdapterKey) {
        if self.registry.collect(key) {
            self.remove_slot(key);
        }
    }

    fn remove_version(&mut self, key: AdapterKey) {
        if let Some(e) = self.registry.versions.get(&key.version) {
            let name = e.name.clone();
            let _ = self.registry.remove_name(&name);
        }
        self.collect(key);
    }

    fn remove_slot(&mut self, key: AdapterKey) {
        if let Some(s) = self.pool.slot_of(key) {
            self.free_slot(s);
        }
    }

    fn free_slot(&mut self, slot: usize) {
        self.pool.free_slot(slot);
        for p in &mut self.rank_pools {
            p.free_slot(slot);
        }
    }
}

/// The [`LoraHook`] of one prepared batch: each call hands the site's slot buffers and the
/// batch's row grouping to the backend, which has the model's device run its LoRA kernel on
/// the tensors where they live.
pub struct BatchHook<'a> {
    pool: &'a LoraMemoryPool,
    /// Tensor parallelism: the pools of ranks 1.. ([`LoraHook::with_rank`]).
    rank_pools: &'a [LoraMemoryPool],
    info: &'a LoraBatchInfo,
    backend: &'a dyn LoraBackend,
    expert_rows: &'a std::sync::Mutex<RowGrouping>,
}

/// Mixed into a step's shape key when any row has an adapter: the step then has LoRA launches.
const LORA_SHAPE_SALT: u64 = 0x9e37_79b9_7f4a_7c15;

impl BatchHook<'_> {
    pub fn info(&self) -> &LoraBatchInfo {
        self.info
    }
    /// The pool the batch reads (a test attaches LoRA tails to weights it loads during one).
    pub fn pool(&self) -> &LoraMemoryPool {
        self.pool
    }
    fn site_ref<'s>(&'s self, site: Option<(&'s quiver_kernels::LoraSiteBuffers, usize)>) -> Option<SiteRef<'s>> {
        site.map(|(buffers, entry)| SiteRef { buffers, table: self.pool.table(), entry })
    }
    /// A site over the batch's `m` token rows (a layer's linears, the shared expert's).
    fn token_rows(&self, dev: &dyn Device, site: Option<(&quiver_kernels::LoraSiteBuffers, usize)>, x: &Tensor, m: usize, y: &mut Tensor) {
        if !self.info.is_active() {
            return;
        }
        let Some(s) = self.site_ref(site) else { return };
        assert_eq!(m, self.info.tokens.rows(), "LoRA hook called with {m} rows but the batch was prepared for {}", self.info.tokens.rows());
        self.backend.apply(dev, s, &self.info.tokens, LoraX::Dense(x), y);
    }
}

impl LoraHook for BatchHook<'_> {
    fn linear(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &Tensor, m: usize, y: &mut Tensor) {
        self.token_rows(dev, self.pool.site(layer, site), x, m, y);
    }

    fn project(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        let rows = &self.info.tokens;
        let s = if self.info.is_active() && rows.adapter_rows > 0 { self.site_ref(self.pool.site(layer, site)) } else { None };
        let Some(s) = s else { return dev.matmul_lora(x, m, w, bias, None, epilogue, y) };
        assert_eq!(m, rows.rows(), "LoRA hook called with {m} rows but the batch was prepared for {}", rows.rows());
        match self.backend.groups(rows) {
            Some(g) => dev.matmul_lora(x, m, w, bias, Some(&s.call(g)), epilogue, y),
            None => {
                dev.matmul(x, m, w, bias, y);
                self.backend.apply(dev, s, rows, LoraX::Dense(x), y);
                epilogue.run(dev, y, m, w);
            }
        }
    }

    fn norm(&self, dev: &dyn Device, layer: usize, site: LinearSite, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, m: usize, dim: usize, out: &mut Tensor) {
        let rows = &self.info.tokens;
        let s = if self.info.is_active() && rows.adapter_rows > 0 { self.site_ref(self.pool.site(layer, site)) } else { None };
        // The same call `project` makes for this site next.
        match s.zip(self.backend.groups(rows)) {
            Some((s, g)) => dev.rms_norm_before_lora(x, delta, w, eps, m, dim, out, &s.call(g)),
            None => crate::plain_norm(dev, x, delta, w, eps, m, dim, out),
        }
    }

    fn embedding(&self, dev: &dyn Device, ids: &[u32], out: &mut Tensor) {
        if !self.info.is_active() {
            return;
        }
        let Some(s) = self.site_ref(self.pool.embedding()) else { return };
        assert_eq!(ids.len(), self.info.tokens.rows(), "LoRA embedding hook: ids do not match the prepared batch");
        self.backend.apply(dev, s, &self.info.tokens, LoraX::TokenIds(ids), out);
    }

    fn lm_head(&self, dev: &dyn Device, x: &Tensor, rows: &[u32], logits: &mut Tensor) {
        if self.info.logits.adapter_rows == 0 {
            return;
        }
        let Some(s) = self.site_ref(self.pool.lm_head()) else { return };
        assert_eq!(rows, &self.info.logits_rows[..], "LoRA lm_head hook: rows differ from the prepared logits rows");
        self.backend.apply(dev, s, &self.info.logits, LoraX::Dense(x), logits);
    }

    fn experts(&self, dev: &dyn Device, layer: usize, site: ExpertSite, route: &MoeRouting, x: &Tensor, y: &mut Tensor) {
        if !self.info.is_active() {
            return;
        }
        let Some((buffers, entry)) = self.pool.expert_site(layer, site) else { return };
        assert_eq!(route.rows, self.info.tokens.rows(), "LoRA expert hook: routing of {} rows for a batch of {}", route.rows, self.info.tokens.rows());
        let table = self.pool.expert_table();
        // A device whose routing is in host memory groups the positions here, by (slot, expert),
        // and runs the same backend policy as every other site.
        let host = |h: &HostRouting, x: &Tensor, y: &mut Tensor| {
            let n = route.rows * route.spec.top_k;
            let mut g = self.expert_rows.lock().unwrap();
            g.group_experts(&self.info.tokens.row_slot, &h.offsets, &h.row_of[..n], self.info.num_slots, self.info.chunk_size, self.info.tile_rows);
            if g.adapter_rows > 0 {
                self.backend.apply(dev, SiteRef { buffers, table, entry }, &g, LoraX::Dense(x), y);
            }
        };
        let call = LoraExpertCall { buffers, table, entry, slots: self.info.num_slots, token_groups: &self.info.tokens.packed_segments, host: &host };
        dev.lora_experts(&call, route, x, y);
    }

    fn shared_expert(&self, dev: &dyn Device, layer: usize, site: ExpertSite, x: &Tensor, m: usize, y: &mut Tensor) {
        self.token_rows(dev, self.pool.shared_site(layer, site), x, m, y);
    }

    fn is_active(&self) -> bool {
        self.info.is_active()
    }

    fn with_rank(&self, rank: usize, f: &mut dyn FnMut(&dyn LoraHook)) {
        let pool = rank.checked_sub(1).and_then(|r| self.rank_pools.get(r));
        let pool = pool.unwrap_or_else(|| panic!("LoRA hook of tensor-parallel rank {rank} but the pool has {} ranks", self.rank_pools.len() + 1));
        f(&BatchHook { pool, rank_pools: &[], ..*self })
    }

    fn staged(&self) -> [&[u32]; 4] {
        let (t, l) = (&self.info.tokens, &self.info.logits);
        [&t.packed_segments, &t.packed_chunks, &l.packed_segments, &l.packed_chunks]
    }

    /// Whether the token rows and the logits rows have adapter rows decides which LoRA calls a
    /// step makes (the hook skips the others), and the grouping the backend hands the device
    /// (segments, or chunks of the slot-sorted permutation) decides which staged tile list a
    /// recorded step's launches read; all go into the key. Without the grouping a step recorded
    /// with one adapter (one 256-row segment) was replayed for 16 interleaved adapters reading
    /// their segments, 256 one-row tiles, each loading its adapter's A and B: served decode at
    /// 256 rows took 37 ms instead of ~25.
    fn shape_key(&self) -> u64 {
        let kind = |g: &RowGrouping| -> u64 {
            if g.adapter_rows == 0 {
                return 0;
            }
            match self.backend.groups(g).map(|gr| gr.group_rows) {
                Some(GroupRows::Contiguous) => 1,
                Some(GroupRows::Permuted(_)) => 2,
                None => 3,
            }
        };
        let (t, l) = (kind(&self.info.tokens), kind(&self.info.logits));
        if t == 0 && l == 0 {
            0
        } else {
            LORA_SHAPE_SALT ^ (t | l << 2).wrapping_mul(0x0100_0000_01b3)
        }
    }
}
