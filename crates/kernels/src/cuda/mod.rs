//! CUDA implementation of the device ops (cargo feature `cuda`).
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the binary builds and runs on a
//! machine without CUDA, where opening a CUDA device fails with a message naming the missing
//! library. Our kernels (`kernels.cu`) are compiled by NVRTC for the GPU's architecture at start-up
//! and the PTX is cached on disk, keyed by a hash of source and architecture. GEMMs go through
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

use crate::{AttnBatch, DType, Device, DeviceKind, ExpertWeights, KvLayout, KvStorage, MoeRouting, QkNorm, RopeTable, RouterSpec, Tensor, Weight, WeightData};
use anyhow::{bail, Context, Result};
use cudarc::driver::{result, sys, CudaContext, CudaModule};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const KERNELS_SRC: &str = concat!(include_str!("kernels.cu"), include_str!("moe.cu"));

/// Bumped by every device allocation: a recorded graph bakes in buffer addresses, so any
/// allocation (a grown workspace, a new KV store) retires every recording.
static ALLOC_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A plain device allocation (cuMemAlloc), freed on drop.
pub struct DevBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf> {
        ctx.bind_to_thread()?;
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0, ctx: ctx.clone() });
        }
        let ptr = unsafe { result::malloc_sync(bytes) }.with_context(|| format!("cuMemAlloc of {bytes} bytes"))?;
        ALLOC_GENERATION.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }?;
        Ok(DevBuf { ptr, bytes, ctx: ctx.clone() })
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes > 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context and freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (cuMemHostAlloc), the host end of the copy stream's transfers: a
/// copy from or to it runs on the DMA engine without the host staging it, so queuing one never
/// blocks the host.
struct PinnedBuf {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl PinnedBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBuf> {
        ctx.bind_to_thread()?;
        if bytes == 0 {
            return Ok(PinnedBuf { ptr: std::ptr::null_mut(), bytes: 0, ctx: ctx.clone() });
        }
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.with_context(|| format!("cuMemHostAlloc of {bytes} bytes"))? as *mut u8;
        Ok(PinnedBuf { ptr, bytes, ctx: ctx.clone() })
    }
    /// The first `len` elements of type `T` (`len · size_of::<T>() ≤ bytes`).
    fn slice_mut<T: Copy>(&mut self, len: usize) -> &mut [T] {
        assert!(len * std::mem::size_of::<T>() <= self.bytes, "pinned buffer too small");
        if len == 0 {
            return &mut [];
        }
        // SAFETY: in bounds (asserted), page-aligned memory we own; any bit pattern is a valid u32/f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.bytes > 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in this context; no copy uses it any more (the
            // owner waits for its copies before replacing or dropping it).
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// Which cuBLAS bf16 GEMMs take their f32 input as a bf16 hi + lo pair (two GEMMs, the second
/// accumulating) instead of one bf16 rounding: nearly f32 input precision for twice the work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SplitGemm {
    /// `QUIVER_CUDA_SPLIT_GEMM=0`.
    Never,
    /// The default: GEMMs over small weights (see [`CudaDevice::splits`]), where the second pass
    /// re-reads W from L2 and costs microseconds.
    Small,
    /// `QUIVER_CUDA_SPLIT_GEMM=1`.
    Always,
}

/// A weight counts as small for [`SplitGemm::Small`] up to this many bytes (read twice; at this
/// size the second read hits L2).
const SPLIT_MAX_WEIGHT_BYTES: usize = 16 << 20;

/// Largest download staged through the pinned buffer (bytes).
const PINNED_DOWNLOAD_MAX: usize = 64 << 10;

/// The second stream: per-step metadata up and logits down, through pinned buffers. Ordering
/// with the compute stream is by events only: an upload waits for the compute work queued
/// before it (which may still read the previous step's metadata) and the compute stream waits
/// for the upload; a download waits for the compute work that produced the data.
struct CopyStream {
    /// Its own stream, or the compute stream itself with `QUIVER_CUDA_COPY_STREAM=0` (same
    /// pinned buffers and events, no cross-stream hop: for measuring what the hop costs).
    stream: sys::CUstream,
    separate: bool,
    /// Recorded on the compute stream just before a transfer that must follow its work.
    compute_mark: sys::CUevent,
    /// Recorded on the copy stream after the last upload / download.
    uploaded: sys::CUevent,
    downloaded: sys::CUevent,
    /// Nothing has been queued on the compute stream since a download drained it (the end of
    /// every step): the next upload need not wait for it, which keeps a cross-stream hop off
    /// the critical path of a step.
    drained: std::sync::atomic::AtomicBool,
}

impl CopyStream {
    fn new(compute: sys::CUstream) -> Result<CopyStream> {
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

fn buf(t: &Tensor) -> u64 {
    match t.storage() {
        crate::Storage::Cuda(b) => b.ptr,
        crate::Storage::Cpu(_) => panic!("CUDA op given a host tensor"),
    }
}

struct Kernels {
    f32_to_bf16: sys::CUfunction,
    f32_to_bf16_split: sys::CUfunction,
    add_bias: sys::CUfunction,
    add_inplace: sys::CUfunction,
    embedding_bf16: sys::CUfunction,
    embedding_f32: sys::CUfunction,
    gather_rows: sys::CUfunction,
    rms_norm: sys::CUfunction,
    add_rms_norm: sys::CUfunction,
    rope_qk: sys::CUfunction,
    silu_mul: sys::CUfunction,
    kv_write: sys::CUfunction,
    paged_attention: sys::CUfunction,
    /// Tensor-core prefill attention for head_dim rounded up to 32, 64, 96, 128.
    prefill_attention: [sys::CUfunction; 4],
    /// Single-row GEMV for k % 8 == 0 (cp.async-streamed W), and the plain one for any k.
    gemv1_bf16: sys::CUfunction,
    gemv1_silu_bf16: sys::CUfunction,
    gemv1_rope_bf16: sys::CUfunction,
    gemv_bf16_any_k: sys::CUfunction,
}

/// Up to this many rows a bf16 GEMM runs as our GEMV (W streamed once, f32 input, bias fused)
/// instead of a cuBLAS GEMM on bf16-converted input, and a step may be recorded as a CUDA graph.
/// (A multi-row GEMV measured slower than cuBLAS on the H200: 10.4 ms for a 4-row 8B step
/// against 6.8 ms for 16 rows through cuBLAS.)
const GEMV_MAX_M: usize = 1;
/// Warps per block of the `gemv1_*` kernels, each computing two dot products (`GV_WARPS`,
/// `GV_ROWS` in kernels.cu).
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
/// Query rows per block of the prefill attention (`FA_BM` in kernels.cu), and its threads.
const PREFILL_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;
/// Largest head the prefill attention takes (larger heads run the decode kernel per row).
const PREFILL_MAX_HEAD_DIM: usize = 128;

/// Dynamic shared memory of the prefill attention for a head padded to `hdp`: two buffers of a K
/// and a V tile of 64 keys, rows padded by 8 bf16 (`fa_smem` in kernels.cu).
fn prefill_smem_bytes(hdp: usize) -> usize {
    2 * 2 * 64 * (hdp + 8) * 2
}

/// Where one staged host slice landed in the metadata buffer.
#[derive(Clone, Copy, Default)]
struct StagedSlice {
    addr: usize,
    len: usize,
    offset: usize,
}

/// Mutable per-step state: staged metadata and scratch buffers.
struct State {
    host_meta: Vec<u32>,
    meta: DevBuf,
    staged: [StagedSlice; 6],
    /// Offset of the row → sequence map derived from `seq_starts` at staging.
    row_seq: Option<StagedSlice>,
    /// Offset and count of the prefill-attention tiles (first row, rows, sequence) of the
    /// staged batch; tiles never cross a sequence.
    tiles: (usize, usize),
    side: DevBuf,
    xbf: DevBuf,
    /// `(f32 tensor, elements, touch count)`: `xbf` holds the bf16 copy of that tensor, written by
    /// the op that produced it, valid while nothing else has run on the device since (`touches`
    /// unchanged). A cuBLAS GEMM on exactly that input then skips its conversion.
    shadow: Option<(u64, usize, u64)>,
    /// Host ends of the copy stream: staged metadata, downloaded data.
    pin_up: PinnedBuf,
    pin_down: PinnedBuf,
}

/// Optional per-op GPU timing (`QUIVER_CUDA_PROFILE=1`): an event is recorded on the stream
/// after every op; at each host sync the intervals between consecutive events are charged to
/// the op that ended them (launch gaps included, which is the point), and the totals are printed
/// when the device is dropped. Off, it costs one branch per op.
#[derive(Default)]
struct Profiler {
    pool: Vec<sys::CUevent>,
    used: Vec<&'static str>,
    totals: Vec<(&'static str, f64, u64)>,
    /// Host time from the step's staging to its final copy being queued (issuing work), and
    /// host time then spent waiting for the GPU: issue ≫ wait means the host is the bottleneck.
    step_start: Option<std::time::Instant>,
    issue_s: f64,
    wait_s: f64,
    steps: u64,
}

/// Recorded decode steps (CUDA graphs), by batch shape.
#[derive(Default)]
struct Graphs {
    generation: u64,
    execs: Vec<(u64, sys::CUgraphExec)>,
    /// Shapes whose recording failed: they run eagerly.
    failed: Vec<u64>,
}

impl Graphs {
    fn clear(&mut self) {
        for (_, e) in self.execs.drain(..) {
            // SAFETY: instantiated by us, destroyed once.
            let _ = unsafe { result::graph::exec_destroy(e) };
        }
    }
}

/// Most shapes kept (a decode batch shape per running-sequence count, plus a few logits layouts);
/// past that, new shapes run eagerly.
const MAX_GRAPHS: usize = 320;

pub struct CudaDevice {
    ordinal: usize,
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
}

// SAFETY: the raw stream and function handles are used only under the device's discipline
// (one stream, the context bound on every calling thread before use).
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

/// What a single-row GEMV does with its output (`GV_PLAIN`, `GV_SILU`, `GV_ROPE` in kernels.cu).
enum Gemv1Epilogue<'a> {
    Plain,
    /// `y[i] = silu(gate_i) · up_i` over a fused `[gate; up]` weight: `Device::silu_mul` fused.
    SiluMul,
    /// RoPE on the q and k heads of a fused qkv output at the row's position: `Device::rope_qk` fused.
    Rope { positions: &'a [u32], heads_qk: usize, table: &'a RopeTable },
}

/// Launch `f` with the given arguments (each passed by value, in order).
macro_rules! launch {
    ($dev:expr, $f:expr, $grid:expr, $block:expr; $($arg:expr),* $(,)?) => {
        launch!($dev, $f, $grid, $block, smem = 0; $($arg),*)
    };
    ($dev:expr, $f:expr, $grid:expr, $block:expr, smem = $smem:expr; $($arg:expr),* $(,)?) => {{
        let dev: &CudaDevice = $dev;
        let grid: (u32, u32, u32) = $grid;
        let block: (u32, u32, u32) = $block;
        // SAFETY: the arguments match the kernel's C signature (pointers as u64, int as i32,
        // float as f32, long as i64), and every pointer is a live device buffer of this context.
        let r = unsafe { dev.launch_raw($f, grid, block, $smem, &mut [$(&mut { $arg } as *mut _ as *mut c_void),*]) };
        if let Err(e) = r {
            panic!("CUDA kernel launch failed on {}: {e:?}", dev.name);
        }
    }};
}

pub mod moe;

/// Threads for a one-block-per-row kernel walking `items` per row: one item each (as a whole
/// warp count), at most 1024. A decode row is then one load per thread instead of a serial chain.
fn row_threads(items: usize) -> (u32, u32, u32) {
    ((items.div_ceil(32) * 32).clamp(32, 1024) as u32, 1, 1)
}

/// Threads per block of the decode attention (at most `ATTN_WARPS` × 32 in kernels.cu): 16 warps
/// split a short batch's context finely (batch-1 latency); from 8 rows on, 8 warps, so more of a
/// large batch's many small blocks fit on an SM at once (16-warp blocks cost batch 256 ~6%).
fn attn_threads(rows: usize) -> u32 {
    if rows < 8 {
        512
    } else {
        256
    }
}

fn grid1(n: usize, threads: u32) -> (u32, u32, u32) {
    ((n.div_ceil(threads as usize)).clamp(1, 65535 * 8) as u32, 1, 1)
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("QUIVER_CACHE_DIR") {
        return PathBuf::from(d).join("kernels");
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("quiver").join("kernels");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("quiver").join("kernels")
}

/// PTX for `arch`, from the disk cache or freshly compiled by NVRTC.
fn kernels_ptx(arch: &str) -> Result<String> {
    // A toolchain change may change the hash: that only costs one recompilation.
    let key = {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        (arch, KERNELS_SRC).hash(&mut h);
        h.finish()
    };
    let path = cache_dir().join(format!("quiver-{key:016x}-{arch}.ptx"));
    if let Ok(s) = std::fs::read_to_string(&path) {
        return Ok(s);
    }
    let opts = cudarc::nvrtc::CompileOptions { options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()], ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_SRC, opts).map_err(|e| anyhow::anyhow!("NVRTC failed to compile Quiver's kernels for {arch}: {e:?}"))?;
    let src = ptx.to_src();
    // The cache is an optimization: failing to write it is not an error.
    if std::fs::create_dir_all(path.parent().unwrap()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &src).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(src)
}

/// Checks that the CUDA libraries we load at run time are present, naming the missing one.
fn check_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries.
    let present = unsafe {
        [
            ("the CUDA driver (libcuda.so)", cudarc::driver::sys::is_culib_present()),
            ("NVRTC (libnvrtc.so)", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLAS (libcublas.so)", cudarc::cublas::sys::is_culib_present()),
        ]
    };
    for (what, ok) in present {
        if !ok {
            bail!("CUDA device requested but {what} could not be loaded: is an NVIDIA driver and CUDA runtime installed, and on LD_LIBRARY_PATH?");
        }
    }
    Ok(())
}

impl CudaDevice {
    pub fn new(ordinal: usize) -> Result<Self> {
        check_libraries()?;
        let count = CudaContext::device_count().context("counting CUDA devices")?;
        if ordinal as i32 >= count {
            bail!("device cuda:{ordinal} requested but this machine has {count} CUDA device(s)");
        }
        let ctx = CudaContext::new(ordinal).with_context(|| format!("creating a CUDA context on device {ordinal}"))?;
        let (maj, min) = ctx.compute_capability()?;
        let name = format!("cuda:{ordinal} ({}, sm_{maj}{min})", ctx.name().unwrap_or_default());
        if maj < 8 {
            // bf16 tensor-core MMAs, cp.async and bf16x2 conversions in kernels.cu are sm_80+.
            bail!("{name}: Quiver's CUDA kernels need compute capability 8.0 (Ampere) or newer");
        }
        let arch = format!("sm_{maj}{min}");
        let ptx = kernels_ptx(&arch)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).context("loading Quiver's CUDA kernels")?;
        let f = |n: &str| -> Result<sys::CUfunction> { Ok(module.load_function(n).with_context(|| format!("kernel {n}"))?.cu_function()) };
        let k = Kernels {
            f32_to_bf16: f("f32_to_bf16")?,
            f32_to_bf16_split: f("f32_to_bf16_split")?,
            add_bias: f("add_bias")?,
            add_inplace: f("add_inplace")?,
            embedding_bf16: f("embedding_bf16")?,
            embedding_f32: f("embedding_f32")?,
            gather_rows: f("gather_rows")?,
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rope_qk: f("rope_qk")?,
            silu_mul: f("silu_mul")?,
            kv_write: f("kv_write")?,
            paged_attention: f("paged_attention")?,
            prefill_attention: [f("prefill_attention_32")?, f("prefill_attention_64")?, f("prefill_attention_96")?, f("prefill_attention_128")?],
            gemv1_bf16: f("gemv1_bf16")?,
            gemv1_silu_bf16: f("gemv1_silu_bf16")?,
            gemv1_rope_bf16: f("gemv1_rope_bf16")?,
            gemv_bf16_any_k: f("gemv_bf16_1")?,
        };
        let moe_k = moe::MoeKernels::load(&f)?;
        for (i, &pf) in k.prefill_attention.iter().enumerate() {
            let bytes = prefill_smem_bytes(32 * (i + 1)) as i32;
            // SAFETY: a function of the module just loaded; the value is within the H100/H200's
            // 227 KB per block (and within an sm_80's 163 KB).
            unsafe { result::function::set_function_attribute(pf, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes) }
                .context("raising the prefill attention's shared-memory limit")?;
        }
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).context("creating a CUDA stream")?;
        let graph_max_rows = std::env::var("QUIVER_CUDA_GRAPH_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(GRAPH_MAX_ROWS).min(GRAPH_MAX_ROWS);
        let blas_workspace = if graph_max_rows > GEMV_MAX_M { Some(DevBuf::zeroed(&ctx, BLAS_WORKSPACE)?) } else { None };
        let blas = blas::Blas::new(stream, blas_workspace.as_ref().map(|w| (w.ptr, w.bytes)))?;
        let state = State {
            host_meta: Vec::new(),
            meta: DevBuf::zeroed(&ctx, 0)?,
            staged: [StagedSlice::default(); 6],
            row_seq: None,
            tiles: (0, 0),
            side: DevBuf::zeroed(&ctx, 0)?,
            xbf: DevBuf::zeroed(&ctx, 0)?,
            shadow: None,
            pin_up: PinnedBuf::new(&ctx, 0)?,
            pin_down: PinnedBuf::new(&ctx, 0)?,
        };
        let copy = CopyStream::new(stream)?;
        let profiler = std::env::var_os("QUIVER_CUDA_PROFILE").filter(|v| v != "0").map(|_| Mutex::new(Profiler::default()));
        let split_gemm = match std::env::var("QUIVER_CUDA_SPLIT_GEMM").as_deref() {
            Ok("1") => SplitGemm::Always,
            Ok("0") => SplitGemm::Never,
            Err(_) => SplitGemm::Small,
            Ok(v) => {
                tracing::warn!("QUIVER_CUDA_SPLIT_GEMM={v:?} is neither 0 nor 1: splitting GEMMs over small weights only (the default)");
                SplitGemm::Small
            }
        };
        let graphs = (profiler.is_none() && std::env::var_os("QUIVER_CUDA_GRAPHS").is_none_or(|v| v != "0")).then(|| Mutex::new(Graphs::default()));
        let pdl = maj >= 9 && std::env::var_os("QUIVER_CUDA_PDL").is_none_or(|v| v != "0");
        let fuse_epilogues = std::env::var_os("QUIVER_CUDA_FUSE_EPILOGUES").is_none_or(|v| v != "0");
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            copy,
            blas,
            _blas_workspace: blas_workspace,
            k,
            moe_k,
            _module: module,
            state: Mutex::new(state),
            name,
            profiler,
            split_gemm,
            graphs,
            graph_max_rows,
            pdl,
            touches: Default::default(),
            fuse_epilogues,
        })
    }

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

