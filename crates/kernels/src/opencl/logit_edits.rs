//! Logit edits on an OpenCL device (`logit_edits.cl`): the step's packed edits in one
//! non-blocking write into a buffer that only grows, then one work-group per edited row. The
//! host copy stays untouched until its write has run (the event is waited for at the next
//! step's edits), so a steady step allocates nothing.

use super::*;
use crate::logit_edits::LogitEdits;
use opencl3::event::Event;
use opencl3::types::CL_NON_BLOCKING;

/// Build options of `logit_edits.cl` beyond the common ones: IEEE division where the device
/// has it, so the repetition penalty's quotient is the host's.
pub(super) fn build_options(caps: &Caps) -> &'static str {
    if caps.correct_divide { opencl3::program::CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT } else { "" }
}

/// The packed edits on the host and on the device, and the write between them in flight.
#[derive(Default)]
pub(super) struct EditBufs {
    host: Vec<u32>,
    dev: Option<ClBuf>,
    written: Option<Event>,
}

impl OpenClDevice {
    pub(super) fn edit_logits_impl(&self, logits: &mut Tensor, edits: &LogitEdits) {
        if edits.is_empty() {
            return;
        }
        let mut g = self.logit_edits.lock().unwrap();
        if let Some(ev) = g.written.take() {
            ev.wait().unwrap_or_else(|e| self.fail("waiting for the last logit edits' upload", e));
        }
        let words = edits.packed_words();
        g.host.resize(words, 0);
        edits.pack_into(&mut g.host);
        if g.dev.as_ref().is_none_or(|b| b.bytes < words * 4) {
            // A kernel still queued on the old buffer keeps it alive (memory.rs).
            g.dev = Some(self.zeroed((words * 4).next_power_of_two()));
        }
        let EditBufs { host, dev, written } = &mut *g;
        let dev = dev.as_mut().expect("edit buffer");
        // SAFETY: in bounds (grown above); `host` is left alone until the event fires.
        let ev = unsafe { self.queue.enqueue_write_buffer(&mut dev.buf, CL_NON_BLOCKING, 0, bytemuck::cast_slice(&host[..words]), &[]) }
            .unwrap_or_else(|e| self.fail("logit edits upload", e));
        *written = Some(ev);
        let rows = edits.rows().len();
        self.launch("logit_edits", &[rows * ROW_WG], Some(&[ROW_WG]), &[Arg::Mem(mem(logits)), Arg::I32(edits.vocab() as i32), Arg::Mem(dev.mem()), Arg::I32(rows as i32)]);
    }
}
