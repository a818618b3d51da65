//! Paged KV block pool with an adapter-aware prefix cache.
//!
//! The pool hands out fixed-size blocks (indices into one [`quiver_kernels::KvStorage`]) with
//! reference counts. A block is in exactly one of three states:
//! - **free**: on the free list;
//! - **in use**: `refs > 0` (held by one or more sequences; shared prompt blocks of `n > 1`
//!   samples and prefix-cache hits have `refs > 1`);
//! - **cached idle**: `refs == 0` but registered in the prefix cache, reusable by a later hit
//!   and reclaimable (LRU) when the free list is empty.
//!
//! # Prefix cache keys
//! The cache is a tree of full blocks. A block's key is `(parent, tokens)` where `parent` is
//! either [`Parent::Root`] carrying the structured adapter identity `Option<AdapterKey>`
//! (`None` = base model; `AdapterKey` = `(adapter id, version)`) or [`Parent::Block`], the
//! cached block holding the previous 16 tokens. Keys are compared exactly (the `u64` hash only
//! picks a bucket), so there is no string concatenation to alias and no hash collision to
//! exploit: a base request can never hit an adapter's blocks, an adapter never hits another's,
//! and a replaced adapter (new version) never hits the old version's blocks.
//!
//! Eviction takes the least recently released idle *leaf* (a block with no cached children), so
//! a parent is never evicted under a child and a `Parent::Block` id always names the block it
//! was registered with.

use quiver_lora::AdapterKey;
use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

pub type BlockId = u32;

/// Where a cached block hangs in the prefix tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Parent {
    /// First block of a sequence, namespaced by adapter identity and version (None = base).
    Root(Option<AdapterKey>),
    /// The cached block holding the previous tokens.
    Block(BlockId),
}

#[derive(Clone)]
struct Meta {
    refs: u32,
    /// Registered in the prefix cache under `(parent, tokens)`.
    cached: bool,
    parent: Parent,
    hash: u64,
    /// Cached blocks whose parent is this one.
    children: u32,
    last_used: u64,
}

