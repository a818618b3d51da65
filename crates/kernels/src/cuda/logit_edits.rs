//! Logit edits on the GPU (`logit_edits.cu`): a step's packed edits go up on the copy stream
//! through a pinned buffer while the forward pass still runs, and the kernel, queued behind the
//! forward on the compute stream, waits for that copy only. The buffers only grow; a steady
//! step allocates nothing.
//!
//! Ordering, by events alone: the host rewrites the pinned buffer once its last copy has run
//! (`uploaded`, long done by then: a step's draws are collected before the next step's edits
//! are made), and the copy overwrites the device buffer once the last edit kernel that read it
//! has run (`edited`).

use super::*;
use crate::logit_edits::{LogitEdits, ROW_WORDS};

/// Threads per edited row (`LOGIT_EDIT_THREADS` in logit_edits.cu).
const EDIT_THREADS: u32 = 512;

/// The packed edits' device and pinned buffers (`cap` words each) and their events.
pub(super) struct EditBufs {
    dev: DevBuf,
    pin: PinnedBuf,
    cap: usize,
    uploaded: sys::CUevent,
    edited: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl EditBufs {
    fn new(ctx: &Arc<CudaContext>, cap: usize) -> Result<EditBufs> {
        let ev = || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).context("creating a CUDA event");
        Ok(EditBufs { dev: DevBuf::zeroed(ctx, cap * 4)?, pin: PinnedBuf::new(ctx, cap * 4)?, cap, uploaded: ev()?, edited: ev()?, ctx: ctx.clone() })
    }
}

impl Drop for EditBufs {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created by us in this context and destroyed once; the owner replaces the
            // buffers only after synchronizing the device, so nothing queued records them.
            unsafe {
                let _ = result::event::destroy(self.uploaded);
                let _ = result::event::destroy(self.edited);
            }
        }
    }
}

impl CudaDevice {
    pub(super) fn edit_logits_impl(&self, logits: &mut Tensor, edits: &LogitEdits) {
        if edits.is_empty() {
            return;
        }
        self.bind();
        let words = edits.packed_words();
        let mut g = self.logit_edits.lock().unwrap();
        if g.as_ref().is_none_or(|b| b.cap < words) {
            // Queued copies and kernels may still use the old buffers.
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            *g = Some(EditBufs::new(&self.ctx, words.next_power_of_two().max(1024)).unwrap_or_else(|e| panic!("{}: {e:#}", self.name)));
        }
        let b = g.as_mut().expect("edit buffers");
        let fail = |what: &str, e: result::DriverError| -> ! { panic!("{what} on {}: {e:?}", self.name) };
        // SAFETY: an event of this context (never recorded yet: returns at once).
        unsafe { result::event::synchronize(b.uploaded) }.unwrap_or_else(|e| fail("waiting for the last logit edits' upload", e));
        edits.pack_into(b.pin.slice_mut::<u32>(words));
        let c = &self.copy;
        self.touch();
        // SAFETY: events and streams of this context; the pinned source is not written again
        // before `uploaded` fires (waited on above next time), the device buffer holds `cap`
        // words and the copy waits for the last kernel that read it.
        unsafe {
            result::stream::wait_event(c.stream, b.edited, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("copy stream wait", e));
            result::memcpy_htod_async(b.dev.ptr, b.pin.slice_mut::<u32>(words), c.stream).unwrap_or_else(|e| fail("host→device copy of logit edits", e));
            result::event::record(b.uploaded, c.stream).unwrap_or_else(|e| fail("event record", e));
            result::stream::wait_event(self.stream, b.uploaded, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("compute stream wait", e));
        }
        let rows = edits.rows().len();
        let (head, arena) = (b.dev.ptr, b.dev.ptr + (rows * ROW_WORDS * 4) as u64);
        launch!(self, self.k.logit_edits, (rows as u32, 1, 1), (EDIT_THREADS, 1, 1); buf(logits), edits.vocab() as i32, head, arena);
        // SAFETY: as above.
        unsafe { result::event::record(b.edited, self.stream) }.unwrap_or_else(|e| fail("event record", e));
        self.mark("logit_edits");
    }
}
