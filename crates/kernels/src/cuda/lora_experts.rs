//! LoRA on MoE experts on CUDA (`Device::lora_experts`; kernel in `lora_experts.cu`): the
//! routing never leaves the GPU, so the positions are grouped by (adapter slot, expert) there,
//! into packed groups of the dense LoRA kernels' layout (`lora.rs`), and the dense shrink and
//! expand run over them with A, Bᵀ and the table addressed per expert-site slot `w·E + e`.
//!
//! Three launches per site, all sized by the pair count `n = m·k` alone (the host never reads
//! how many tiles there are), so an MoE decode step with expert adapters records as a graph and
//! replays right for any routing and any adapter mix: the grouping (one block: key counts in
//! shared memory, a block scan, the tiles, the positions), then the shrink and the expand over
//! fixed grids that loop over the tiles the grouping wrote.

use super::lora::{fixed_blocks, lora_site_at, LoraLaunch};
use super::*;
use crate::lora::LoraExpertCall;
use crate::moe::MoeRouting;

/// Most (adapter slot, expert) keys the grouping counts: its counters fill 32 KiB of shared
/// memory, within the 48 KB a block gets without opting in. Qwen3-30B-A3B's 128 experts allow
/// 64 slots, Mixtral's 8 allow 1024.
pub(super) const MAX_EXPERT_KEYS: usize = 8192;
/// Threads of the grouping's one block (`LEG_THREADS`).
const GROUP_THREADS: u32 = 1024;

/// u32 words of the packed groups over `pairs` positions: the tile count, then perm and each
/// tile's start, length and key (`lora.cu`'s layout; the row-indexed tables of `pack_tiles` are
/// not needed).
pub(super) fn expert_groups_words(pairs: usize) -> usize {
    1 + 4 * pairs
}

impl CudaDevice {
    /// Expert LoRA within the grouping's bound, or why not (naming the flag to lower).
    pub(super) fn lora_experts_check(&self, slots: usize, experts: usize) -> Result<(), String> {
        let keys = slots * experts;
        if keys <= MAX_EXPERT_KEYS {
            return Ok(());
        }
        Err(format!(
            "the CUDA grouping of routed rows counts at most {MAX_EXPERT_KEYS} (adapter slot, expert) pairs, and {slots} slots × {experts} experts are {keys}: lower --max-loras-per-batch to at most {}",
            MAX_EXPERT_KEYS / experts.max(1)
        ))
    }

    pub(super) fn lora_experts_impl(&self, call: &LoraExpertCall<'_>, route: &MoeRouting, x: &Tensor, y: &mut Tensor) {
        self.bind();
        let (k, e) = (route.spec.top_k, route.spec.num_experts);
        let n = route.rows * k;
        if n == 0 {
            return;
        }
        let keys = call.slots * e;
        assert!(keys <= MAX_EXPERT_KEYS, "expert LoRA over {keys} (slot, expert) keys: the pool checks lora_experts_supported first");
        assert_eq!(call.table.slots, keys, "expert LoRA table of {} slots for {} adapter slots × {e} experts", call.table.slots, call.slots);
        assert_eq!(call.token_rows(), route.rows, "expert LoRA: token groups staged for {} rows, routing of {}", call.token_rows(), route.rows);
        let recording = self.recording.load(std::sync::atomic::Ordering::Relaxed);
        let mut st = self.state.lock().unwrap();
        let words = expert_groups_words(n);
        if st.lora_expert_groups.bytes < words * 4 {
            assert!(!recording, "expert LoRA groups too small while recording a step: stage_batch sizes them");
            self.grow(&mut st.lora_expert_groups, words * 4);
        }
        let gp = st.lora_expert_groups.ptr;
        let row_slot = self.meta_ptr(&mut st, call.token_groups) + 4 * call.row_slot_offset() as u64;
        let (expert, pos_of) = moe::routing_pairs(route);
        launch!(self, self.k.lora_expert_group, (1, 1, 1), (GROUP_THREADS, 1, 1), smem = (keys * 4) as u32;
            expert, pos_of, row_slot, gp, n as i32, k as i32, e as i32, keys as i32);
        self.mark("lora expert group");
        let site = lora_site_at(call.buffers, call.table, call.entry, gp, n, recording);
        self.lora_shrink_dense(&mut st, &site, x, fixed_blocks(n));
        let launch = LoraLaunch { shape: site.shape, gp, cap: n, items: fixed_blocks(n), t: st.lora_t.ptr, b: site.b, ranks: site.ranks, scal: site.scal };
        drop(st);
        self.lora_expand_launch(&launch, buf(y));
    }
}
