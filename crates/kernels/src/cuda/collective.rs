//! Tensor parallelism on CUDA: a group of `CudaDevice`s, one per rank, in this process (each
//! rank's forward runs on its own thread, ARCHITECTURE.md *Tensor parallelism*), and the
//! collectives between them as our own kernels (`collective.cu`) that read and write the other
//! ranks' buffers through unified addressing — on one GPU, or across GPUs with peer access
//! (NVLink or PCIe P2P), which the group enables at creation.
//!
//! Why not NCCL: every rank is a thread of one process, so a rank's kernel can address every
//! other rank's buffer directly, and the messages of a decode step are small (rows × hidden
//! floats), where a one-pass reduce beats a ring's latency (vLLM's custom all-reduce makes the
//! same choice). Our kernel also sums in rank order, `((y_0 + y_1) + y_2) + …`, like the CPU
//! group, so a CUDA TP run is deterministic; NCCL's order is its own. NCCL would still be the
//! way for GPUs without peer access, which the group refuses, naming them.
//!
//! Ordering: a collective is two host barriers between the ranks' threads, each followed by
//! stream waits on the events the other ranks recorded before it. After the first every rank's
//! stream waits until every rank's partial is written; after the second, until every rank's
//! kernel has finished with the others' buffers, so none is overwritten while still read. The
//! host never waits for the GPU. A kernel after such a wait is launched plainly (`launch!(after_wait
//! …)`): a programmatic launch (PDL) waits for its predecessor kernel, not for event waits
//! between them. Steps of a group run eagerly (no CUDA graphs: a graph cannot
//! hold the host barrier).
//!
//! `QUIVER_CUDA_TP_FLAGS=1` (opt-in, the first step towards graphs for a group): the kernels
//! order themselves on the device instead (`*_flags` in collective.cu: each block meets the same
//! block of every rank through flags in peer memory, before and after touching the buffers), so
//! the stream carries no event waits; the host still exchanges the buffers' addresses with two
//! spin barriers per call, which a recorded step does once, at recording. With
//! `QUIVER_CUDA_TP_GRAPHS=1` too the group's decode steps are recorded and replayed like a single
//! device's, the ranks agreeing on each step's mode (`GroupAgree`, graphs.rs). Both opt-in:
//! they pass the TP checks with ranks sharing one H100 (session 25), and their speed against
//! the event-ordered path needs several GPUs to measure.

