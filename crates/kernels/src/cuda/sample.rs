//! Sampling on the GPU (`sample.cu`), launched and collected apart. The launch uploads the specs
//! and queues the kernel behind the step; the drawn tokens (with their logprobs when asked) come
//! down on the copy stream into a pinned buffer, and collecting waits on an event recorded after
//! that copy. A step queued in between may name the draws in its ids: `resolve_drawn` patches
//! its staged ids from the buffer the kernel wrote, on the device, so the host never waits for
//! a token before queuing the next step. Buffers grow with the largest batch and are reused;
//! steady state allocates nothing.

use super::*;
use crate::sample::{SampleOut, SampleSpec, DRAWN};
use std::sync::atomic::Ordering::Relaxed;

/// Threads per drawn token (`SAMPLE_THREADS` in sample.cu).
const SAMPLE_THREADS: u32 = 1024;

/// The last launch: its size, whether it is still to be collected, the buffers it used.
#[derive(Default)]
pub(super) struct Draws {
    bufs: Option<SampleBufs>,
    n: usize,
    pending: bool,
    /// The device's touch count just after the launch: unchanged at collect means nothing was
    /// queued since, so the finished draw leaves the compute stream drained.
    touches: u64,
}

struct SampleBufs {
    specs: DevBuf,
    outs: DevBuf,
    pin_specs: PinnedBuf,
    pin_outs: PinnedBuf,
    cap: usize,
    /// Recorded on the compute stream after the kernel (the copy stream waits for it), and on
    /// the copy stream after the results' download (collect waits for that).
    drawn: sys::CUevent,
    down: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl SampleBufs {
    fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<SampleBufs> {
        let ev = || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).context("creating a CUDA event");
        Ok(SampleBufs {
            specs: DevBuf::zeroed(ctx, cap * std::mem::size_of::<SampleSpec>())?,
            outs: DevBuf::zeroed(ctx, cap * std::mem::size_of::<SampleOut>())?,
            pin_specs: PinnedBuf::new(ctx, cap * std::mem::size_of::<SampleSpec>())?,
            pin_outs: PinnedBuf::new(ctx, cap * std::mem::size_of::<SampleOut>())?,
            cap,
            drawn: ev()?,
            down: ev()?,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for SampleBufs {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created by us in this context and destroyed once; the owner replaces the
            // buffers only after synchronizing, so no queued work records them any more.
            unsafe {
                let _ = result::event::destroy(self.drawn);
                let _ = result::event::destroy(self.down);
            }
        }
    }
}

impl CudaDevice {
    pub(super) fn sample_launch_impl(&self, logits: &Tensor, vocab: usize, specs: &[SampleSpec]) {
        self.bind();
        let mut d = self.draws.lock().unwrap();
        assert!(!d.pending, "sample_launch: the previous launch's results were not collected");
        let n = specs.len();
        d.n = n;
        d.pending = true;
        if n == 0 {
            return;
        }
        if d.bufs.as_ref().is_none_or(|b| b.cap < n) {
            // A queued step's resolve_drawn may still read the old results.
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            d.bufs = Some(SampleBufs::new(&self.ctx, n.next_power_of_two().max(64)).unwrap_or_else(|e| panic!("{}: {e:#}", self.name)));
        }
        let b = d.bufs.as_mut().expect("sample buffers");
        let fail = |what: &str, e: result::DriverError| -> ! { panic!("{what} on {}: {e:?}", self.name) };
        b.pin_specs.slice_mut::<SampleSpec>(n).copy_from_slice(specs);
        self.touch();
        // SAFETY: the pinned specs are not written again before this launch is collected, which
        // waits for the kernel that follows their copy; the device buffers hold `cap >= n`.
        unsafe {
            result::memcpy_htod_async(b.specs.ptr, b.pin_specs.slice_mut::<SampleSpec>(n), self.stream).unwrap_or_else(|e| fail("host→device copy of sampling specs", e));
        }
        let (specs_ptr, outs_ptr) = (b.specs.ptr, b.outs.ptr);
        launch!(self, self.k.sample_rows, (n as u32, 1, 1), (SAMPLE_THREADS, 1, 1); buf(logits), vocab as i32, specs_ptr, outs_ptr);
        self.mark("sample");
        let c = &self.copy;
        // SAFETY: events and streams of this context; the pinned results are read only after
        // `down` fires (collect), and not overwritten before the next launch.
        unsafe {
            result::event::record(b.drawn, self.stream).unwrap_or_else(|e| fail("event record", e));
            result::stream::wait_event(c.stream, b.drawn, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("copy stream wait", e));
            result::memcpy_dtoh_async(b.pin_outs.slice_mut::<SampleOut>(n), outs_ptr, c.stream).unwrap_or_else(|e| fail("device→host copy of sampled tokens", e));
            result::event::record(b.down, c.stream).unwrap_or_else(|e| fail("event record", e));
        }
        d.touches = self.touches.load(Relaxed);
    }

    pub(super) fn sample_collect_impl(&self, out: &mut [SampleOut]) {
        self.bind();
        let mut d = self.draws.lock().unwrap();
        assert!(d.pending, "sample_collect without a launch to collect");
        d.pending = false;
        let n = d.n;
        if n == 0 {
            return;
        }
        assert!(out.len() >= n, "sample_collect: {} outputs for {n} draws", out.len());
        let started = std::time::Instant::now();
        let b = d.bufs.as_mut().expect("sample buffers");
        // An asynchronous kernel error surfaces here: the context's errors are sticky.
        unsafe { result::event::synchronize(b.down) }.unwrap_or_else(|e| panic!("CUDA work before sampling's results on {}: {e:?}", self.name));
        out[..n].copy_from_slice(b.pin_outs.slice_mut::<SampleOut>(n));
        let quiet = self.touches.load(Relaxed) == d.touches;
        drop(d);
        if !quiet && self.profiler.is_some() {
            // The profile charges the intervals between its events at host syncs, so the step
            // queued since is waited for too (profiling gives the overlap up).
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
        } else if !quiet {
            return;
        }
        // Everything queued on the compute stream has finished.
        self.copy.drained.store(true, Relaxed);
        self.step_synced(started);
    }

    /// `Device::resolve_drawn`: patches the staged copy of `ids` (the step's, staged just
    /// before) on the compute stream, behind the draw it names.
    pub(super) fn resolve_drawn_impl<'a>(&self, ids: &'a [u32]) -> &'a [u32] {
        let Some(last) = ids.iter().filter(|&&t| t & DRAWN != 0).map(|&t| (t & !DRAWN) as usize).max() else { return ids };
        self.bind();
        let ptr = {
            let st = self.state.lock().unwrap();
            let e = st.staged.iter().find(|e| e.addr == ids.as_ptr() as usize && e.len == ids.len()).expect("resolve_drawn: the ids were not staged by stage_batch");
            st.meta.ptr + 4 * e.offset as u64
        };
        // A tensor-parallel rank ≥ 1 reads rank 0's draws (peer memory), once rank 0's stream
        // has made them: its draw was launched before this step was queued.
        let src = self.draw_source.as_deref().unwrap_or(self);
        let d = src.draws.lock().unwrap();
        assert!(last < d.n, "token id names draw {last} of a launch of {}", d.n);
        let b = d.bufs.as_ref().expect("sample buffers");
        if !std::ptr::eq(src, self) {
            // The model resolves drawn ids before its step runs (recorded or not), so this wait
            // is never inside a capture (a TP group's graphs, graphs.rs).
            debug_assert!(!self.recording.load(std::sync::atomic::Ordering::Relaxed), "resolve_drawn inside a recorded step");
            // SAFETY: an event of rank 0's context recorded after its draw kernel; a stream of
            // this context (a wait may name another context's event).
            unsafe { result::stream::wait_event(self.stream, b.drawn, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .unwrap_or_else(|e| panic!("{} waiting for rank 0's draws: {e:?}", self.name));
        }
        let outs = b.outs.ptr;
        if std::ptr::eq(src, self) {
            launch!(self, self.k.resolve_drawn, grid1(ids.len(), 256), (256, 1, 1); ptr, ids.len() as i32, outs);
        } else {
            launch!(after_wait self, self.k.resolve_drawn, grid1(ids.len(), 256), (256, 1, 1); ptr, ids.len() as i32, outs);
        }
        self.mark("resolve_drawn");
        ids
    }
}