    /// Launches `f` on the device's stream. With `pdl` the launch allows programmatic stream
    /// serialization: the kernel may be scheduled while its predecessor drains (hiding launch
    /// latency and the predecessor's tail, which matter in a decode step of ~330 small kernels).
    /// That is safe because every kernel in kernels.cu starts with `pdl_entry()`, which waits for
    /// the predecessor's completion before touching memory a kernel writes.
    ///
    /// # Safety
    /// `params` must match `f`'s C signature, every pointer a live device buffer of this context.
    unsafe fn launch_raw(&self, f: sys::CUfunction, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, params: &mut [*mut c_void]) -> Result<(), result::DriverError> {
        self.touch();
        if !self.pdl {
            return result::launch_kernel(f, grid, block, smem, self.stream, params);
        }
        // SAFETY: a zeroed attribute is valid; we set its id and the matching union field.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()).result()
    }

    /// A single-row GEMV by a bf16 weight with `k % 8 == 0`, its epilogue fused (kernels.cu:
    /// `gemv1_body`).
    fn gemv1(&self, w: &Weight, x: &Tensor, bias: Option<&Tensor>, y: &mut Tensor, epilogue: Gemv1Epilogue<'_>) {
        let WeightData::Cuda(wb, DType::Bf16) = &w.data else { panic!("gemv1 takes a bf16 device weight") };
        let (n, k) = (w.rows, w.cols);
        debug_assert!(k.is_multiple_of(8));
        let (f, warps, extra, head_dim, max_pos, pos, cos, sin) = match epilogue {
            Gemv1Epilogue::Plain => (self.k.gemv1_bf16, n.div_ceil(2), 0, 0, 0, 0, 0, 0),
            Gemv1Epilogue::SiluMul => (self.k.gemv1_silu_bf16, n / 2, n / 2, 0, 0, 0, 0, 0),
            Gemv1Epilogue::Rope { positions, heads_qk, table } => {
                let pos = self.meta_ptr(&mut self.state.lock().unwrap(), &positions[..1]);
                (self.k.gemv1_rope_bf16, n / 2, heads_qk, table.head_dim, table.max_pos, pos, buf(&table.cos), buf(&table.sin))
            }
        };
        let blocks = warps.div_ceil(GEMV1_WARPS_PER_BLOCK);
        launch!(self, f, (blocks as u32, 1, 1), (32 * GEMV1_WARPS_PER_BLOCK as u32, 1, 1);
            buf(x), wb.ptr, bias.map(buf).unwrap_or(0), buf(y), n as i32, k as i32, extra as i32, head_dim as i32, max_pos as i32, pos, cos, sin);
    }