use super::*;
use crate::comm::Collective;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Most ranks of a CUDA group (the kernels take the ranks' pointers one by one).
pub(super) const MAX_RANKS: usize = 8;

/// Lets the ranks of a group share GPUs when there are fewer GPUs than ranks: tests the
/// sharded path on one GPU; never faster than one rank.
const SHARE_ENV: &str = "QUIVER_CUDA_TP_SHARE_GPUS";
/// Makes every collective wait on the host (see `Shared::host_sync`).
const SYNC_ENV: &str = "QUIVER_CUDA_TP_SYNC";
/// Orders the collectives on the device (see the module docs and `RankFlags`).
const FLAGS_ENV: &str = "QUIVER_CUDA_TP_FLAGS";
/// Records a group's decode steps as CUDA graphs (with `FLAGS_ENV`; see `GroupAgree`).
const GRAPHS_ENV: &str = "QUIVER_CUDA_TP_GRAPHS";
/// Blocks of a device-ordered collective kernel (`TP_FLAG_BLOCKS`): every call launches all of
/// them, so block b of each rank takes part in each call.
const FLAG_BLOCKS: usize = 32;

/// The devices and collectives of `ranks` ranks, rank r on GPU `(first + r) % GPUs`.
pub(super) fn group(first: usize, ranks: usize) -> Result<Vec<(Arc<dyn Device>, Arc<dyn Collective>)>> {
    if !(1..=MAX_RANKS).contains(&ranks) {
        bail!("{ranks} ranks: a CUDA group has 1 to {MAX_RANKS}");
    }
    let gpus = CudaContext::device_count().context("counting CUDA devices")? as usize;
    let ordinals: Vec<usize> = (0..ranks).map(|r| (first + r) % gpus.max(1)).collect();
    if ranks > gpus && std::env::var_os(SHARE_ENV).is_none_or(|v| v == "0") {
        bail!(
            "{ranks} ranks need {ranks} GPUs from cuda:{first} and this machine has {gpus} ({SHARE_ENV}=1 runs ranks on shared GPUs: it checks the sharded path, and is slower than one rank)"
        );
    }
    if ranks > gpus {
        tracing::warn!("{ranks} tensor-parallel ranks share {gpus} GPU(s) ({SHARE_ENV}): a correctness mode, slower than one rank");
    }
    let flags = std::env::var_os(FLAGS_ENV).is_some_and(|v| v != "0");
    // A capture cannot hold the host waits of QUIVER_CUDA_TP_SYNC either.
    let graphs = flags && std::env::var_os(GRAPHS_ENV).is_some_and(|v| v != "0") && std::env::var_os(SYNC_ENV).is_none_or(|v| v == "0");
    if std::env::var_os(GRAPHS_ENV).is_some_and(|v| v != "0") && !flags {
        tracing::warn!("{GRAPHS_ENV}=1 needs {FLAGS_ENV}=1 (a graph cannot hold the host-ordered collectives): the group's steps run eagerly");
    }
    let mut devices: Vec<Arc<CudaDevice>> = Vec::with_capacity(ranks);
    for (r, &ord) in ordinals.iter().enumerate() {
        let mut d = CudaDevice::new(ord).with_context(|| format!("tensor-parallel rank {r} on cuda:{ord}"))?;
        if !graphs {
            d.graphs = None;
        }
        d.gpu_share = ordinals.iter().filter(|&&o| o == ord).count();
        d.draw_source = devices.first().cloned();
        d.name = format!("{} rank {r}", d.name);
        devices.push(Arc::new(d));
    }
    enable_peer_access(&devices)?;
    let shared = Arc::new(Shared {
        ranks,
        arrived: AtomicUsize::new(0),
        generation: AtomicU64::new(0),
        aborted: AtomicBool::new(false),
        ptrs: std::array::from_fn(|_| AtomicU64::new(0)),
        lens: std::array::from_fn(|_| AtomicUsize::new(0)),
        events: devices.iter().map(RankEvents::new).collect::<Result<_>>()?,
        host_sync: std::env::var_os(SYNC_ENV).is_some_and(|v| v != "0"),
        flags: match flags {
            true => Some(devices.iter().map(RankFlags::new).collect::<Result<_>>()?),
            false => None,
        },
        votes: std::array::from_fn(|_| AtomicU64::new(0)),
    });
    if graphs {
        for (rank, d) in devices.iter().enumerate() {
            let _ = d.tp_agree.set(GroupAgree { rank, shared: shared.clone() });
        }
    }
    Ok(devices
        .into_iter()
        .enumerate()
        .map(|(rank, dev)| {
            let comm: Arc<dyn Collective> = Arc::new(PeerCollective { rank, dev: dev.clone(), shared: shared.clone() });
            (dev as Arc<dyn Device>, comm)
        })
        .collect())
}

/// Every pair of distinct GPUs of the group may address each other's memory.
fn enable_peer_access(devices: &[Arc<CudaDevice>]) -> Result<()> {
    for a in devices {
        for b in devices {
            if a.ordinal == b.ordinal {
                continue;
            }
            let mut can = 0;
            // SAFETY: plain queries of two device handles.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device()) }.result().context("querying peer access")?;
            if can == 0 {
                bail!("cuda:{} cannot access the memory of cuda:{} (no peer access between them): Quiver's collectives need it (NCCL for such hosts is not built)", a.ordinal, b.ordinal);
            }
            a.bind();
            // SAFETY: `b`'s context is live; enabling twice is reported and ignored.
            match unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => bail!("enabling peer access from cuda:{} to cuda:{}: {e:?}", a.ordinal, b.ordinal),
            }
        }
    }
    Ok(())
}

/// A rank's two events: recorded on its stream after its input is ready, and after its part
/// of the collective is done.
struct RankEvents {
    ready: sys::CUevent,
    done: sys::CUevent,
    dev: Arc<CudaDevice>,
}

impl RankEvents {
    fn new(dev: &Arc<CudaDevice>) -> Result<RankEvents> {
        dev.bind();
        let ev = || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).context("creating a CUDA event");
        Ok(RankEvents { ready: ev()?, done: ev()?, dev: dev.clone() })
    }
}

impl Drop for RankEvents {
    fn drop(&mut self) {
        if self.dev.ctx.bind_to_thread().is_ok() {
            // SAFETY: created by us, destroyed once; the group is gone, so nothing records or
            // waits for them any more.
            unsafe {
                let _ = result::event::destroy(self.ready);
                let _ = result::event::destroy(self.done);
            }
        }
    }
}

