//! Per-step metadata: every host slice of a step in one buffer, written in one transfer by
//! `stage_batch`; ops find their slices in it by address and length.

use super::*;
use opencl3::event::Event;
use opencl3::types::CL_NON_BLOCKING;

/// Most extra slices `stage_batch` takes (the LoRA hook stages four: segments and chunks of the
/// token rows and of the logits rows).
const MAX_EXTRA: usize = 4;

/// Where one staged host slice landed in the metadata buffer (in u32 words).
#[derive(Clone, Copy, Default)]
pub(super) struct StagedSlice {
    addr: usize,
    len: usize,
    offset: usize,
}

/// Mutable per-step state: the staged metadata and the scratch buffers ops share.
pub(super) struct State {
    /// The host copy of the staged buffer: not touched again until `meta_written` has fired
    /// (the write reads it asynchronously).
    host_meta: Vec<u32>,
    meta: ClBuf,
    meta_written: Option<Event>,
    /// The batch's six slices, then up to `MAX_EXTRA` from `stage_batch`'s `extra`.
    staged: [StagedSlice; 6 + MAX_EXTRA],
    /// The row → sequence map derived from `seq_starts` at staging (keyed by the positions slice).
    pub(super) row_seq: Option<StagedSlice>,
    /// Slices uploaded outside the staged buffer since the last staging (ops called on their own).
    side: Vec<ClBuf>,
    /// LoRA shrink output, `[rows][n·R]` f32 (see `lora.rs`).
    pub(super) lora_t: ClBuf,
}

impl State {
    pub(super) fn new(ctx: &Context, allocated: &Arc<AtomicUsize>) -> Result<State> {
        Ok(State {
            host_meta: Vec::new(),
            meta: ClBuf::new(ctx, 4, allocated)?,
            meta_written: None,
            staged: [StagedSlice::default(); 6 + MAX_EXTRA],
            row_seq: None,
            side: Vec::new(),
            lora_t: ClBuf::new(ctx, 4, allocated)?,
        })
    }
}

impl OpenClDevice {
    /// Buffer and word offset of a host metadata slice: its staged copy, or a side upload.
    pub(super) fn meta_ref(&self, st: &mut State, s: &[u32]) -> (cl_mem, i32) {
        let addr = s.as_ptr() as usize;
        if let Some(e) = st.staged.iter().find(|e| e.addr == addr && e.len == s.len() && e.len > 0) {
            return (st.meta.mem(), e.offset as i32);
        }
        let mut b = self.zeroed(s.len() * 4);
        self.write(&mut b, 0, s);
        let m = b.mem();
        st.side.push(b);
        (m, 0)
    }

    pub(super) fn stage(&self, st: &mut State, ids: &[u32], b: &AttnBatch<'_>, logits_rows: &[u32], extra: &[&[u32]]) {
        assert!(extra.len() <= MAX_EXTRA, "stage_batch: at most {MAX_EXTRA} extra slices");
        if let Some(ev) = st.meta_written.take() {
            ev.wait().unwrap_or_else(|e| self.fail("waiting for the last metadata write", e));
        }
        st.side.clear();
        let State { host_meta, staged, row_seq, .. } = st;
        host_meta.clear();
        let slices: [&[u32]; 6] = [ids, b.positions, b.seq_starts, b.ctx_lens, b.block_tables, logits_rows];
        let empty: &[u32] = &[];
        for (i, s) in slices.iter().chain(extra).chain(std::iter::repeat_n(&empty, MAX_EXTRA - extra.len())).enumerate() {
            staged[i] = StagedSlice { addr: s.as_ptr() as usize, len: s.len(), offset: host_meta.len() };
            host_meta.extend_from_slice(s);
        }
        let offset = host_meta.len();
        for s in 0..b.seq_starts.len().saturating_sub(1) {
            for _ in b.seq_starts[s]..b.seq_starts[s + 1] {
                host_meta.push(s as u32);
            }
        }
        *row_seq = Some(StagedSlice { addr: b.positions.as_ptr() as usize, len: b.positions.len(), offset });
        let bytes = host_meta.len() * 4;
        if st.meta.bytes < bytes {
            st.meta = self.zeroed(bytes.next_power_of_two());
        }
        if bytes == 0 {
            return;
        }
        // SAFETY: in bounds (grown above); `host_meta` is left alone until the event fires.
        let ev = unsafe { self.queue.enqueue_write_buffer(&mut st.meta.buf, CL_NON_BLOCKING, 0, bytemuck::cast_slice(&st.host_meta), &[]) }
            .unwrap_or_else(|e| self.fail("metadata upload", e));
        st.meta_written = Some(ev);
    }

    /// Buffer and offset of the row → sequence map of the batch whose positions are `b.positions`
    /// (staging the batch now if an op was called outside a staged step).
    pub(super) fn row_seq_ref(&self, st: &mut State, b: &AttnBatch<'_>) -> (cl_mem, i32) {
        let staged_here = matches!(st.row_seq, Some(e) if e.addr == b.positions.as_ptr() as usize && e.len == b.positions.len());
        if !staged_here {
            self.stage(st, &[], b, &[], &[]);
        }
        (st.meta.mem(), st.row_seq.unwrap().offset as i32)
    }
}