    /// Whether a fused single-row GEMV applies: one row, a bf16 weight, `k % 8 == 0`.
    fn gemv1_fits(&self, m: usize, w: &Weight) -> bool {
        self.fuse_epilogues && m == 1 && w.cols.is_multiple_of(8) && matches!(w.data, WeightData::Cuda(_, DType::Bf16))
    }

    /// Whether a multi-row bf16 GEMM over an `n × k` weight takes the hi + lo split of its input.
    /// Over small weights it does: every GEMM of a model like SmolLM2 (hidden 576) is a few
    /// microseconds of launch-bound work on an H200, and its input rounded once to bf16 at every
    /// GEMM of 30 layers moved logprobs by up to 0.14 against f32 (0.06–0.08 with the split).
    /// Over big ones (every Llama-8B projection) it does not: there the second pass would cost
    /// throughput. The choice depends on the weight only, never on the batch, so a row is
    /// computed the same way whatever shares its step (the single-row GEMV reads f32 input
    /// anyway).
    fn splits(&self, n: usize, k: usize) -> bool {
        match self.split_gemm {
            SplitGemm::Always => true,
            SplitGemm::Never => false,
            SplitGemm::Small => 2 * n * k <= SPLIT_MAX_WEIGHT_BYTES,
        }
    }