/// A rank's signal buffer (`[FLAG_BLOCKS][2 phases][MAX_RANKS]` u32 flags the other ranks
/// raise) and its blocks' epochs, for the device-ordered collectives.
struct RankFlags {
    sig: DevBuf,
    epoch: DevBuf,
}

impl RankFlags {
    fn new(dev: &Arc<CudaDevice>) -> Result<RankFlags> {
        Ok(RankFlags { sig: DevBuf::zeroed(&dev.ctx, FLAG_BLOCKS * 2 * MAX_RANKS * 4)?, epoch: DevBuf::zeroed(&dev.ctx, FLAG_BLOCKS * 4)? })
    }
}

struct Shared {
    ranks: usize,
    /// Spin barrier: ranks arrived in this generation, and the generation.
    arrived: AtomicUsize,
    generation: AtomicU64,
    aborted: AtomicBool,
    /// Each rank's buffer of the current call (device address) and length, published before the
    /// first barrier of the call.
    ptrs: [AtomicU64; MAX_RANKS],
    lens: [AtomicUsize; MAX_RANKS],
    events: Vec<RankEvents>,
    /// Diagnosis (`QUIVER_CUDA_TP_SYNC=1`): each rank's host waits for its stream before and
    /// after every collective, so the events order nothing the host has not already.
    host_sync: bool,
    /// The device-ordered collectives' buffers, rank by rank (`QUIVER_CUDA_TP_FLAGS=1`).
    flags: Option<Vec<RankFlags>>,
    /// Each rank's vote in `GroupAgree::agree`.
    votes: [AtomicU64; MAX_RANKS],
}

/// How the ranks of a group whose steps are recorded agree on each step's mode. Recording a
/// step runs its host code (the collectives' address exchanges) without running its kernels,
/// and replaying it runs kernels without host code, so every rank must record, replay or run
/// eagerly together: a rank alone in a mode would leave the others' collectives waiting on host
/// barriers or on device flags no kernel raises (`graphs.rs`).
pub(super) struct GroupAgree {
    rank: usize,
    shared: Arc<Shared>,
}

impl GroupAgree {
    /// True on every rank when every rank passed the same `vote`, false on every rank otherwise.
    pub(super) fn agree(&self, vote: u64) -> bool {
        let s = &*self.shared;
        s.votes[self.rank].store(vote, Ordering::Relaxed);
        s.barrier();
        let same = (0..s.ranks).all(|r| s.votes[r].load(Ordering::Relaxed) == vote);
        // No rank votes again before every rank has read this round's votes.
        s.barrier();
        same
    }
}

// SAFETY: the raw event handles are only recorded and waited on, which the driver allows from
// any thread with the owning (or any) context bound.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

const ABORTED: &str = "another rank of the tensor-parallel group failed";

