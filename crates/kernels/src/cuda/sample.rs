//! Sampling on the GPU (`sample.cu`): the specs go up and the drawn tokens (with their logprobs
//! when asked) come back through one small pinned buffer, so a step's logits never leave the
//! device. The buffers grow with the largest batch and are reused; steady state allocates nothing.

use super::*;
use crate::sample::{SampleOut, SampleSpec};

/// Threads per drawn token (`SAMPLE_THREADS` in sample.cu).
const SAMPLE_THREADS: u32 = 1024;

pub(super) struct SampleBufs {
    specs: DevBuf,
    outs: DevBuf,
    pin: PinnedBuf,
    cap: usize,
}

impl CudaDevice {
    pub(super) fn sample_on_device(&self, logits: &Tensor, vocab: usize, specs: &[SampleSpec], out: &mut [SampleOut]) {
        let n = specs.len();
        if n == 0 {
            return;
        }
        self.bind();
        assert!(out.len() >= n, "sample: {} outputs for {n} specs", out.len());
        let mut guard = self.sample_bufs.lock().unwrap();
        if guard.as_ref().is_none_or(|b| b.cap < n) {
            let cap = n.next_power_of_two().max(64);
            let oom = |e: anyhow::Error| -> ! { panic!("{}: {e:#}", self.name) };
            let bytes = cap * std::mem::size_of::<SampleSpec>().max(std::mem::size_of::<SampleOut>());
            *guard = Some(SampleBufs {
                specs: DevBuf::zeroed(&self.ctx, cap * std::mem::size_of::<SampleSpec>()).unwrap_or_else(|e| oom(e)),
                outs: DevBuf::zeroed(&self.ctx, cap * std::mem::size_of::<SampleOut>()).unwrap_or_else(|e| oom(e)),
                pin: PinnedBuf::new(&self.ctx, bytes).unwrap_or_else(|e| oom(e)),
                cap,
            });
        }
        let b = guard.as_mut().expect("sample buffers");
        self.mark("sample");
        let fail = |what: &str, e: result::DriverError| -> ! { panic!("{what} on {}: {e:?}", self.name) };
        b.pin.slice_mut::<SampleSpec>(n).copy_from_slice(specs);
        let started = std::time::Instant::now();
        // SAFETY: the pinned buffer holds n specs and is not written again until this stream has
        // finished with it (synchronized below); the device buffers hold `cap >= n` of each.
        unsafe {
            result::memcpy_htod_async(b.specs.ptr, b.pin.slice_mut::<SampleSpec>(n), self.stream).unwrap_or_else(|e| fail("host→device copy of sampling specs", e));
        }
        let (specs_ptr, outs_ptr) = (b.specs.ptr, b.outs.ptr);
        launch!(self, self.k.sample_rows, (n as u32, 1, 1), (SAMPLE_THREADS, 1, 1); buf(logits), vocab as i32, specs_ptr, outs_ptr);
        // SAFETY: as above; the host reads the results only after the stream has synchronized.
        unsafe {
            result::memcpy_dtoh_async(b.pin.slice_mut::<SampleOut>(n), outs_ptr, self.stream).unwrap_or_else(|e| fail("device→host copy of sampled tokens", e));
            result::stream::synchronize(self.stream).unwrap_or_else(|e| fail("CUDA work before sampling's results", e));
        }
        self.copy.drained.store(true, std::sync::atomic::Ordering::Relaxed);
        out[..n].copy_from_slice(b.pin.slice_mut::<SampleOut>(n));
        drop(guard);
        self.step_synced(started);
    }
}
