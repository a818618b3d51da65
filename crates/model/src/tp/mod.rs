//! Tensor parallelism (ARCHITECTURE.md, *Tensor parallelism*): the model the engine holds is
//! rank 0's shard and carries the group — the other ranks' models and the threads that run
//! them — so a forward pass runs every rank's shard of the step at once and nothing above the
//! model changes. Each rank's forward is `LlamaModel::run_rank` over its own weights, KV store,
//! workspace and LoRA pool; the collectives join them.

mod rank_threads;
pub mod shard;

use crate::batch::ForwardBatch;
use crate::llama::{Head, KvCache, LlamaModel, Workspace};
use quiver_kernels::{Collective, KvStorage};
use quiver_lora::{LoraHook, TpShard};
use rank_threads::RankThreads;
use std::sync::Arc;

/// A rank's place in its tensor-parallel group.
pub struct TensorParallel {
    pub shard: TpShard,
    pub comm: Arc<dyn Collective>,
    /// Rank 0 only: ranks 1.. and the threads that run them.
    pub(crate) group: Option<RankGroup>,
}

impl TensorParallel {
    /// Rank 0 of a group whose ranks 1.. are `peers` (each built with its own shard and
    /// collective); `comms` are every rank's collectives, aborted together when a rank fails.
    pub fn leader(shard: TpShard, comms: Vec<Arc<dyn Collective>>, peers: Vec<LlamaModel>) -> TensorParallel {
        let comm = comms[0].clone();
        let ranks = comms.len();
        assert_eq!(peers.len() + 1, ranks, "one peer model per rank after the first");
        let abort = Box::new(move || comms.iter().for_each(|c| c.abort()));
        TensorParallel { shard, comm, group: Some(RankGroup { peers, threads: RankThreads::new(ranks, abort) }) }
    }

    /// Rank `shard.rank` ≥ 1, run by its leader.
    pub fn peer(shard: TpShard, comm: Arc<dyn Collective>) -> TensorParallel {
        TensorParallel { shard, comm, group: None }
    }
}

pub(crate) struct RankGroup {
    pub(crate) peers: Vec<LlamaModel>,
    threads: RankThreads,
}

/// A pointer that the ranks' threads share; each rank dereferences only its own target.
struct RankPtr<T>(*mut T);
unsafe impl<T> Send for RankPtr<T> {}
unsafe impl<T> Sync for RankPtr<T> {}

impl<T> RankPtr<T> {
    /// Rank `r`'s target: the `r`-th element from this one.
    fn at(&self, r: usize) -> *mut T {
        self.0.wrapping_add(r)
    }
}

impl RankGroup {
    /// One step on every rank: `leader` (rank 0) with `kv.storage` and `ws`, rank r ≥ 1 with
    /// its peer model, `kv.peers[r - 1]`, `ws.peers[r - 1]` and the LoRA hook's rank r.
    pub(crate) fn forward(&self, leader: &LlamaModel, batch: &ForwardBatch, kv: &mut KvCache, ws: &mut Workspace, lora: &dyn LoraHook, head: Head) {
        assert_eq!(kv.peers.len(), self.peers.len(), "a KV cache allocated by another model");
        assert_eq!(ws.peers.len(), self.peers.len(), "a workspace allocated by another model");
        // Taken out (no allocation) so that rank 0's `&mut Workspace` does not cover them.
        let mut kv_peers: Vec<KvStorage> = std::mem::take(&mut kv.peers);
        let mut ws_peers: Vec<Workspace> = std::mem::take(&mut ws.peers);
        let (kv0, ws0) = (RankPtr(&mut kv.storage as *mut KvStorage), RankPtr(ws as *mut Workspace));
        let (kvp, wsp) = (RankPtr(kv_peers.as_mut_ptr()), RankPtr(ws_peers.as_mut_ptr()));
        self.threads.run(&|r| {
            // SAFETY: rank r alone dereferences its KV store and workspace, and `run` returns
            // only after every rank has finished with them.
            let (kv, ws) = unsafe {
                match r {
                    0 => (&mut *kv0.at(0), &mut *ws0.at(0)),
                    _ => (&mut *kvp.at(r - 1), &mut *wsp.at(r - 1)),
                }
            };
            match r {
                0 => leader.run_rank(batch, kv, ws, lora, head),
                _ => lora.with_rank(r, &mut |hook| self.peers[r - 1].run_rank(batch, kv, ws, hook, head)),
            }
        });
        kv.peers = kv_peers;
        ws.peers = ws_peers;
    }
}
