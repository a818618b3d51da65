//! Collectives between the ranks of a tensor-parallel group: the sum of every rank's partial
//! output of a row-parallel projection (all-reduce) and the concatenation of every rank's logit
//! columns (all-gather). The model calls them through [`Collective`] without naming a device;
//! each device family provides its own (`Device::tensor_parallel_group`).
//!
//! [`host_group`] is the in-process implementation over host tensors, for CPU ranks that are
//! threads of one process. Every all-reduced element is summed in rank order,
//! `((y_0 + y_1) + y_2) + …`, whichever thread computes it, so a run is deterministic.

use crate::Tensor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// One rank's handle on its group's collectives. Every rank must make the same calls in the
/// same order with the same sizes; a call returns once every rank has made it.
pub trait Collective: Send + Sync {
    /// This handle's rank, `0..ranks()`.
    fn rank(&self) -> usize;
    fn ranks(&self) -> usize;
    /// The first `len` elements of `buf` become, on every rank, the sum of every rank's.
    fn all_reduce_sum(&self, buf: &mut Tensor, len: usize);
    /// `out[i, r·cols + j] = local_r[i, j]` for `i < rows`, `j < cols`, on every rank: each
    /// rank's `[rows, cols]` block side by side in rank order (the logits of a vocab-parallel
    /// LM head, whose rank r holds vocab columns `r·cols..(r+1)·cols`).
    fn all_gather_cols(&self, local: &Tensor, rows: usize, cols: usize, out: &mut Tensor);
    /// Makes every collective of the group, waiting or later, panic instead of waiting: a rank
    /// that failed calls it, so the others fail too rather than wait for it forever.
    fn abort(&self);
}

/// The collectives of `ranks` threads of this process over host tensors: handle `r` for rank
/// `r`. A rank's buffers are read and written by the other ranks' threads while every rank is
/// inside the same call, between two barriers.
pub fn host_group(ranks: usize) -> Vec<Arc<dyn Collective>> {
    assert!((1..=MAX_HOST_RANKS).contains(&ranks), "an in-process group has 1 to {MAX_HOST_RANKS} ranks");
    let shared = Arc::new(HostShared {
        ranks,
        barrier: Mutex::new(BarrierState { arrived: 0, generation: 0, aborted: false }),
        wake: Condvar::new(),
        ptrs: (0..ranks).map(|_| AtomicUsize::new(0)).collect(),
        lens: (0..ranks).map(|_| AtomicUsize::new(0)).collect(),
    });
    (0..ranks).map(|rank| Arc::new(HostCollective { rank, shared: shared.clone() }) as Arc<dyn Collective>).collect()
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

struct HostShared {
    ranks: usize,
    barrier: Mutex<BarrierState>,
    wake: Condvar,
    /// Each rank's buffer of the current call (its address) and length, published before the
    /// first barrier of the call; the barrier's lock orders them before the other ranks' reads.
    ptrs: Box<[AtomicUsize]>,
    lens: Box<[AtomicUsize]>,
}

const ABORTED: &str = "another rank of the tensor-parallel group failed";

impl HostShared {
    /// Waits until every rank has arrived (or panics if the group was aborted).
    fn barrier(&self) {
        let mut s = self.barrier.lock().unwrap_or_else(|p| p.into_inner());
        assert!(!s.aborted, "{ABORTED}");
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.ranks {
            s.arrived = 0;
            s.generation += 1;
            self.wake.notify_all();
            return;
        }
        while s.generation == generation && !s.aborted {
            s = self.wake.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        assert!(!s.aborted, "{ABORTED}");
    }

    fn publish(&self, rank: usize, ptr: *const f32, len: usize) {
        self.ptrs[rank].store(ptr as usize, Ordering::Relaxed);
        self.lens[rank].store(len, Ordering::Relaxed);
    }

    /// Rank `r`'s published buffer and length.
    fn buffer(&self, r: usize) -> (*mut f32, usize) {
        (self.ptrs[r].load(Ordering::Relaxed) as *mut f32, self.lens[r].load(Ordering::Relaxed))
    }
}

struct HostCollective {
    rank: usize,
    shared: Arc<HostShared>,
}

impl Collective for HostCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.shared.ranks
    }

    /// Reduce-scatter then all-gather in one pass: rank r sums elements of its own 1/N of the
    /// range over every rank's buffer in rank order and writes the sum back into every buffer,
    /// so no element is written by two threads and no scratch buffer is needed.
    fn all_reduce_sum(&self, buf: &mut Tensor, len: usize) {
        let s = &*self.shared;
        let n = s.ranks;
        if n == 1 {
            return;
        }
        let mine = buf.as_cpu_mut()[..len].as_mut_ptr();
        s.publish(self.rank, mine, len);
        s.barrier();
        let bufs: [(*mut f32, usize); MAX_HOST_RANKS] = std::array::from_fn(|r| if r < n { s.buffer(r) } else { (std::ptr::null_mut(), 0) });
        if let Some(r) = bufs[..n].iter().position(|b| b.1 != len) {
            s.barrier.lock().unwrap_or_else(|p| p.into_inner()).aborted = true;
            s.wake.notify_all();
            panic!("all-reduce of {len} elements on rank {} but {} on rank {r}", self.rank, bufs[r].1);
        }
        let chunk = len.div_ceil(n);
        let (lo, hi) = ((self.rank * chunk).min(len), ((self.rank + 1) * chunk).min(len));
        // SAFETY: every rank's buffer stays borrowed by its thread, which waits in this call
        // until the second barrier; between the barriers rank r touches only elements lo..hi
        // of each buffer, and those ranges are disjoint across ranks.
        unsafe {
            for i in lo..hi {
                let mut sum = *bufs[0].0.add(i);
                for b in &bufs[1..n] {
                    sum += *b.0.add(i);
                }
                for b in &bufs[..n] {
                    *b.0.add(i) = sum;
                }
            }
        }
        s.barrier();
    }

    fn all_gather_cols(&self, local: &Tensor, rows: usize, cols: usize, out: &mut Tensor) {
        let s = &*self.shared;
        let n = s.ranks;
        let width = n * cols;
        let out = &mut out.as_cpu_mut()[..rows * width];
        if n == 1 {
            out.copy_from_slice(&local.as_cpu()[..rows * cols]);
            return;
        }
        s.publish(self.rank, local.as_cpu()[..rows * cols].as_ptr(), rows * cols);
        s.barrier();
        for r in 0..n {
            let (p, len) = s.buffer(r);
            assert_eq!(len, rows * cols, "all-gather sizes differ between ranks {} and {r}", self.rank);
            // SAFETY: rank r's block is only read until the second barrier, which its thread
            // waits for before it may write the block again.
            let block = unsafe { std::slice::from_raw_parts(p as *const f32, len) };
            for (o, l) in out.chunks_mut(width).zip(block.chunks(cols)) {
                o[r * cols..(r + 1) * cols].copy_from_slice(l);
            }
        }
        s.barrier();
    }

    fn abort(&self) {
        let s = &*self.shared;
        s.barrier.lock().unwrap_or_else(|p| p.into_inner()).aborted = true;
        s.wake.notify_all();
    }
}