    /// Replays a recorded step on the compute stream.
    fn launch_graph(&self, exec: sys::CUgraphExec) {
        self.copy.drained.store(false, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: callers pass a live executable graph of this context whose buffers are unchanged.
        unsafe { result::graph::launch(exec, self.stream) }.unwrap_or_else(|e| panic!("CUDA graph launch on {}: {e:?}", self.name));
    }

    fn touch(&self) {
        self.touches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.copy.drained.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Where an op producing a `rows × cols` GEMM input `out` also writes its bf16 copy, or null
    /// when the consuming matmul will not be a plain cuBLAS bf16 GEMM (single rows take the GEMV;
    /// the split mode converts itself). Call `set_shadow` after launching the producer.
    fn shadow_for(&self, st: &mut State, rows: usize, cols: usize) -> u64 {
        if rows <= GEMV_MAX_M || self.split_gemm == SplitGemm::Always {
            return 0;
        }
        self.grow(&mut st.xbf, rows * cols * 2);
        st.xbf.ptr
    }

    fn set_shadow(&self, st: &mut State, outb: u64, out: u64, len: usize) {
        st.shadow = (outb != 0).then(|| (out, len, self.touches.load(std::sync::atomic::Ordering::Relaxed)));
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

    /// Profiling: marks the end of op `what` on the stream.
    fn mark(&self, what: &'static str) {
        let Some(p) = &self.profiler else { return };
        let mut p = p.lock().unwrap();
        let i = p.used.len();
        if i == p.pool.len() {
            match result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
                Ok(e) => p.pool.push(e),
                Err(_) => return,
            }
        }
        if unsafe { result::event::record(p.pool[i], self.stream) }.is_ok() {
            p.used.push(what);
        }
    }

    /// Profiling: after a host sync, charges the recorded intervals to their ops.
    fn collect_profile(&self) {
        let Some(p) = &self.profiler else { return };
        let mut p = p.lock().unwrap();
        let Profiler { pool, used, totals, .. } = &mut *p;
        for i in 1..used.len() {
            let ms = unsafe { result::event::elapsed(pool[i - 1], pool[i]) }.unwrap_or(0.0) as f64;
            match totals.iter_mut().find(|t| t.0 == used[i]) {
                Some(t) => {
                    t.1 += ms;
                    t.2 += 1;
                }
                None => totals.push((used[i], ms, 1)),
            }
        }
        used.clear();
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

    /// Device address of a host metadata slice: its staged copy, or a fresh side upload.
    fn meta_ptr(&self, st: &mut State, s: &[u32]) -> u64 {
        let addr = s.as_ptr() as usize;
        if let Some(e) = st.staged.iter().find(|e| e.addr == addr && e.len == s.len() && e.len > 0) {
            return st.meta.ptr + 4 * e.offset as u64;
        }
        self.grow(&mut st.side, s.len() * 4);
        self.htod(st.side.ptr, s);
        st.side.ptr
    }

    fn stage(&self, st: &mut State, ids: &[u32], b: &AttnBatch<'_>, logits_rows: &[u32]) {
        let State { host_meta, staged, row_seq, tiles, .. } = st;
        host_meta.clear();
        let slices: [&[u32]; 6] = [ids, b.positions, b.seq_starts, b.ctx_lens, b.block_tables, logits_rows];
        for (i, s) in slices.iter().enumerate() {
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
        let tiles_at = host_meta.len();
        for s in 0..nseq {
            let (a, e) = (b.seq_starts[s], b.seq_starts[s + 1]);
            for r0 in (a..e).step_by(PREFILL_ROWS) {
                host_meta.extend_from_slice(&[r0, (e - r0).min(PREFILL_ROWS as u32), s as u32]);
            }
        }
        *tiles = (tiles_at, (host_meta.len() - tiles_at) / 3);
        let bytes = host_meta.len() * 4;
        self.grow(&mut st.meta, bytes);
        self.upload_meta(st);
    }

    /// `host_meta` into `meta` on the copy stream; the compute stream's later work waits for it.
    fn upload_meta(&self, st: &mut State) {
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
    fn row_seq_ptr(&self, st: &mut State, b: &AttnBatch<'_>) -> u64 {
        let staged_here = matches!(st.row_seq, Some(e) if e.addr == b.positions.as_ptr() as usize && e.len == b.positions.len());
        if !staged_here {
            // An op called outside a staged forward: stage this batch now.
            self.stage(st, &[], b, &[]);
        }
        st.meta.ptr + 4 * st.row_seq.unwrap().offset as u64
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda(self.ordinal)
    }

    fn alloc(&self, len: usize) -> Tensor {
        Tensor::from_cuda(DevBuf::zeroed(&self.ctx, len * 4).unwrap_or_else(|e| panic!("{}: {e:#}", self.name)))
    }

    fn to_host(&self, t: &Tensor, len: usize, out: &mut [f32]) {
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
        let t = started;
        if let Some(p) = &self.profiler {
            let mut p = p.lock().unwrap();
            if let Some(s) = p.step_start.take() {
                p.issue_s += t.duration_since(s).as_secs_f64();
                p.wait_s += t.elapsed().as_secs_f64();
                p.steps += 1;
            }
        }
        self.collect_profile();
    }

    fn upload(&self, data: &[f32], t: &mut Tensor) {
        self.bind();
        assert!(data.len() <= t.capacity(), "upload of {} floats into a tensor of {}", data.len(), t.capacity());
        self.htod(buf(t), data);
    }

    fn load_weight(&self, w: Weight) -> Weight {
        self.bind();
        let (rows, cols) = (w.rows, w.cols);
        let (b, dtype) = match &w.data {
            WeightData::F32(v) => {
                let b = DevBuf::zeroed(&self.ctx, v.len() * 4).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                self.htod(b.ptr, &v[..]);
                (b, DType::F32)
            }
            WeightData::Bf16(v) => {
                let b = DevBuf::zeroed(&self.ctx, v.len() * 2).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
                self.htod(b.ptr, &v[..]);
                (b, DType::Bf16)
            }
            WeightData::Tiled(_) | WeightData::Panels(_) => panic!("CUDA load_weight given a weight the CPU device already loaded (build a fresh Weight per device)"),
            WeightData::Cuda(..) => return w,
        };
        Weight { rows, cols, data: WeightData::Cuda(b, dtype) }
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
        result::mem_get_info().ok()
    }

    fn alloc_kv(&self, layout: KvLayout) -> KvStorage {
        let mk = || Tensor::from_cuda(DevBuf::zeroed(&self.ctx, layout.layer_len() * 2).unwrap_or_else(|e| panic!("KV cache on {}: {e:#}", self.name)));
        KvStorage { layout, k: (0..layout.num_layers).map(|_| mk()).collect(), v: (0..layout.num_layers).map(|_| mk()).collect() }
    }

    fn stage_batch(&self, ids: &[u32], batch: &AttnBatch<'_>, logits_rows: &[u32]) {
        self.bind();
        let mut st = self.state.lock().unwrap();
        self.stage(&mut st, ids, batch, logits_rows);
        self.mark("stage_batch");
        if let Some(p) = &self.profiler {
            p.lock().unwrap().step_start = Some(std::time::Instant::now());
        }
    }

    /// Pure decode steps (one row per sequence, at most `graph_max_rows`) are recorded as a
    /// CUDA graph the first time their shape is seen and replayed after: one launch per step
    /// instead of ~10 per layer. Issuing launches bounds eager decode on the H200 VM (7.8 ms of
    /// host issue time per 8B step against microseconds of waiting); replay took batch-1 decode
    /// from 157 to 169 tok/s. Prefill steps run eagerly: their shapes rarely repeat.
    fn run_step(&self, rows: usize, shape: Option<u64>, body: &mut dyn FnMut()) {
        let (Some(graphs), Some(key)) = (&self.graphs, shape) else { return body() };
        if rows == 0 || rows > self.graph_max_rows {
            return body();
        }
        self.bind();
        let decode = {
            let mut st = self.state.lock().unwrap();
            let decode = st.tiles.1 == rows; // otherwise some sequence brings several rows: prefill
            if decode && rows > GEMV_MAX_M {
                // Size the GEMM input scratch now: it may not grow while recording.
                let per_elem = if self.split_gemm == SplitGemm::Never { 2 } else { 4 };
                self.grow(&mut st.xbf, rows * GRAPH_MAX_K * per_elem);
            }
            decode
        }; // the ops in `body` take the state lock themselves
        if !decode {
            return body();
        }
        let mut g = graphs.lock().unwrap();
        if g.failed.contains(&key) {
            return body();
        }
        let generation = ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst);
        if g.generation != generation {
            g.clear();
            g.generation = generation;
        }
        if let Some(&(_, exec)) = g.execs.iter().find(|e| e.0 == key) {
            // SAFETY: a live executable graph of this context; its buffers are unchanged
            // (same allocation generation).
            self.launch_graph(exec);
            return;
        }
        if g.execs.len() >= MAX_GRAPHS {
            return body();
        }
        // Record. A failure leaves the step unexecuted: run it eagerly, and this shape always.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if unsafe { result::stream::begin_capture(self.stream, mode) }.is_err() {
            g.failed.push(key);
            return body();
        }
        body();
        let exec = unsafe { result::stream::end_capture(self.stream) }.and_then(|graph| {
            let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
            let _ = unsafe { result::graph::destroy(graph) };
            exec
        });
        let exec = match exec {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("CUDA graph capture of a {rows}-row step failed on {} ({e:?}); that shape runs eagerly", self.name);
                g.failed.push(key);
                return body();
            }
        };
        self.launch_graph(exec);
        if ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst) != generation {
            // Something was allocated while recording (its address is baked in but may move):
            // use this recording once only.
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            let _ = unsafe { result::graph::exec_destroy(exec) };
        } else {
            g.execs.push((key, exec));
        }
    }

    fn matmul(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        self.bind();
        if m == 0 {
            return;
        }
        let (k, n) = (w.cols, w.rows);
        let WeightData::Cuda(wb, dtype) = &w.data else { panic!("CUDA matmul given a host weight (load it with Device::load_weight)") };
        match dtype {
            DType::Bf16 if m <= GEMV_MAX_M => {
                if k.is_multiple_of(8) {
                    self.gemv1(w, x, bias, y, Gemv1Epilogue::Plain);
                } else {
                    let bp = bias.map(buf).unwrap_or(0);
                    launch!(self, self.k.gemv_bf16_any_k, (n.div_ceil(8) as u32, 1, 1), (256, 1, 1); buf(x), wb.ptr, bp, buf(y), n as i32, k as i32);
                }
                self.mark("matmul gemv");
                return;
            }
            DType::Bf16 if self.splits(n, k) => {
                let mut st = self.state.lock().unwrap();
                self.grow(&mut st.xbf, m * k * 4);
                let (hi, lo) = (st.xbf.ptr, st.xbf.ptr + (m * k * 2) as u64);
                launch!(self, self.k.f32_to_bf16_split, grid1(m * k, 256), (256, 1, 1); buf(x), hi, lo, (m * k) as i64);
                self.mark("matmul input to bf16");
                self.touch();
                let e1 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, hi, buf(y), false);
                let e2 = self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, lo, buf(y), true);
                e1.and(e2).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
            DType::Bf16 => {
                let mut st = self.state.lock().unwrap();
                let touches = self.touches.load(std::sync::atomic::Ordering::Relaxed);
                if st.shadow.take() != Some((buf(x), m * k, touches)) {
                    self.grow(&mut st.xbf, m * k * 2);
                    launch!(self, self.k.f32_to_bf16, grid1(m * k, 256), (256, 1, 1); buf(x), st.xbf.ptr, (m * k) as i64);
                    self.mark("matmul input to bf16");
                }
                self.touch();
                self.blas.gemm_xwt(blas::Operand::Bf16, m, n, k, wb.ptr, st.xbf.ptr, buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
            DType::F32 => {
                self.touch();
                self.blas.gemm_xwt(blas::Operand::F32, m, n, k, wb.ptr, buf(x), buf(y), false).unwrap_or_else(|e| panic!("{}: {e:#}", self.name));
            }
        }
        self.mark("matmul cublas");
        if let Some(b) = bias {
            launch!(self, self.k.add_bias, grid1(m * n, 256), (256, 1, 1); buf(y), buf(b), n as i32, (m * n) as i64);
            self.mark("bias");
        }
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) {
        self.bind();
        if ids.is_empty() {
            return;
        }
        let WeightData::Cuda(tb, dtype) = &table.data else { panic!("CUDA embedding given a host table") };
        let f = if *dtype == DType::Bf16 { self.k.embedding_bf16 } else { self.k.embedding_f32 };
        let mut st = self.state.lock().unwrap();
        let idp = self.meta_ptr(&mut st, ids);
        launch!(self, f, (ids.len() as u32, 1, 1), (256, 1, 1); tb.ptr, idp, buf(out), table.cols as i32);
        self.mark("embedding");
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, dim);
        let per_row = if dim.is_multiple_of(4) { dim / 4 } else { dim };
        launch!(self, self.k.rms_norm, (rows as u32, 1, 1), row_threads(per_row); buf(x), buf(w), buf(out), ob, dim as i32, eps);
        self.set_shadow(&mut st, ob, buf(out), rows * dim);
        self.mark("rms_norm");
    }

    fn add_rms_norm(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, dim);
        let per_row = if dim.is_multiple_of(4) { dim / 4 } else { dim };
        launch!(self, self.k.add_rms_norm, (rows as u32, 1, 1), row_threads(per_row); buf(resid), buf(delta), buf(w), buf(out), ob, dim as i32, eps);
        self.set_shadow(&mut st, ob, buf(out), rows * dim);
        self.mark("add_rms_norm");
    }

