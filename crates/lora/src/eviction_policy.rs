//! Victim choice among slots (or host-cache entries): LRU refreshes an entry on every use,
//! FIFO only on insertion. Stamps live in a fixed array, so marking and choosing allocate
//! nothing.

use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used first (SGLang's default).
    #[default]
    Lru,
    /// Oldest insertion first; reuse does not refresh.
    Fifo,
}

impl FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(EvictionPolicy::Lru),
            "fifo" => Ok(EvictionPolicy::Fifo),
            _ => Err(format!("unknown LoRA eviction policy `{s}` (valid: lru, fifo)")),
        }
    }
}

/// Per-entry stamps ordered by a logical clock.
#[derive(Clone, Debug)]
pub struct EvictionTracker {
    policy: EvictionPolicy,
    clock: u64,
    stamps: Vec<u64>,
}

impl EvictionTracker {
    pub fn new(policy: EvictionPolicy, entries: usize) -> Self {
        EvictionTracker { policy, clock: 0, stamps: vec![0; entries] }
    }
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }
    /// An entry was just filled.
    pub fn inserted(&mut self, i: usize) {
        self.clock += 1;
        self.stamps[i] = self.clock;
    }
    /// An entry was used by a batch.
    pub fn used(&mut self, i: usize) {
        if self.policy == EvictionPolicy::Lru {
            self.clock += 1;
            self.stamps[i] = self.clock;
        }
    }
    /// The evictable entry with the oldest stamp.
    pub fn victim(&self, evictable: impl Fn(usize) -> bool) -> Option<usize> {
        (0..self.stamps.len()).filter(|&i| evictable(i)).min_by_key(|&i| self.stamps[i])
    }
}
