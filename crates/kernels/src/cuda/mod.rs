//! CUDA implementation of the device ops (cargo feature `cuda`).
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the binary builds and runs on a
//! machine without CUDA, where opening a CUDA device fails with a message naming the missing
//! library. Our kernels (`*.cu`, one module: `module.rs`) are compiled by NVRTC for the GPU's
//! architecture at start-up and the PTX is cached on disk, keyed by a hash of source and
//! architecture. GEMMs go through
//! cuBLAS (`cublasGemmEx`, bf16 or f32 operands, f32 accumulation and output).
//!
//! Invariants:
//! - Compute is queued on one stream owned by the device; a second stream carries the per-step
//!   transfers through page-locked buffers ([`CopyStream`]), ordered with compute by events only.
//!   Per-step metadata (token ids, positions, block tables, logits rows) goes up in one copy from
//!   [`Device::stage_batch`]; results (logits) come down in `to_host`. Ops look their metadata up
//!   in the staged copy by address and length, and upload on the side (compute stream) only for
//!   a slice that was not staged (correct, just slower); `upload` and weights also use the
//!   compute stream.
//! - Activations are f32 on the device; weights are bf16 (or f32 with `--dtype f32`); the KV cache
//!   is bf16. A bf16 GEMM converts its f32 input to bf16 into a scratch buffer first.
//! - Buffers never shrink; growing one frees the old buffer, which synchronizes the device, so no
//!   queued kernel can still read it.

mod blas;

use crate::{AttnBatch, DType, Device, DeviceKind, Epilogue, ExpertWeights, KvLayout, KvStorage, LoraCall, LoraImage, LoraSiteBuffers, LoraSiteShape, LoraTable, LoraX, MoeRouting, QkNorm, RopeTable, RouterSpec, Tensor, Weight, WeightData};
use anyhow::{bail, Context, Result};
use cudarc::driver::{result, sys, CudaContext, CudaModule};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

fn buf(t: &Tensor) -> u64 {
    match t.storage() {
        crate::Storage::Cuda(b) => b.ptr,
        _ => panic!("CUDA op given a tensor of another device"),
    }
}

/// Up to this many rows a bf16 GEMM runs as our GEMV (W streamed once, f32 input, bias fused)
/// instead of a cuBLAS GEMM on bf16-converted input, and a step may be recorded as a CUDA graph.
/// (A multi-row GEMV measured slower than cuBLAS on the H200: 10.4 ms for a 4-row 8B step
/// against 6.8 ms for 16 rows through cuBLAS.)
const GEMV_MAX_M: usize = 1;
/// Warps per block of the `gemv1_*` kernels, each computing two dot products (`GV_WARPS`,
/// `GV_ROWS` in gemv.cu).
const GEMV1_WARPS_PER_BLOCK: usize = 4;
/// Largest head the attention kernels hold in registers (`MAX_DPL` × 32 in kernels.cu).
const MAX_HEAD_DIM: usize = 256;
/// cuBLAS workspace (NVIDIA's recommendation for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;
/// Largest decode step recorded as a CUDA graph (`QUIVER_CUDA_GRAPH_MAX_ROWS` lowers it; 1
/// records single-row steps only). Multi-row steps record cuBLAS under capture with a preset
/// workspace; validated on the H200 (engine batched-equals-alone unchanged at 31/32, 8B decode
/// 4–10% faster at batch 4–256 than eager).
const GRAPH_MAX_ROWS: usize = 256;
/// Largest GEMM input width a recorded step may need: the bf16 input scratch is sized for it
/// before recording, since growing it inside a recording is not allowed.
const GRAPH_MAX_K: usize = 1 << 16;
/// Query rows per block of the prefill attention (`FA_BM` in prefill_attention.cu), and its threads.
const PREFILL_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;
/// Largest head the prefill attention takes (larger heads run the decode kernel per row).
const PREFILL_MAX_HEAD_DIM: usize = 128;

/// Dynamic shared memory of the prefill attention for a head padded to `hdp`: two buffers of a K
/// and a V tile of 64 keys, rows padded by 8 bf16 (`fa_smem` in prefill_attention.cu).
fn prefill_smem_bytes(hdp: usize) -> usize {
    2 * 2 * 64 * (hdp + 8) * 2
}