pub struct BlockPool {
    block_size: usize,
    meta: Vec<Meta>,
    /// `tokens[b*bs..(b+1)*bs]`: the tokens of cached block `b`.
    tokens: Vec<u32>,
    free: Vec<BlockId>,
    map: HashMap<u64, Vec<BlockId>>,
    /// Idle cached leaves, LRU first.
    evictable: BTreeSet<(u64, BlockId)>,
    idle_cached: usize,
    clock: u64,
    enabled: bool,
    /// Cached blocks reclaimed for new allocations.
    pub evictions: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, prefix_cache: bool) -> Self {
        assert!(num_blocks > 0 && num_blocks < u32::MAX as usize);
        BlockPool {
            block_size,
            meta: vec![Meta { refs: 0, cached: false, parent: Parent::Root(None), hash: 0, children: 0, last_used: 0 }; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            // Pop from the end: hand out low block ids first.
            free: (0..num_blocks as u32).rev().collect(),
            map: HashMap::new(),
            evictable: BTreeSet::new(),
            idle_cached: 0,
            clock: 0,
            enabled: prefix_cache,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }
    pub fn prefix_cache_enabled(&self) -> bool {
        self.enabled
    }
    /// Blocks an allocation can get now (free + reclaimable cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle_cached
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_cached_idle(&self) -> usize {
        self.idle_cached
    }
    /// Blocks held by at least one sequence.
    pub fn num_in_use(&self) -> usize {
        self.meta.len() - self.free.len() - self.idle_cached
    }
    pub fn refs(&self, b: BlockId) -> u32 {
        self.meta[b as usize].refs
    }

    fn key_hash(parent: Parent, tokens: &[u32]) -> u64 {
        let mut h = DefaultHasher::new();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// A fresh block with one reference, reclaiming the LRU idle cached block if none is free.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let &(t, b) = self.evictable.iter().next()?;
                self.evictable.remove(&(t, b));
                self.uncache(b);
                self.idle_cached -= 1;
                self.evictions += 1;
                b
            }
        };
        let m = &mut self.meta[b as usize];
        debug_assert_eq!(m.refs, 0);
        m.refs = 1;
        Some(b)
    }

    fn uncache(&mut self, b: BlockId) {
        let (parent, hash) = {
            let m = &mut self.meta[b as usize];
            debug_assert!(m.cached && m.children == 0);
            m.cached = false;
            (m.parent, m.hash)
        };
        if let Some(v) = self.map.get_mut(&hash) {
            v.retain(|&x| x != b);
            if v.is_empty() {
                self.map.remove(&hash);
            }
        }
        if let Parent::Block(p) = parent {
            let pm = &mut self.meta[p as usize];
            pm.children -= 1;
            if pm.children == 0 && pm.refs == 0 && pm.cached {
                self.evictable.insert((pm.last_used, p));
            }
        }
    }

    /// One more holder of `b` (a prefix-cache hit or a forked sample sharing the prompt).
    pub fn retain(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        if m.refs == 0 {
            debug_assert!(m.cached, "retaining a free block");
            self.idle_cached -= 1;
            if m.children == 0 {
                self.evictable.remove(&(m.last_used, b));
            }
        }
        m.refs += 1;
    }

    /// A holder of `b` is done with it.
    pub fn release(&mut self, b: BlockId) {
        self.clock += 1;
        let m = &mut self.meta[b as usize];
        debug_assert!(m.refs > 0, "double release of block {b}");
        m.refs -= 1;
        if m.refs == 0 {
            if m.cached {
                m.last_used = self.clock;
                self.idle_cached += 1;
                if m.children == 0 {
                    self.evictable.insert((m.last_used, b));
                }
            } else {
                self.free.push(b);
            }
        }
    }

    /// The cached block with exactly this key.
    pub fn lookup(&self, parent: Parent, tokens: &[u32]) -> Option<BlockId> {
        if !self.enabled {
            return None;
        }
        let bs = self.block_size;
        let h = Self::key_hash(parent, tokens);
        self.map.get(&h)?.iter().copied().find(|&b| {
            let m = &self.meta[b as usize];
            m.parent == parent && self.tokens[b as usize * bs..(b as usize + 1) * bs] == *tokens
        })
    }

    /// Longest run of cached full blocks matching `tokens` under `root`, at most `max_blocks`.
    /// Block ids go to `out` (cleared first); no references are taken.
    pub fn match_prefix(&self, root: Option<AdapterKey>, tokens: &[u32], max_blocks: usize, out: &mut Vec<BlockId>) {
        out.clear();
        if !self.enabled {
            return;
        }
        let bs = self.block_size;
        let mut parent = Parent::Root(root);
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            match self.lookup(parent, chunk) {
                Some(b) => {
                    out.push(b);
                    parent = Parent::Block(b);
                }
                None => break,
            }
        }
    }

    /// Registers the full, computed block `b` (held by the caller) under `(parent, tokens)`.
    /// Returns false when caching is off or an identical block is already cached (the caller
    /// then keeps `b` private and stops registering that sequence's later blocks).
    pub fn register(&mut self, b: BlockId, parent: Parent, tokens: &[u32]) -> bool {
        if !self.enabled {
            return false;
        }
        debug_assert_eq!(tokens.len(), self.block_size);
        if let Parent::Block(p) = parent {
            if !self.meta[p as usize].cached {
                return false;
            }
        }
        if self.meta[b as usize].cached || self.lookup(parent, tokens).is_some() {
            return false;
        }
        let bs = self.block_size;
        let h = Self::key_hash(parent, tokens);
        self.tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
        let m = &mut self.meta[b as usize];
        debug_assert!(m.refs > 0);
        m.cached = true;
        m.parent = parent;
        m.hash = h;
        m.children = 0;
        self.map.entry(h).or_default().push(b);
        if let Parent::Block(p) = parent {
            self.meta[p as usize].children += 1;
        }
        true
    }

    /// Drops every idle cached block (tests, and `--disable-prefix-cache` toggles).
    pub fn clear_cache(&mut self) {
        while let Some(&(t, b)) = self.evictable.iter().next() {
            self.evictable.remove(&(t, b));
            self.uncache(b);
            self.idle_cached -= 1;
            self.free.push(b);
        }
    }

    /// Recomputes every counter from scratch and checks it (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.meta.len();
        let mut on_free = vec![false; n];
        for &b in &self.free {
            if on_free[b as usize] {
                return Err(format!("block {b} twice on the free list"));
            }
            on_free[b as usize] = true;
            let m = &self.meta[b as usize];
            if m.refs != 0 || m.cached {
                return Err(format!("free block {b} has refs {} cached {}", m.refs, m.cached));
            }
        }
        let idle = self.meta.iter().filter(|m| m.refs == 0 && m.cached).count();
        if idle != self.idle_cached {
            return Err(format!("idle cached count {} but {} found", self.idle_cached, idle));
        }
        let unaccounted = self.meta.iter().enumerate().filter(|(i, m)| m.refs == 0 && !m.cached && !on_free[*i]).count();
        if unaccounted != 0 {
            return Err(format!("{unaccounted} blocks are neither free, cached nor held"));
        }
        let mut children = vec![0u32; n];
        for m in self.meta.iter().filter(|m| m.cached) {
            if let Parent::Block(p) = m.parent {
                children[p as usize] += 1;
            }
        }
        for (i, m) in self.meta.iter().enumerate() {
            if m.cached && m.children != children[i] {
                return Err(format!("block {i} children {} but {} found", m.children, children[i]));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_lora::AdapterId;

    fn key(id: u32, v: u64) -> Option<AdapterKey> {
        Some(AdapterKey { id: AdapterId(id), version: v })
    }

    #[test]
    fn allocate_release_and_cache_roundtrip() {
        let mut p = BlockPool::new(4, 2, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, Parent::Root(None), &[1, 2]));
        assert!(p.register(b, Parent::Block(a), &[3, 4]));
        p.release(b);
        p.release(a);
        assert_eq!(p.available(), 4);
        assert_eq!(p.num_cached_idle(), 2);
        let mut out = Vec::new();
        p.match_prefix(None, &[1, 2, 3, 4, 5], 8, &mut out);
        assert_eq!(out, vec![a, b]);
        // Other namespaces never match.
        p.match_prefix(key(1, 1), &[1, 2, 3, 4], 8, &mut out);
        assert!(out.is_empty());
        // Exhaust: the leaf goes before its parent.
        let got: Vec<_> = (0..4).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(got.len(), 4);
        assert!(p.allocate().is_none());
        p.check_invariants().unwrap();
        for g in got {
            p.release(g);
        }
        assert_eq!(p.num_free(), 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn leaf_first_eviction_and_versions() {
        let mut p = BlockPool::new(3, 1, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, Parent::Root(key(1, 1)), &[7]));
        assert!(p.register(b, Parent::Block(a), &[8]));
        p.release(a);
        p.release(b);
        let c = p.allocate().unwrap(); // the free one
        let d = p.allocate().unwrap(); // evicts b (leaf), not a
        assert_eq!(d, b);
        let mut out = Vec::new();
        p.match_prefix(key(1, 1), &[7, 8], 2, &mut out);
        assert_eq!(out, vec![a]);
        p.match_prefix(key(1, 2), &[7, 8], 2, &mut out);
        assert!(out.is_empty(), "a new version must not hit the old one's blocks");
        p.release(c);
        p.release(d);
        p.check_invariants().unwrap();
    }
}