/// Most ranks of an in-process group (the reduction keeps their buffers in a fixed array).
pub const MAX_HOST_RANKS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank gets the rank-ordered sum and the side-by-side gather, and a group whose rank
    /// aborted fails the others' calls instead of hanging them.
    #[test]
    fn host_group_reduces_in_rank_order_and_gathers_columns() {
        for n in [1, 2, 3, 4] {
            let group = host_group(n);
            let len = 37;
            let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|sc| {
                let hs: Vec<_> = group
                    .iter()
                    .map(|c| {
                        sc.spawn(move || {
                            let r = c.rank();
                            let mut t = Tensor::cpu((0..len).map(|i| (i * 10 + r) as f32 * 0.1).collect());
                            c.all_reduce_sum(&mut t, len);
                            let local = Tensor::cpu((0..2 * 3).map(|i| (r * 100 + i) as f32).collect());
                            let mut out = Tensor::zeros_cpu(2 * 3 * n);
                            c.all_gather_cols(&local, 2, 3, &mut out);
                            (t.as_cpu()[..len].to_vec(), out.as_cpu().to_vec())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (sum, gathered) in &results {
                for (i, &v) in sum.iter().enumerate() {
                    let mut want = (i * 10) as f32 * 0.1;
                    for r in 1..n {
                        want += (i * 10 + r) as f32 * 0.1;
                    }
                    assert_eq!(v.to_bits(), want.to_bits(), "n {n}, element {i}");
                }
                for row in 0..2 {
                    for r in 0..n {
                        for j in 0..3 {
                            assert_eq!(gathered[row * 3 * n + r * 3 + j], (r * 100 + row * 3 + j) as f32);
                        }
                    }
                }
            }
        }
        let group = host_group(2);
        group[1].abort();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| group[0].all_reduce_sum(&mut Tensor::zeros_cpu(4), 4)));
        assert!(r.is_err(), "a collective of an aborted group must fail");
    }
}