/// Mutable per-step state: staged metadata and scratch buffers.
struct State {
    host_meta: Vec<u32>,
    meta: DevBuf,
    /// The batch's six slices, then up to `MAX_EXTRA` from `stage_batch`'s `extra` (LoRA groups).
    staged: [StagedSlice; 6 + MAX_EXTRA],
    /// Offset of the row → sequence map derived from `seq_starts` at staging.
    row_seq: Option<StagedSlice>,
    /// Offset and count of the prefill-attention tiles (first row, rows, sequence) of the
    /// staged batch; tiles never cross a sequence. Those of sequences with several rows come
    /// first, then `single_tiles` tiles of one-row sequences (a mixed step's decode rows, which
    /// the attention by KV head serves instead of the prefill kernel).
    tiles: (usize, usize),
    single_tiles: usize,
    side: DevBuf,
    xbf: DevBuf,
    /// `(f32 tensor, elements, touch count, row stride)`: `xbf` holds the bf16 copy of that
    /// tensor (rows that far apart), written by the op that produced it, valid while nothing else
    /// has run on the device since (`touches` unchanged). A cuBLAS GEMM on exactly that input then
    /// skips its conversion.
    shadow: Option<(u64, usize, u64, usize)>,
    /// LoRA shrink output, `[1 + splits][rows][n·R]` f32, and its split-k counters (see `lora.rs`).
    lora_t: DevBuf,
    lora_counters: DevBuf,
    /// `rows × out` LoRA deltas computed beside a GEMM for its epilogue to add (lora.rs).
    lora_delta: DevBuf,
    /// An expert site's packed groups of routed positions, built on the device (`lora_experts.rs`).
    lora_expert_groups: DevBuf,
    /// A site's shrink computed in the RMSNorm before it, `[rows][n·R]` by position, and which
    /// call it is for (`lora_ahead.rs`).
    lora_ahead_t: DevBuf,
    lora_ahead: Option<lora_ahead::Ahead>,
    /// The tail step whose t̂ that norm placed beside its bf16 copy (at that address), if any.
    lora_ahead_placed: Option<(lora_tail::TailStep, u64)>,
    /// o_proj's or down_proj's delta left for the next norm to add (`lora_epilogue.rs`).
    lora_deferred: Option<lora_epilogue::Deferred>,
    /// The fused single-row LoRA GEMV's four counters (gemv.cu `GemvLora::ctr`): zero
    /// between launches, each launch's last warp zeroes them.
    gemv_lora_ctr: DevBuf,
    /// Host ends of the copy stream: staged metadata, downloaded data.
    pin_up: PinnedBuf,
    pin_down: PinnedBuf,
}

