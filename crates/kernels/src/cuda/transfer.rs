//! The copy stream: per-step metadata up in one transfer, results down, through page-locked
//! buffers, ordered with the compute stream by events only.

use super::*;

/// Most extra slices `stage_batch` takes (the LoRA hook stages four: segments and chunks of the
/// token rows and of the logits rows).
pub(super) const MAX_EXTRA: usize = 4;

/// Largest download staged through the pinned buffer (bytes).
pub(super) const PINNED_DOWNLOAD_MAX: usize = 64 << 10;

/// The second stream: per-step metadata up and logits down, through pinned buffers. Ordering
/// with the compute stream is by events only: an upload waits for the compute work queued
/// before it (which may still read the previous step's metadata) and the compute stream waits
/// for the upload; a download waits for the compute work that produced the data.
pub(super) struct CopyStream {
    /// Its own stream, or the compute stream itself with `QUIVER_CUDA_COPY_STREAM=0` (same
    /// pinned buffers and events, no cross-stream hop: for measuring what the hop costs).
    pub(super) stream: sys::CUstream,
    pub(super) separate: bool,
    /// Recorded on the compute stream just before a transfer that must follow its work.
    pub(super) compute_mark: sys::CUevent,
    /// Recorded on the copy stream after the last upload / download.
    pub(super) uploaded: sys::CUevent,
    pub(super) downloaded: sys::CUevent,
    /// Nothing has been queued on the compute stream since a download drained it (the end of
    /// every step): the next upload need not wait for it, which keeps a cross-stream hop off
    /// the critical path of a step.
    pub(super) drained: std::sync::atomic::AtomicBool,
}