impl Shared {
    /// Waits until every rank has arrived (spinning: ranks arrive within microseconds of each
    /// other in a step, and a condvar wake costs more than that), or panics if the group was
    /// aborted.
    fn barrier(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.ranks {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            assert!(!self.aborted.load(Ordering::Relaxed), "{ABORTED}");
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Makes `dev`'s stream wait for event `which` of every other rank.
    fn wait_others(&self, rank: usize, dev: &CudaDevice, which: fn(&RankEvents) -> sys::CUevent) {
        for (r, e) in self.events.iter().enumerate() {
            if r != rank {
                // SAFETY: a live event (of this group), recorded before the barrier just passed.
                unsafe { result::stream::wait_event(dev.stream, which(e), sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                    .unwrap_or_else(|err| panic!("{} waiting for rank {r}: {err:?}", dev.name));
            }
        }
    }

    fn record(&self, rank: usize, dev: &CudaDevice, which: fn(&RankEvents) -> sys::CUevent) {
        // SAFETY: an event of this rank's context, on its stream.
        unsafe { result::event::record(which(&self.events[rank]), dev.stream) }.unwrap_or_else(|e| panic!("{}: event record: {e:?}", dev.name));
    }

    /// Publishes this rank's buffer, waits for every rank's, and returns them all (pointer
    /// arguments for the kernels, 0 past the last rank), checking the lengths agree.
    fn exchange(&self, rank: usize, dev: &CudaDevice, ptr: u64, len: usize, what: &str) -> [u64; MAX_RANKS] {
        if self.host_sync {
            dev.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
        }
        self.ptrs[rank].store(ptr, Ordering::Relaxed);
        self.lens[rank].store(len, Ordering::Relaxed);
        if self.flags.is_none() {
            self.record(rank, dev, |e| e.ready);
        }
        self.barrier();
        if let Some(r) = (0..self.ranks).find(|&r| self.lens[r].load(Ordering::Relaxed) != len) {
            let theirs = self.lens[r].load(Ordering::Relaxed);
            self.aborted.store(true, Ordering::Relaxed);
            panic!("{what} of {len} elements on rank {rank} but {theirs} on rank {r}");
        }
        if self.flags.is_none() {
            self.wait_others(rank, dev, |e| e.ready);
        }
        std::array::from_fn(|r| if r < self.ranks { self.ptrs[r].load(Ordering::Relaxed) } else { 0 })
    }

    /// Ends a call: once every rank's kernel is queued, each stream waits for all of them
    /// (with device-ordered kernels only the host barrier, so no rank publishes its next
    /// buffer before every rank has read this one's).
    fn finish(&self, rank: usize, dev: &CudaDevice) {
        if self.flags.is_some() {
            self.barrier();
            if self.host_sync {
                dev.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
                self.barrier();
            }
            return;
        }
        self.record(rank, dev, |e| e.done);
        self.barrier();
        self.wait_others(rank, dev, |e| e.done);
        // The next kernel may be launched programmatically and then waits only for the kernel
        // before it: this plain one, which waited for the other ranks.
        launch!(after_wait dev, dev.k.tp_fence, (1, 1, 1), (32, 1, 1););
        if self.host_sync {
            dev.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            self.barrier();
        }
    }
}

/// Every rank's signal buffer address (kernel arguments, 0 past the last rank).
fn flag_sigs(f: &[RankFlags]) -> [u64; MAX_RANKS] {
    std::array::from_fn(|r| f.get(r).map_or(0, |x| x.sig.ptr))
}

struct PeerCollective {
    rank: usize,
    dev: Arc<CudaDevice>,
    shared: Arc<Shared>,
}

/// Blocks of a collective kernel: enough to stream a decode step's few hundred KB, few enough
/// that ranks sharing a GPU run side by side.
const BLOCKS: usize = 32;

impl Collective for PeerCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.shared.ranks
    }

    fn all_reduce_sum(&self, buf_: &mut Tensor, len: usize) {
        let (s, d, n) = (&*self.shared, &*self.dev, self.shared.ranks);
        if n == 1 || len == 0 {
            return;
        }
        d.bind();
        let p = s.exchange(self.rank, d, buf(buf_), len, "all-reduce");
        // This rank's share of the elements, 4-aligned (the kernel moves float4s).
        let chunk = len.div_ceil(n).next_multiple_of(4);
        let (lo, hi) = ((self.rank * chunk).min(len), ((self.rank + 1) * chunk).min(len));
        if let Some(f) = &s.flags {
            // Every rank launches all its blocks, even with no share of its own: they meet.
            let g = flag_sigs(f);
            launch!(d, d.k.tp_all_reduce_flags, (FLAG_BLOCKS as u32, 1, 1), (256, 1, 1);
                p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7],
                f[self.rank].epoch.ptr, self.rank as i32, n as i32, lo as i32, hi as i32);
            d.mark("all-reduce");
        } else if lo < hi {
            launch!(after_wait d, d.k.tp_all_reduce, (grid1((hi - lo).div_ceil(4), 256).0.min(BLOCKS as u32), 1, 1), (256, 1, 1);
                p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], n as i32, lo as i32, hi as i32);
            d.mark("all-reduce");
        }
        s.finish(self.rank, d);
    }

    fn all_gather_cols(&self, local: &Tensor, rows: usize, cols: usize, out: &mut Tensor) {
        let (s, d, n) = (&*self.shared, &*self.dev, self.shared.ranks);
        d.bind();
        let p = s.exchange(self.rank, d, buf(local), rows * cols, "all-gather");
        if let Some(f) = &s.flags {
            let g = flag_sigs(f);
            launch!(d, d.k.tp_all_gather_cols_flags, (FLAG_BLOCKS as u32, 1, 1), (256, 1, 1);
                p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7],
                f[self.rank].epoch.ptr, self.rank as i32, n as i32, rows as i32, cols as i32, buf(out));
            d.mark("all-gather");
        } else if rows * cols > 0 {
            launch!(after_wait d, d.k.tp_all_gather_cols, (grid1(rows * cols * n, 256).0.min(4 * BLOCKS as u32), 1, 1), (256, 1, 1);
                p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], n as i32, rows as i32, cols as i32, buf(out));
            d.mark("all-gather");
        }
        s.finish(self.rank, d);
    }

    fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Relaxed);
    }
}