pub struct CudaDevice {
    ordinal: usize,
    /// Streaming multiprocessors: sizes grids meant to fit the GPU at once.
    sms: usize,
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    copy: CopyStream,
    blas: blas::Blas,
    /// cuBLAS's own workspace when multi-row steps may be recorded (declared after `blas` so the
    /// handle is destroyed first); otherwise cuBLAS manages its workspace itself.
    _blas_workspace: Option<DevBuf>,
    k: Kernels,
    /// The MoE and q/k-norm kernels (`moe.cu`).
    moe_k: moe::MoeKernels,
    _module: Arc<CudaModule>,
    state: Mutex<State>,
    name: String,
    profiler: Option<Mutex<Profiler>>,
    /// Which cuBLAS GEMMs take their f32 input as a bf16 hi + lo pair: see [`SplitGemm`].
    split_gemm: SplitGemm,
    /// Replays of recorded steps; `None` when disabled (`QUIVER_CUDA_GRAPHS=0`, or profiling).
    graphs: Option<Mutex<Graphs>>,
    graph_max_rows: usize,
    /// Launch our kernels with programmatic stream serialization (sm_90+, unless
    /// `QUIVER_CUDA_PDL=0`): see `launch_raw`.
    pdl: bool,
    /// Counts everything queued that may write device memory (launches, copies, GEMMs): see
    /// `State::shadow`.
    touches: std::sync::atomic::AtomicU64,
    /// Single-row GEMVs take RoPE and SiLU·mul into their epilogue (`QUIVER_CUDA_FUSE_EPILOGUES=0`: not).
    fuse_epilogues: bool,
    /// Largest LoRA site geometry allocated (sizes the shrink scratch).
    lora_geom: Mutex<lora::LoraGeometry>,
    /// A step is being recorded: launches must not depend on the step's data.
    recording: std::sync::atomic::AtomicBool,
    /// Sampling's last launch, its specs and results (see `sample.rs`).
    draws: Mutex<sample::Draws>,
    /// The buffers of the logit edits before a draw (see `logit_edits.rs`).
    logit_edits: Mutex<Option<logit_edits::EditBufs>>,
    /// f32 A and Bᵀ of the LoRA slot being written into an image (reused: no page faults per site).
    lora_fill_scratch: Mutex<(Vec<f32>, Vec<f32>)>,
    /// The stream LoRA shrinks run on beside their site's GEMM (`lora::SideStream`), and
    /// whether the launch being made goes there.
    lora_side: Option<lora::SideStream>,
    on_side: std::sync::atomic::AtomicBool,
    /// Decode steps of at least this many rows compute qkv's and gate_up's LoRA shrink in the
    /// RMSNorm before them (sm_90 clusters; `QUIVER_CUDA_LORA_AHEAD`: see init.rs and
    /// `lora_ahead.rs`); `None`: never. By default the steps past `lora_rows_max`.
    lora_ahead_min_rows: Option<usize>,
    /// Norms launched with a site's shrink (eager or recorded; replays are not counted).
    lora_ahead_launches: std::sync::atomic::AtomicU64,
    /// Where one-row steps compute a site's delta (`QUIVER_CUDA_LORA_ROW1`).
    lora_row1: lora::Row1Lora,
    /// Steps of up to this many rows compute a site's delta as one launch (`lora_rows.rs`)
    /// instead of a shrink and an expand (`QUIVER_CUDA_LORA_ROWS_MAX`: 64 by default, at most
    /// 128; `QUIVER_CUDA_LORA_ROWS=0` or 0: never; sm_90).
    lora_rows_max: usize,
    /// Blocks per SM per round of the one-row GEMV with LoRA (`QUIVER_CUDA_GEMV_LORA_BLOCKS`,
    /// 1 to 5; 5, what fits, by default).
    gemv_lora_blocks_per_sm: usize,
    /// `QUIVER_CUDA_LORA_EPILOGUE`: 1 (the default on sm_90), qkv's and gate_up's expand in
    /// their RoPE / SiLU·mul; 2, also o_proj's and down_proj's delta in the next norm
    /// (`lora_epilogue.rs`); 0, neither.
    lora_epilogue: u8,
    /// Long prompts' LoRA GEMMs write the delta before the base GEMM accumulates onto it
    /// (`QUIVER_CUDA_LORA_GEMM_FIRST=0`: after, accumulating): see `lora_gemm.rs`.
    lora_gemm_first: bool,
    /// Columns of room `load_weight` leaves beside every weight's rows (`QUIVER_CUDA_WEIGHT_ROOM`,
    /// rounded up to 8; default 0): a check that every op reads weights through their row stride,
    /// which LoRA's B beside the rows will need (`docs/lora-in-the-gemm.md`).
    weight_room: usize,
    /// Columns of room after each row of a GEMM's bf16 input as its producer writes it
    /// (`QUIVER_CUDA_INPUT_ROOM`, rounded up to 8; default 0): the same check for the input's row
    /// stride, where LoRA's shrink will go. Attaching a LoRA tail raises it to the tail's width
    /// (`lora_tail.rs`).
    input_room: std::sync::atomic::AtomicUsize,
    /// LoRA sites keep their first slots' B beside the base weight's rows and long prompts'
    /// deltas go through the base GEMM (`lora_tail.rs`; `QUIVER_CUDA_LORA_TAIL*`): which steps do.
    lora_tail: lora_tail::TailConfig,
    /// Steps of at least this many decode rows take the attention by KV head
    /// (`QUIVER_CUDA_ATTN_GQA_MIN_ROWS`).
    attn_gqa_min_rows: usize,
    /// Its kernels, and whether the first one runs (`QUIVER_CUDA_ATTN_DECODE=v1`): attention.rs.
    attn_decode: attention::DecodeAttn,
    /// Rank ≥ 1 of a tensor-parallel group: rank 0's device, whose draws this rank's steps
    /// read when their ids name them (`resolve_drawn`; `collective.rs`).
    draw_source: Option<Arc<CudaDevice>>,
    /// A tensor-parallel group whose steps may be recorded (`QUIVER_CUDA_TP_GRAPHS=1`, with the
    /// device-ordered collectives): how its ranks agree on each step's mode (`graphs.rs`).
    tp_agree: std::sync::OnceLock<collective::GroupAgree>,
    /// Ranks of this device's group placed on its GPU (1 outside a group): the memory the
    /// device reports free is split between them.
    gpu_share: usize,
}