    fn add_inplace(&self, resid: &mut Tensor, delta: &Tensor, len: usize) {
        self.bind();
        if len == 0 {
            return;
        }
        launch!(self, self.k.add_inplace, grid1(len, 256), (256, 1, 1); buf(resid), buf(delta), len as i64);
        self.mark("add_inplace");
    }

    fn rope_qk(&self, qkv: &mut Tensor, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, t: &RopeTable) {
        self.bind();
        if rows == 0 {
            return;
        }
        assert_eq!(t.rotary_dim, t.head_dim, "partial rotary dims are not supported on CUDA");
        let width = (n_heads + 2 * n_kv_heads) * t.head_dim;
        let mut st = self.state.lock().unwrap();
        let pp = self.meta_ptr(&mut st, &positions[..rows]);
        launch!(self, self.k.rope_qk, (rows as u32, 1, 1), row_threads((n_heads + n_kv_heads) * t.rotary_dim / 2);
            buf(qkv), pp, buf(&t.cos), buf(&t.sin), (n_heads + n_kv_heads) as i32, t.head_dim as i32, (t.rotary_dim / 2) as i32, width as i32, t.max_pos as i32);
        self.mark("rope");
    }

    fn matmul_silu_mul(&self, x: &Tensor, m: usize, w: &Weight, gate_up: &mut Tensor, out: &mut Tensor) {
        self.bind();
        if !self.gemv1_fits(m, w) {
            self.matmul(x, m, w, None, gate_up);
            return self.silu_mul(gate_up, m, w.rows / 2, out);
        }
        self.gemv1(w, x, None, out, Gemv1Epilogue::SiluMul);
        self.mark("matmul gemv + silu_mul");
    }