impl CopyStream {
    pub(super) fn new(compute: sys::CUstream) -> Result<CopyStream> {
        let ev = || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).context("creating a CUDA event");
        let separate = std::env::var_os("QUIVER_CUDA_COPY_STREAM").is_none_or(|v| v != "0");
        Ok(CopyStream {
            stream: if separate { result::stream::create(result::stream::StreamKind::NonBlocking).context("creating the CUDA copy stream")? } else { compute },
            separate,
            compute_mark: ev()?,
            uploaded: ev()?,
            downloaded: ev()?,
            drained: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// Where one staged host slice landed in the metadata buffer.
#[derive(Clone, Copy, Default)]
pub(super) struct StagedSlice {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) offset: usize,
}

impl CudaDevice {
    /// Device address of a host metadata slice: its staged copy, or a fresh side upload.
    pub(super) fn meta_ptr(&self, st: &mut State, s: &[u32]) -> u64 {
        let addr = s.as_ptr() as usize;
        if let Some(e) = st.staged.iter().find(|e| e.addr == addr && e.len == s.len() && e.len > 0) {
            return st.meta.ptr + 4 * e.offset as u64;
        }
        self.grow(&mut st.side, s.len() * 4);
        self.htod(st.side.ptr, s);
        st.side.ptr
    }

    pub(super) fn stage(&self, st: &mut State, ids: &[u32], b: &AttnBatch<'_>, logits_rows: &[u32], extra: &[&[u32]]) {
        // A step ends with its deferred LoRA delta consumed (lora_epilogue.rs); one left by a
        // step cut short must not reach the next.
        debug_assert!(st.lora_deferred.is_none(), "a step left a LoRA delta deferred");
        st.lora_deferred = None;
        assert!(extra.len() <= MAX_EXTRA, "stage_batch: at most {MAX_EXTRA} extra slices");
        let State { host_meta, staged, row_seq, tiles, single_tiles, .. } = st;
        host_meta.clear();
        let slices: [&[u32]; 6] = [ids, b.positions, b.seq_starts, b.ctx_lens, b.block_tables, logits_rows];
        for (i, s) in slices.iter().chain(extra).chain(std::iter::repeat_n(&(&[] as &[u32]), MAX_EXTRA - extra.len())).enumerate() {
            staged[i] = StagedSlice { addr: s.as_ptr() as usize, len: s.len(), offset: host_meta.len() };
            host_meta.extend_from_slice(s);
        }
        let offset = host_meta.len();
        let nseq = b.seq_starts.len().saturating_sub(1);
        for s in 0..nseq {
            for _ in b.seq_starts[s]..b.seq_starts[s + 1] {
                host_meta.push(s as u32);
            }
        }
        *row_seq = Some(StagedSlice { addr: b.positions.as_ptr() as usize, len: b.positions.len(), offset });
        // The tiles of sequences with several rows, then those of one-row sequences.
        let tiles_at = host_meta.len();
        for s in 0..nseq {
            let (a, e) = (b.seq_starts[s], b.seq_starts[s + 1]);
            if e > a + 1 {
                for r0 in (a..e).step_by(PREFILL_ROWS) {
                    host_meta.extend_from_slice(&[r0, (e - r0).min(PREFILL_ROWS as u32), s as u32]);
                }
            }
        }
        let several = (host_meta.len() - tiles_at) / 3;
        for s in 0..nseq {
            let a = b.seq_starts[s];
            if b.seq_starts[s + 1] == a + 1 {
                host_meta.extend_from_slice(&[a, 1, s as u32]);
            }
        }
        *tiles = (tiles_at, (host_meta.len() - tiles_at) / 3);
        *single_tiles = tiles.1 - several;
        let bytes = host_meta.len() * 4;
        self.grow(&mut st.meta, bytes);
        self.upload_meta(st);
    }

    /// `host_meta` into `meta` on the copy stream; the compute stream's later work waits for it.
    /// `Device::to_host`: the first `len` floats of `t` into `out`, through the copy stream.
    pub(super) fn download(&self, t: &Tensor, len: usize, out: &mut [f32]) {
        self.bind();
        if len == 0 {
            return;
        }
        self.mark("to_host");
        let c = &self.copy;
        let fail = |what: &str, e: cudarc::driver::DriverError| -> ! { panic!("{what} on {}: {e:?}", self.name) };
        let mut st = self.state.lock().unwrap();
        // Small results come through the pinned buffer; large ones (logits of many rows: 131 MB
        // for 256 rows of a 128k vocabulary) straight into `out`, where a second host copy
        // would cost more than the pageable transfer (measured: 8B decode at 256 rows 2× slower).
        let pinned = len * 4 <= PINNED_DOWNLOAD_MAX;
        if pinned && st.pin_down.bytes < len * 4 {
            // The previous download finished before its to_host returned, so the old buffer is free.
            st.pin_down = PinnedBuf::new(&self.ctx, (len * 4).next_power_of_two()).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        }
        let started = std::time::Instant::now();
        // SAFETY: events and streams of this context; t holds at least len floats, the
        // destination has room for them and is read only after `downloaded` fires.
        unsafe {
            result::event::record(c.compute_mark, self.stream).unwrap_or_else(|e| fail("event record", e));
            result::stream::wait_event(c.stream, c.compute_mark, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("copy stream wait", e));
            let dst: &mut [f32] = if pinned { st.pin_down.slice_mut::<f32>(len) } else { &mut out[..len] };
            result::memcpy_dtoh_async(dst, buf(t), c.stream).unwrap_or_else(|e| fail("device→host copy", e));
            result::event::record(c.downloaded, c.stream).unwrap_or_else(|e| fail("event record", e));
            // An asynchronous kernel error surfaces here: the context's errors are sticky.
            result::event::synchronize(c.downloaded).unwrap_or_else(|e| fail("CUDA work before a device→host copy", e));
        }
        // Everything queued on the compute stream so far has finished (one thread drives the
        // device; any later launch, copy or GEMM clears this through `touch`).
        c.drained.store(true, std::sync::atomic::Ordering::Relaxed);
        if pinned {
            out[..len].copy_from_slice(st.pin_down.slice_mut::<f32>(len));
        }
        drop(st);
        self.step_synced(started);
    }

    pub(super) fn upload_meta(&self, st: &mut State) {
        let c = &self.copy;
        let fail = |what: &str, e: cudarc::driver::DriverError| -> ! { panic!("{what} on {}: {e:?}", self.name) };
        // The pinned buffer is free again once its previous upload finished (long ago, normally).
        unsafe { result::event::synchronize(c.uploaded) }.unwrap_or_else(|e| fail("waiting for the last upload", e));
        let drained = c.drained.swap(false, std::sync::atomic::Ordering::Relaxed);
        let bytes = st.host_meta.len() * 4;
        if st.pin_up.bytes < bytes {
            st.pin_up = PinnedBuf::new(&self.ctx, bytes.next_power_of_two()).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        }
        st.pin_up.slice_mut::<u32>(st.host_meta.len()).copy_from_slice(&st.host_meta);
        self.touch();
        // SAFETY: events and streams of this context; the source is pinned memory that is not
        // written again before `uploaded` fires (waited on above), the destination has `bytes`.
        unsafe {
            // Kernels queued so far may still read the previous step's metadata.
            if !drained {
                result::event::record(c.compute_mark, self.stream).unwrap_or_else(|e| fail("event record", e));
                result::stream::wait_event(c.stream, c.compute_mark, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("copy stream wait", e));
            }
            result::memcpy_htod_async(st.meta.ptr, st.pin_up.slice_mut::<u32>(st.host_meta.len()), c.stream).unwrap_or_else(|e| fail("metadata upload", e));
            result::event::record(c.uploaded, c.stream).unwrap_or_else(|e| fail("event record", e));
            result::stream::wait_event(self.stream, c.uploaded, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap_or_else(|e| fail("compute stream wait", e));
        }
    }

    /// Device address of the row → sequence map for the batch whose positions are `positions`.
    pub(super) fn row_seq_ptr(&self, st: &mut State, b: &AttnBatch<'_>) -> u64 {
        // The last staged batch is this one if the positions are the same slice with the same
        // contents (and the contexts too): a caller outside a forward may hand over a fresh vector
        // at a freed one's address (session 23's attention check did), which the address alone
        // would take for the old batch. A forward's ops find the slices stage_batch copied, so
        // the comparison (a few kilobytes a call) always matches there.
        let same = |st: &State, i: usize, s: &[u32]| {
            let e = st.staged[i];
            e.addr == s.as_ptr() as usize && st.host_meta.get(e.offset..e.offset + e.len) == Some(s)
        };
        let staged_here = matches!(st.row_seq, Some(e) if e.addr == b.positions.as_ptr() as usize && e.len == b.positions.len())
            && same(st, 1, b.positions)
            && same(st, 3, b.ctx_lens);
        if !staged_here {
            // An op called outside a staged forward: stage this batch now.
            self.stage(st, &[], b, &[], &[]);
        }
        st.meta.ptr + 4 * st.row_seq.unwrap().offset as u64
    }

}