// SAFETY: the raw stream and function handles are used only under the device's discipline
// (one stream, the context bound on every calling thread before use).
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

/// Launch `f` with the given arguments (each passed by value, in order).
macro_rules! launch {
    ($dev:expr, $f:expr, $grid:expr, $block:expr; $($arg:expr),* $(,)?) => {
        launch!($dev, $f, $grid, $block, smem = 0; $($arg),*)
    };
    // `after_wait`: after a stream wait on another stream's (or rank's) event, which a
    // programmatic launch need not honour: the kernel is launched plainly, so it starts only
    // once everything queued before it has finished.
    (after_wait $dev:expr, $f:expr, $grid:expr, $block:expr; $($arg:expr),* $(,)?) => {{
        let dev: &CudaDevice = $dev;
        dev.touch();
        // SAFETY: as below, on the device's own stream.
        let r = unsafe { result::launch_kernel($f, $grid, $block, 0, dev.stream, &mut [$(&mut { $arg } as *mut _ as *mut c_void),*]) };
        if let Err(e) = r {
            panic!("CUDA kernel launch failed on {}: {e:?}", dev.name);
        }
    }};
    ($dev:expr, $f:expr, $grid:expr, $block:expr, smem = $smem:expr; $($arg:expr),* $(,)?) => {
        launch!($dev, $f, $grid, $block, smem = $smem, cluster = 1; $($arg),*)
    };
    ($dev:expr, $f:expr, $grid:expr, $block:expr, smem = $smem:expr, cluster = $cluster:expr; $($arg:expr),* $(,)?) => {{
        let dev: &CudaDevice = $dev;
        let grid: (u32, u32, u32) = $grid;
        let block: (u32, u32, u32) = $block;
        // SAFETY: the arguments match the kernel's C signature (pointers as u64, int as i32,
        // float as f32, long as i64), and every pointer is a live device buffer of this context.
        let r = unsafe { dev.launch_raw($f, grid, block, $smem, $cluster, &mut [$(&mut { $arg } as *mut _ as *mut c_void),*]) };
        if let Err(e) = r {
            panic!("CUDA kernel launch failed on {}: {e:?}", dev.name);
        }
    }};
}

// The op families, each in its file; declared after `launch!` so they can use it.
mod collective;
mod gemm;
mod graphs;
mod init;
mod attention;
mod logit_edits;
mod lora;
mod lora_ahead;
mod lora_epilogue;
mod lora_rows;
mod lora_experts;
mod lora_gemm;
mod launch;
mod lora_pool;
mod lora_tail;
mod memory;
mod module;
pub mod moe;
mod profile;
mod rowwise;
mod sample;
mod transfer;

use gemm::SplitGemm;
use graphs::Graphs;
pub use memory::DevBuf;
use memory::{PinnedBuf, ALLOC_GENERATION};
use module::{check_libraries, kernels_ptx, Kernels};
use profile::Profiler;
use transfer::{CopyStream, StagedSlice, MAX_EXTRA};

/// Threads for a one-block-per-row kernel walking `items` per row: one item each (as a whole
/// warp count), at most 1024. A decode row is then one load per thread instead of a serial chain.
fn row_threads(items: usize) -> (u32, u32, u32) {
    ((items.div_ceil(32) * 32).clamp(32, 1024) as u32, 1, 1)
}

