//! Opening a CUDA device: the context, the kernels compiled for its architecture, the streams,
//! the cuBLAS handle and the per-step state, and the settings read from the environment.

use super::*;

impl CudaDevice {
    /// Opens device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self> {
        check_libraries()?;
        let count = CudaContext::device_count().context("counting CUDA devices")?;
        if ordinal as i32 >= count {
            bail!("device cuda:{ordinal} requested but this machine has {count} CUDA device(s)");
        }
        let ctx = CudaContext::new(ordinal).with_context(|| format!("creating a CUDA context on device {ordinal}"))?;
        let (maj, min) = ctx.compute_capability()?;
        let name = format!("cuda:{ordinal} ({}, sm_{maj}{min})", ctx.name().unwrap_or_default());
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).context("reading the SM count")?.max(1) as usize;
        if maj < 8 {
            // bf16 tensor-core MMAs, cp.async and bf16x2 conversions in the kernels are sm_80+.
            bail!("{name}: Quiver's CUDA kernels need compute capability 8.0 (Ampere) or newer");
        }
        let arch = format!("sm_{maj}{min}");
        let ptx = kernels_ptx(&arch)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).context("loading Quiver's CUDA kernels")?;
        let k = Kernels::load(&module)?;
        let moe_k = moe::MoeKernels::load(&|n: &str| Ok(module.load_function(n).with_context(|| format!("kernel {n}"))?.cu_function()))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).context("creating a CUDA stream")?;
        let graph_max_rows = std::env::var("QUIVER_CUDA_GRAPH_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(GRAPH_MAX_ROWS).min(GRAPH_MAX_ROWS);
        let blas_workspace = if graph_max_rows > GEMV_MAX_M { Some(DevBuf::zeroed(&ctx, BLAS_WORKSPACE)?) } else { None };
        let blas = blas::Blas::new(stream, blas_workspace.as_ref().map(|w| (w.ptr, w.bytes)))?;
        let state = State {
            host_meta: Vec::new(),
            meta: DevBuf::zeroed(&ctx, 0)?,
            staged: [StagedSlice::default(); 6 + MAX_EXTRA],
            lora_t: DevBuf::zeroed(&ctx, 0)?,
            lora_counters: DevBuf::zeroed(&ctx, 0)?,
            lora_delta: DevBuf::zeroed(&ctx, 0)?,
            lora_expert_groups: DevBuf::zeroed(&ctx, 0)?,
            lora_ahead_t: DevBuf::zeroed(&ctx, 0)?,
            lora_ahead: None,
            lora_ahead_placed: None,
            lora_deferred: None,
            gemv_lora_ctr: DevBuf::zeroed(&ctx, 16)?,
            row_seq: None,
            tiles: (0, 0),
            single_tiles: 0,
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
        // Blocks per SM per round of the one-row GEMV with LoRA (gemm.rs): fewer leave room for
        // the next kernel's blocks to start early (PDL), which session 24 found LoRA steps at
        // one row do not get (PDL off slowed the base step 3.4% and the LoRA step not at all).
        let gemv_lora_blocks_per_sm = match std::env::var("QUIVER_CUDA_GEMV_LORA_BLOCKS").map(|v| v.parse::<usize>()) {
            Err(_) => gemm::GEMV_LORA_BLOCKS_PER_SM,
            Ok(Ok(n)) if (1..=gemm::GEMV_LORA_BLOCKS_PER_SM).contains(&n) => n,
            Ok(_) => {
                tracing::warn!("QUIVER_CUDA_GEMV_LORA_BLOCKS is not 1 to {}: {} (the default)", gemm::GEMV_LORA_BLOCKS_PER_SM, gemm::GEMV_LORA_BLOCKS_PER_SM);
                gemm::GEMV_LORA_BLOCKS_PER_SM
            }
        };
        let profiler_on = profiler.is_some();
        // The whole delta of a decode step's site in one launch beside its GEMM (lora_rows.rs)
        // in steps of up to this many rows (0: never; `QUIVER_CUDA_LORA_ROWS=0` too).
        let lora_rows_max = match std::env::var("QUIVER_CUDA_LORA_ROWS_MAX") {
            Err(_) => lora_rows::DEFAULT_MAX_ROWS,
            Ok(v) => v.parse::<usize>().map(|n| n.min(lora::DELTA_BESIDE_MAX_ROWS)).unwrap_or_else(|_| {
                tracing::warn!("QUIVER_CUDA_LORA_ROWS_MAX={v:?} is not a row count: {} (the default)", lora_rows::DEFAULT_MAX_ROWS);
                lora_rows::DEFAULT_MAX_ROWS
            }),
        };
        let lora_rows_max = if maj >= 9 && std::env::var_os("QUIVER_CUDA_LORA_ROWS").is_none_or(|v| v != "0") { lora_rows_max } else { 0 };
        // The shrink in the norm: by default in the steps the one-launch delta leaves (it measured
        // cheaper beside the GEMM, session 21), from 2 rows without it (one-row steps measured 1-4
        // points slower with it on the H200 than the GEMV computing its own shrink); `1` / `2`
        // from one / two rows, `0` never.
        // With the expand in the epilogue (lora_epilogue.rs) the norm's shrink is what feeds
        // it, so then the default is from two rows. The epilogue is on by default (`1`): session
        // 24's H100 A/B had it level with the side-stream delta at one adapter and 5 points of
        // step time cheaper with 16 adapters at 64 rows, served +2 points at c64; `2` (o/down
        // deferred into the next norm) measured dearer in sessions 23 and 24, `0` is the delta
        // beside the GEMM for every site. (`3`, qkv's and gate_up's shrink beside their GEMM
        // instead of in the norm, measured no faster in session 26 and was removed.)
        let lora_epilogue = match std::env::var("QUIVER_CUDA_LORA_EPILOGUE").as_deref() {
            _ if maj < 9 => 0,
            Ok("0") => 0,
            Ok("1") | Err(_) => 1,
            Ok("2") => 2,
            Ok(v) => {
                tracing::warn!("QUIVER_CUDA_LORA_EPILOGUE={v:?} is not 0, 1 or 2: 1 (the default)");
                1
            }
        };
        let ahead_default = if lora_epilogue > 0 { 2 } else { lora_rows_max.max(1) + 1 };
        let lora_ahead_min_rows = match std::env::var("QUIVER_CUDA_LORA_AHEAD").as_deref() {
            Ok("0") => None,
            Ok("1") => Some(1),
            Ok("2") => Some(2),
            Err(_) => Some(ahead_default),
            Ok(v) => {
                tracing::warn!("QUIVER_CUDA_LORA_AHEAD={v:?} is not 0, 1 or 2: the default");
                Some(ahead_default)
            }
        }
        .filter(|_| maj >= 9);
        let lora_row1 = match std::env::var("QUIVER_CUDA_LORA_ROW1").as_deref() {
            Ok("beside") => lora::Row1Lora::BesideResidual,
            Ok("rows") => lora::Row1Lora::Beside,
            Ok("fold") | Err(_) => lora::Row1Lora::Fold,
            Ok(v) => {
                tracing::warn!("QUIVER_CUDA_LORA_ROW1={v:?} is not fold, beside or rows: folding (the default)");
                lora::Row1Lora::Fold
            }
        };
        // Decode attention by KV head from this many rows (`decode_attention.cu`); below it the
        // per-query-head kernel, whose 16-warp blocks split a short batch's context finer.
        let attn_gqa_min_rows = match std::env::var("QUIVER_CUDA_ATTN_GQA_MIN_ROWS") {
            Err(_) => attention::ATTN_GQA_MIN_ROWS,
            Ok(v) => v.parse().unwrap_or_else(|_| {
                tracing::warn!("QUIVER_CUDA_ATTN_GQA_MIN_ROWS={v:?} is not a row count: {} (the default)", attention::ATTN_GQA_MIN_ROWS);
                attention::ATTN_GQA_MIN_ROWS
            }),
        };
        // Which attention-by-KV-head kernel runs: the cp.async-streamed one (`v2`, the default:
        // +25% decode tok/s at 256 rows of the 8B shape on an H100, session 23) or the first
        // (`v1`), kept for A/B runs.
        let attn_decode_v1 = match std::env::var("QUIVER_CUDA_ATTN_DECODE").as_deref() {
            Ok("v1") => true,
            Ok("v2") | Err(_) => false,
            Ok(v) => {
                tracing::warn!("QUIVER_CUDA_ATTN_DECODE={v:?} is neither v1 nor v2: v2 (the default)");
                false
            }
        };
        let attn_decode = attention::DecodeAttn::load(&|n: &str| Ok(module.load_function(n).with_context(|| format!("kernel {n}"))?.cu_function()), attn_decode_v1)?;
        Ok(CudaDevice {
            ordinal,
            sms,
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
            gemv_lora_blocks_per_sm,
            lora_geom: Mutex::new(lora::LoraGeometry::default()),
            recording: Default::default(),
            draws: Mutex::new(Default::default()),
            logit_edits: Mutex::new(None),
            lora_fill_scratch: Mutex::new((Vec::new(), Vec::new())),
            lora_side: lora::SideStream::new(profiler_on)?,
            on_side: Default::default(),
            lora_ahead_min_rows,
            lora_ahead_launches: Default::default(),
            lora_row1,
            lora_rows_max,
            lora_epilogue,
            attn_gqa_min_rows,
            attn_decode,
            lora_gemm_first: std::env::var_os("QUIVER_CUDA_LORA_GEMM_FIRST").is_none_or(|v| v != "0"),
            weight_room: room("QUIVER_CUDA_WEIGHT_ROOM"),
            input_room: room("QUIVER_CUDA_INPUT_ROOM").into(),
            lora_tail: lora_tail::TailConfig::from_env()?,
            draw_source: None,
            tp_agree: Default::default(),
            gpu_share: 1,
        })
    }
}

/// Columns of room from environment variable `var` (a check's setting, `QUIVER_CUDA_*_ROOM`),
/// rounded up to 8 so rows stay 16-byte aligned; 0 when unset.
fn room(var: &str) -> usize {
    let Ok(v) = std::env::var(var) else { return 0 };
    let cols: usize = v.parse().unwrap_or_else(|_| panic!("{var}={v:?}: a number of columns"));
    cols.next_multiple_of(8)
}