    fn matmul_rope_qk(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, qkv: &mut Tensor, positions: &[u32], n_heads: usize, n_kv_heads: usize, table: &RopeTable) {
        self.bind();
        if !self.gemv1_fits(m, w) || table.rotary_dim != table.head_dim {
            self.matmul(x, m, w, bias, qkv);
            return self.rope_qk(qkv, m, positions, n_heads, n_kv_heads, table);
        }
        self.gemv1(w, x, bias, qkv, Gemv1Epilogue::Rope { positions, heads_qk: n_heads + n_kv_heads, table });
        self.mark("matmul gemv + rope");
    }

    fn silu_mul(&self, gate_up: &Tensor, rows: usize, inter: usize, out: &mut Tensor) {
        self.bind();
        if rows == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let ob = self.shadow_for(&mut st, rows, inter);
        let items = if inter.is_multiple_of(4) { rows * inter / 4 } else { rows * inter };
        launch!(self, self.k.silu_mul, grid1(items, 256), (256, 1, 1); buf(gate_up), buf(out), ob, inter as i32, (rows * inter) as i64);
        self.set_shadow(&mut st, ob, buf(out), rows * inter);
        self.mark("silu_mul");
    }

    fn paged_attention(&self, qkv: &Tensor, b: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        self.bind();
        let rows = b.positions.len();
        if rows == 0 {
            return;
        }
        let l = kv.layout;
        debug_assert!(l.head_dim <= MAX_HEAD_DIM, "refused at load by check_head_dim");
        let mut st = self.state.lock().unwrap();
        let rs = self.row_seq_ptr(&mut st, b);
        let pp = self.meta_ptr(&mut st, b.positions);
        let bt = self.meta_ptr(&mut st, b.block_tables);
        let (kc, vc) = (buf(&kv.k[layer]), buf(&kv.v[layer]));
        let stride = b.block_table_stride as i32;
        launch!(self, self.k.kv_write, (rows as u32, 1, 1), row_threads(l.n_kv_heads * l.head_dim);
            buf(qkv), rs, pp, bt, stride, kc, vc, n_heads as i32, l.n_kv_heads as i32, l.head_dim as i32, l.block_size as i32);
        self.mark("kv_write");
        let (tiles_at, n_tiles) = st.tiles;
        if n_tiles < rows && l.head_dim <= PREFILL_MAX_HEAD_DIM {
            // Some sequence brings several rows (prefill): tensor-core tiles of PREFILL_ROWS rows.
            let hd = l.head_dim;
            let f = self.k.prefill_attention[hd.div_ceil(32) - 1];
            let smem = prefill_smem_bytes(32 * hd.div_ceil(32)) as u32;
            let tp = st.meta.ptr + 4 * tiles_at as u64;
            let ob = self.shadow_for(&mut st, rows, n_heads * hd);
            launch!(self, f, (n_tiles as u32, n_heads as u32, 1), (PREFILL_THREADS, 1, 1), smem = smem;
                buf(qkv), kc, vc, tp, pp, bt, stride, buf(out), ob, n_heads as i32, l.n_kv_heads as i32, hd as i32, l.block_size as i32, scale);
            self.set_shadow(&mut st, ob, buf(out), rows * n_heads * hd);
            self.mark("attention prefill");
        } else {
            launch!(self, self.k.paged_attention, (rows as u32, n_heads as u32, 1), (attn_threads(rows), 1, 1);
                buf(qkv), kc, vc, rs, pp, bt, stride, buf(out), n_heads as i32, l.n_kv_heads as i32, l.head_dim as i32, l.block_size as i32, scale);
            self.mark("attention decode");
        }
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor) {
        self.bind();
        if rows.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let rp = self.meta_ptr(&mut st, rows);
        launch!(self, self.k.gather_rows, (rows.len() as u32, 1, 1), (256, 1, 1); buf(x), rp, buf(out), dim as i32);
        self.mark("gather_rows");
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