fn grid1(n: usize, threads: u32) -> (u32, u32, u32) {
    ((n.div_ceil(threads as usize)).clamp(1, 65535 * 8) as u32, 1, 1)
}

impl CudaDevice {
    pub fn name(&self) -> &str {
        &self.name
    }

    fn bind(&self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            panic!("binding the CUDA context of {}: {e:?}", self.name);
        }
    }

    /// Waits for all queued work; surfaces asynchronous kernel errors.
    pub fn synchronize(&self) -> Result<()> {
        self.bind();
        unsafe { result::stream::synchronize(self.stream) }.with_context(|| format!("CUDA stream of {}", self.name))?;
        Ok(())
    }

    /// Leaves `weight` columns of room beside every weight's rows that `load_weight` loads from
    /// now on, and `input` columns after each row of the bf16 GEMM inputs the ops write (both
    /// rounded up to 8): what `QUIVER_CUDA_WEIGHT_ROOM` / `QUIVER_CUDA_INPUT_ROOM` set at start.
    /// The CUDA tests run their checks so, to show every op reads both through its row stride.
    pub fn with_rooms(mut self, weight: usize, input: usize) -> Self {
        self.weight_room = weight.next_multiple_of(8);
        self.input_room = input.next_multiple_of(8).into();
        self
    }

    /// LoRA tails on or off whatever `QUIVER_CUDA_LORA_TAIL` says (`lora_tail.rs`): the CUDA
    /// tests run the LoRA checks both ways.
    pub fn with_lora_tail(mut self, on: bool) -> Self {
        self.lora_tail.on = on;
        if !on {
            self.lora_tail.rows = lora_tail::TailRows::Off;
        }
        self
    }

    /// Steps of rows through the tails too (`QUIVER_CUDA_LORA_TAIL=rows`) or not: the CUDA
    /// tests check that path, which is off by default.
    pub fn with_lora_tail_rows(mut self, on: bool) -> Self {
        self.lora_tail.on |= on;
        self.lora_tail.rows = if on { lora_tail::TailRows::All } else { lora_tail::TailRows::Off };
        self
    }

    /// `Device::load_weight` with rows `ld ≥ cols` elements apart, the columns past `cols`
    /// zero: every matmul reads such a weight in place (the GEMVs' row stride, cuBLAS's lda).
    /// The room beside the rows is for LoRA's B (`docs/lora-in-the-gemm.md`); the CUDA tests
    /// load weights with room to check that every path honours the stride.
    pub fn load_weight_strided(&self, w: Weight, ld: usize) -> Weight {
        self.bind();
        let (rows, cols) = (w.rows, w.cols);
        assert!(ld >= cols, "a weight's row stride ({ld}) below its columns ({cols})");
        fn padded<T: Copy + Default>(v: &[T], rows: usize, cols: usize, ld: usize) -> std::borrow::Cow<'_, [T]> {
            if ld == cols {
                return std::borrow::Cow::Borrowed(v);
            }
            let mut out = vec![T::default(); rows * ld];
            for (o, r) in out.chunks_exact_mut(ld).zip(v.chunks_exact(cols)) {
                o[..cols].copy_from_slice(r);
            }
            std::borrow::Cow::Owned(out)
        }
        let (b, dtype) = match &w.data {
            WeightData::F32(v) => {
                let b = DevBuf::zeroed(&self.ctx, rows * ld * 4).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                self.htod(b.ptr, &padded(&v[..], rows, cols, ld)[..]);
                (b, DType::F32)
            }
            WeightData::Bf16(v) => {
                let b = DevBuf::zeroed(&self.ctx, rows * ld * 2).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                self.htod(b.ptr, &padded(&v[..], rows, cols, ld)[..]);
                (b, DType::Bf16)
            }
            WeightData::Tiled(_) | WeightData::Panels(_) | WeightData::OpenCl(..) => panic!("CUDA load_weight given a weight another device already loaded (build a fresh Weight per device)"),
            WeightData::Cuda(..) => return w,
        };
        Weight { rows, cols, data: WeightData::Cuda(Arc::new(b), dtype, ld) }
    }

    /// Median GPU time of one run of `body`, in milliseconds, over `reps` runs each timed by a pair
    /// of events on the device's stream (benchmarks: a kernel alone against the copy ceiling).
    pub fn time_ms(&self, reps: usize, body: &mut dyn FnMut()) -> Result<f64> {
        self.bind();
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let (a, b) = (result::event::create(flags)?, result::event::create(flags)?);
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            // SAFETY: events of this context, recorded on our stream and synchronized before reading.
            unsafe { result::event::record(a, self.stream) }?;
            body();
            unsafe { result::event::record(b, self.stream) }?;
            self.synchronize()?;
            times.push(unsafe { result::event::elapsed(a, b) }? as f64);
        }
        unsafe {
            let _ = result::event::destroy(a);
            let _ = result::event::destroy(b);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Device-to-device copy of `len` floats from `src` into `dst` (benchmarks: copy bandwidth).
    pub fn copy(&self, src: &Tensor, dst: &mut Tensor, len: usize) {
        self.bind();
        assert!(len <= src.capacity() && len <= dst.capacity());
        // SAFETY: both are live device buffers of at least len floats.
        self.touch();
        unsafe { result::memcpy_dtod_async(buf(dst), buf(src), len * 4, self.stream) }.unwrap_or_else(|e| panic!("device copy on {}: {e:?}", self.name));
    }

    fn grow(&self, b: &mut DevBuf, bytes: usize) {
        if b.bytes < bytes {
            // Queued kernels may still read the old buffer.
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            *b = DevBuf::zeroed(&self.ctx, bytes.next_power_of_two()).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
        }
    }

    fn htod<T>(&self, dst: u64, src: &[T]) {
        if src.is_empty() {
            return;
        }
        self.touch();
        // SAFETY: dst has room for src (callers size it); pageable copies complete their read of
        // `src` before returning.
        unsafe { result::memcpy_htod_async(dst, src, self.stream) }.unwrap_or_else(|e| panic!("host→device copy on {}: {e:?}", self.name));
    }

}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda(self.ordinal)
    }

    /// One `CudaDevice` per rank on GPUs `ordinal, ordinal + 1, …` and the peer collectives
    /// between them (`collective.rs`).
    fn tensor_parallel_group(&self, ranks: usize) -> Result<Vec<(std::sync::Arc<dyn Device>, std::sync::Arc<dyn crate::Collective>)>, String> {
        collective::group(self.ordinal, ranks).map_err(|e| format!("{e:#}"))
    }

    fn alloc(&self, len: usize) -> Tensor {
        Tensor::from_cuda(DevBuf::zeroed(&self.ctx, len * 4).unwrap_or_else(|e| panic!("{}: {e:#}", self.name)))
    }

    fn to_host(&self, t: &Tensor, len: usize, out: &mut [f32]) {
        self.download(t, len, out);
    }

    fn sample_launch(&self, logits: &Tensor, vocab: usize, specs: &[crate::sample::SampleSpec]) {
        self.sample_launch_impl(logits, vocab, specs);
    }

    fn sample_collect(&self, out: &mut [crate::sample::SampleOut]) {
        self.sample_collect_impl(out);
    }

    fn resolve_drawn<'a>(&self, ids: &'a [u32], _resolved: &'a mut Vec<u32>) -> &'a [u32] {
        self.resolve_drawn_impl(ids)
    }

    fn edit_logits(&self, logits: &mut Tensor, edits: &crate::logit_edits::LogitEdits) {
        self.edit_logits_impl(logits, edits)
    }

    fn upload(&self, data: &[f32], t: &mut Tensor) {
        self.bind();
        assert!(data.len() <= t.capacity(), "upload of {} floats into a tensor of {}", data.len(), t.capacity());
        self.htod(buf(t), data);
    }

    fn load_weight(&self, w: Weight) -> Weight {
        let ld = w.cols + self.weight_room;
        self.load_weight_strided(w, ld)
    }

    fn kv_elem_bytes(&self) -> usize {
        2
    }

    fn check_head_dim(&self, head_dim: usize) -> Result<(), String> {
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {head_dim} is not supported on CUDA (even, at most {MAX_HEAD_DIM})"));
        }
        Ok(())
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.bind();
        result::mem_get_info().ok().map(|(free, total)| (free / self.gpu_share, total / self.gpu_share))
    }

    fn alloc_kv(&self, layout: KvLayout) -> KvStorage {
        let mk = || Tensor::from_cuda(DevBuf::zeroed(&self.ctx, layout.layer_len() * 2).unwrap_or_else(|e| panic!("KV cache on {}: {e:#}", self.name)));
        KvStorage { layout, k: (0..layout.num_layers).map(|_| mk()).collect(), v: (0..layout.num_layers).map(|_| mk()).collect() }
    }

    fn stage_batch(&self, ids: &[u32], batch: &AttnBatch<'_>, logits_rows: &[u32], extra: &[&[u32]]) {
        self.bind();
        let mut st = self.state.lock().unwrap();
        if extra.iter().any(|e| !e.is_empty()) {
            // Before the step may be recorded: a recording cannot grow it.
            self.lora_reserve(&mut st, ids.len().max(logits_rows.len()));
        }
        self.stage(&mut st, ids, batch, logits_rows, extra);
        self.mark("stage_batch");
        if let Some(p) = &self.profiler {
            p.lock().unwrap().step_start = Some(std::time::Instant::now());
        }
    }

    fn run_step(&self, rows: usize, shape: Option<u64>, body: &mut dyn FnMut()) {
        self.run_step_recorded(rows, shape, body)
    }

    fn matmul(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        self.matmul_impl(x, m, w, bias, y)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) {
        self.embedding_rows(table, ids, 0, out);
    }

    fn embedding_vocab_range(&self, table: &Weight, ids: &[u32], start: usize, out: &mut Tensor) {
        self.embedding_rows(table, ids, start, out);
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.rms_norm_impl(x, w, eps, rows, dim, out)
    }

    fn add_rms_norm(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.add_rms_norm_impl(resid, delta, w, eps, rows, dim, out)
    }

    fn rms_norm_before_lora(&self, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor, next: &LoraCall<'_>) {
        self.rms_norm_before_lora_impl(x, delta, w, eps, rows, dim, out, next)
    }

    fn add_inplace(&self, resid: &mut Tensor, delta: &Tensor, len: usize) {
        self.add_inplace_impl(resid, delta, len)
    }

    fn rope_qk(&self, qkv: &mut Tensor, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, t: &RopeTable) {
        self.rope_qk_plus(qkv, 0, rows, positions, n_heads, n_kv_heads, t)
    }

    fn matmul_lora(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, lora: Option<&LoraCall<'_>>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        self.matmul_lora_impl(x, m, w, bias, lora, epilogue, y)
    }

    fn matmul_silu_mul(&self, x: &Tensor, m: usize, w: &Weight, gate_up: &mut Tensor, out: &mut Tensor) {
        self.matmul_silu_mul_impl(x, m, w, gate_up, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_rope_qk(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, qkv: &mut Tensor, positions: &[u32], n_heads: usize, n_kv_heads: usize, table: &RopeTable) {
        self.matmul_rope_qk_impl(x, m, w, bias, qkv, positions, n_heads, n_kv_heads, table)
    }

    fn silu_mul(&self, gate_up: &Tensor, rows: usize, inter: usize, out: &mut Tensor) {
        self.silu_mul_plus(gate_up, 0, rows, inter, out)
    }

    fn paged_attention(&self, qkv: &Tensor, b: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        self.paged_attention_impl(qkv, b, kv, layer, n_heads, scale, out)
    }

    fn stats(&self) -> Option<String> {
        let ahead = self.lora_ahead_launches.load(std::sync::atomic::Ordering::Relaxed);
        Some(format!("{}; LoRA shrinks computed in the norm: {ahead}", self.graph_stats()))
    }

    fn wait(&self) {
        self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn lora_alloc_site(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        self.lora_alloc_site_impl(shape)
    }

    fn lora_alloc_table(&self, entries: usize, slots: usize) -> LoraTable {
        self.lora_alloc_table_impl(entries, slots)
    }

    fn lora_write_slot(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        self.lora_write_slot_impl(buf, slot, fill);
        self.lora_tail_scatter(buf, slot);
    }

    fn lora_attach_tail(&self, w: &mut Weight, site: &LoraSiteBuffers) {
        self.lora_attach_tail_impl(w, site)
    }

    fn lora_sync_table(&self, table: &mut LoraTable) {
        self.lora_sync_table_impl(table)
    }

    fn lora_image(&self, elems: usize) -> Option<LoraImage> {
        Some(self.lora_image_impl(elems))
    }

    fn lora_image_fill(&self, image: &mut LoraImage, offset: usize, shape: LoraSiteShape, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        self.lora_image_fill_impl(image, offset, shape, fill)
    }

    fn lora_write_slot_image(&self, buf: &mut LoraSiteBuffers, slot: usize, image: &LoraImage, offset: usize) {
        self.lora_write_slot_image_impl(buf, slot, image, offset);
        self.lora_tail_scatter(buf, slot);
    }

    fn lora_tile_rows(&self) -> usize {
        lora::TILE_ROWS
    }
    fn lora_experts_supported(&self, slots: usize, experts: usize) -> Result<(), String> {
        self.lora_experts_check(slots, experts)
    }

    fn lora_experts(&self, call: &crate::LoraExpertCall<'_>, route: &MoeRouting, x: &Tensor, y: &mut Tensor) {
        self.lora_experts_impl(call, route, x, y)
    }

    fn lora_apply(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        self.lora_apply_impl(call, x, y)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor) {
        self.gather_rows_impl(x, rows, dim, out)
    }

    fn qk_norm(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
        self.moe_qk_norm(qkv, rows, n_heads, n_kv_heads, head_dim, norm)
    }

    fn load_experts(&self, rows: usize, cols: usize, experts: Vec<Weight>) -> ExpertWeights {
        self.moe_load_experts(rows, cols, experts)
    }

    fn alloc_routing(&self, max_rows: usize, spec: RouterSpec) -> MoeRouting {
        self.moe_alloc_routing(max_rows, spec)
    }

    fn moe_route(&self, logits: &Tensor, m: usize, route: &mut MoeRouting) {
        self.moe_route_rows(logits, m, route)
    }

    fn moe_gather(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
        self.moe_gather_rows(x, dim, route, out)
    }

    fn moe_matmul(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
        self.moe_grouped_matmul(x, route, w, y)
    }

    fn moe_combine(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
        self.moe_combine_rows(y, route, dim, out)
    }

    fn add_sigmoid_gated(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
        self.moe_add_sigmoid_gated(out, x, gate, rows, dim)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = unsafe { result::stream::synchronize(self.stream) };
            let c = &self.copy;
            // SAFETY: created by us in this context, destroyed once, after their work finished.
            unsafe {
                let _ = result::stream::synchronize(c.stream);
                for ev in [c.compute_mark, c.uploaded, c.downloaded] {
                    let _ = result::event::destroy(ev);
                }
                if c.separate {
                    let _ = result::stream::destroy(c.stream);
                }
            }
            if let Some(g) = &self.graphs {
                g.lock().unwrap().clear();
            }
        }
        if let Some(p) = &self.profiler {
            let mut p = p.lock().unwrap();
            let steps = p.steps.max(1) as f64;
            eprintln!("host per step: {:.3} ms issuing work, {:.3} ms waiting for the GPU ({} steps)", 1e3 * p.issue_s / steps, 1e3 * p.wait_s / steps, p.steps);
            let mut t = std::mem::take(&mut p.totals);
            t.sort_by(|a, b| b.1.total_cmp(&a.1));
            let all: f64 = t.iter().map(|x| x.1).sum();
            eprintln!("CUDA profile of {} (GPU time between op ends, launch gaps included):", self.name);
            for (name, ms, n) in t {
                eprintln!("  {name:<22} {ms:>10.2} ms {:>5.1}%  {n:>8} calls  {:>8.1} us/call", 100.0 * ms / all, 1e3 * ms / n as f64);
            }
        }
    }
}
