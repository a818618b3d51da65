//! Device-kernel layer: the only crate that knows what a device is.
//!
//! Everything above (LoRA, model, engine) holds activations as [`Tensor`]s and weights as
//! [`Weight`]s and calls ops through the [`Device`] trait object. The CPU implementation lives in
//! [`cpu`]; a CUDA implementation plugs in behind the `cuda` feature with its own [`Storage`]
//! variant, and an OpenCL one ([`opencl`]: Intel GPUs, any OpenCL device) in every build, without
//! the model changing.
//!
//! Conventions: activations are f32, row-major `[rows, cols]`. Linear weights are `[out, in]`
//! (PyTorch order) so `y = x · Wᵀ`. Computation accumulates in f32 whatever the weight dtype.

pub mod aligned;
pub mod alloc_count;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod logit_edits;
pub mod lora;
pub mod moe;
pub mod opencl;
pub mod sample;

pub use comm::Collective;
pub use moe::{ExpertWeights, MoeRouting, QkNorm, RouterSpec};

use std::fmt;
use std::sync::Arc;

pub use lora::{GroupRows, LoraCall, LoraExpertCall, LoraGroups, LoraImage, LoraSiteBuffers, LoraSiteShape, LoraStorage, LoraTable, LoraTail, LoraX};

/// Where a [`Device`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda(usize),
    /// The N-th Intel GPU among the OpenCL devices (`xpu[:N]`).
    Xpu(usize),
    /// The N-th OpenCL device of any kind, in platform order (`opencl[:N]`).
    OpenCl(usize),
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => write!(f, "cpu"),
            DeviceKind::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceKind::Xpu(i) => write!(f, "xpu:{i}"),
            DeviceKind::OpenCl(i) => write!(f, "opencl:{i}"),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, index) = match s.split_once(':') {
            Some((n, i)) => (n, i.parse::<usize>().ok()),
            None => (s, Some(0)),
        };
        match (name, index) {
            ("cpu", _) if s == "cpu" => Ok(DeviceKind::Cpu),
            ("cuda", Some(i)) => Ok(DeviceKind::Cuda(i)),
            ("xpu", Some(i)) => Ok(DeviceKind::Xpu(i)),
            ("opencl", Some(i)) => Ok(DeviceKind::OpenCl(i)),
            _ => Err(format!("unknown device `{s}` (expected cpu, cuda[:N], xpu[:N] or opencl[:N])")),
        }
    }
}

/// Storage dtype of weights kept in memory. Compute is always f32-accumulated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            _ => Err(format!("unknown dtype `{s}` (expected f32 or bf16)")),
        }
    }
}

/// Device memory behind a tensor. Host tensors are cache-line aligned like weights: the KV
/// cache's rows and the activations' rows are then whole lines wherever the row width is a
/// multiple of 16 floats (with the allocator's 16 bytes every 256-byte K/V head row of a decode
/// step spanned five lines, and every vector load of it one split across two).
pub enum Storage {
    Cpu(aligned::AlignedVec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::DevBuf),
    OpenCl(opencl::ClBuf),
}

/// A flat f32 activation buffer on some device. Shape bookkeeping is the caller's: ops take
/// explicit row/column counts, which keeps buffers reusable across steps of different sizes
/// (the capacity is fixed; the logical size varies).
pub struct Tensor {
    storage: Storage,
}

impl Tensor {
    pub fn cpu(data: Vec<f32>) -> Self {
        Tensor { storage: Storage::Cpu(aligned::AlignedVec::from_slice(&data)) }
    }
    pub fn zeros_cpu(len: usize) -> Self {
        Tensor { storage: Storage::Cpu(aligned::AlignedVec::zeroed(len)) }
    }
    pub fn capacity(&self) -> usize {
        match &self.storage {
            Storage::Cpu(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(b) => b.bytes() / 4,
            Storage::OpenCl(b) => b.bytes() / 4,
        }
    }
    /// True when the data lives in host memory (so [`Tensor::as_cpu`] works).
    pub fn is_host(&self) -> bool {
        matches!(self.storage, Storage::Cpu(_))
    }
    /// Host view. Panics on device storage: callers that need host data on any device go
    /// through [`Device::to_host`].
    pub fn as_cpu(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => panic!("host view of a CUDA tensor (copy it with Device::to_host)"),
            Storage::OpenCl(_) => panic!("host view of an OpenCL tensor (copy it with Device::to_host)"),
        }
    }
    pub fn as_cpu_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => panic!("host view of a CUDA tensor (copy it with Device::to_host)"),
            Storage::OpenCl(_) => panic!("host view of an OpenCL tensor (copy it with Device::to_host)"),
        }
    }
    pub fn from_opencl(buf: opencl::ClBuf) -> Self {
        Tensor { storage: Storage::OpenCl(buf) }
    }
    #[cfg(feature = "cuda")]
    pub fn from_cuda(buf: cuda::DevBuf) -> Self {
        Tensor { storage: Storage::Cuda(buf) }
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
}

/// Element data of a weight matrix.
pub enum WeightData {
    /// Host memory, cache-line aligned (see [`aligned`]).
    F32(aligned::AlignedVec<f32>),
    Bf16(aligned::AlignedVec<half::bf16>),
    /// Host memory as AMX tiles (f32 as bf16 hi + lo planes, or bf16): see [`cpu::amx`].
    Tiled(cpu::amx::TiledWeight),
    /// Host memory in column panels for the CPU GEMM: see [`cpu::panel`].
    Panels(cpu::panel::PanelWeight),
    /// In device memory, in the given dtype, rows `ld` elements apart (`ld ≥ cols`: columns
    /// past `cols` are room the device keeps beside the matrix, e.g. for LoRA's B; shared with
    /// the LoRA site whose tail lives there, see [`LoraTail`]).
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<cuda::DevBuf>, DType, usize),
    /// In an OpenCL device's memory, in the given dtype.
    OpenCl(opencl::ClBuf, DType),
}

/// A `[rows, cols]` = `[out, in]` matrix (or an embedding table `[vocab, hidden]`).
pub struct Weight {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Weight {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>, dtype: DType) -> Self {
        assert_eq!(data.len(), rows * cols, "weight data does not match its shape");
        let data = match dtype {
            DType::F32 => WeightData::F32(aligned::AlignedVec::from_slice(&data)),
            DType::Bf16 => WeightData::Bf16(aligned::AlignedVec::from_slice(&data.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>())),
        };
        Weight { rows, cols, data }
    }
    pub fn dtype(&self) -> DType {
        match self.data {
            WeightData::F32(_) => DType::F32,
            WeightData::Bf16(_) => DType::Bf16,
            WeightData::Tiled(ref t) => if t.is_f32() { DType::F32 } else { DType::Bf16 },
            WeightData::Panels(ref p) => if p.is_f32() { DType::F32 } else { DType::Bf16 },
            #[cfg(feature = "cuda")]
            WeightData::Cuda(_, d, _) => d,
            WeightData::OpenCl(_, d) => d,
        }
    }
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::Bf16(v) => v.len() * 2,
            WeightData::Tiled(t) => t.size_bytes(),
            WeightData::Panels(p) => p.size_bytes(),
            #[cfg(feature = "cuda")]
            WeightData::Cuda(b, ..) => b.bytes(),
            WeightData::OpenCl(b, _) => b.bytes(),
        }
    }
    /// Row `r` converted to f32 into `out` (len `cols`). Host weights only.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
            WeightData::Bf16(v) => {
                for (o, x) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = x.to_f32();
                }
            }
            WeightData::Tiled(t) => t.row_f32(r, out),
            WeightData::Panels(p) => p.row_f32(r, out),
            #[cfg(feature = "cuda")]
            WeightData::Cuda(..) => panic!("row_f32 of a weight in device memory"),
            WeightData::OpenCl(..) => panic!("row_f32 of a weight in device memory"),
        }
    }
}

/// Geometry of a paged KV cache: `num_blocks` blocks of `block_size` tokens, each token holding
/// `n_kv_heads × head_dim` keys and as many values, per layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Floats per layer for K (and as many for V).
    pub fn layer_len(&self) -> usize {
        self.num_blocks * self.block_size * self.n_kv_heads * self.head_dim
    }
    /// Bytes of one block (K and V, every layer) at `elem_bytes` per element (4 on CPU, 2 for
    /// the bf16 cache of CUDA: see [`Device::kv_elem_bytes`]).
    pub fn bytes_per_block(&self, elem_bytes: usize) -> usize {
        2 * self.num_layers * self.block_size * self.n_kv_heads * self.head_dim * elem_bytes
    }
}

/// Paged K/V storage for every layer, on the device that computes attention.
pub struct KvStorage {
    pub layout: KvLayout,
    /// Per layer: K then V, each `layout.layer_len()` floats.
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

/// Per-sequence view of a varlen batch, as attention needs it. All slices are host-side
/// metadata living in preallocated buffers owned by the caller.
pub struct AttnBatch<'a> {
    /// Token-row offsets of each sequence's new tokens: `seq_starts[s]..seq_starts[s+1]`.
    pub seq_starts: &'a [u32],
    /// Absolute position of each new token (row).
    pub positions: &'a [u32],
    /// Total context length of each sequence after this step (cached + new).
    pub ctx_lens: &'a [u32],
    /// Block table of each sequence: `block_tables[s*stride .. s*stride + ceil(ctx/bs)]`.
    pub block_tables: &'a [u32],
    pub block_table_stride: usize,
}

/// Rotary position embedding tables (cos/sin per position and frequency), precomputed once on
/// the host and kept on the device that applies them.
pub struct RopeTable {
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub max_pos: usize,
    /// `[max_pos, rotary_dim/2]`
    pub cos: Tensor,
    pub sin: Tensor,
}

/// What follows a projection in [`Device::matmul_lora`].
pub enum Epilogue<'a> {
    Plain,
    /// [`Device::rope_qk`] on the fused qkv output.
    RopeQk { positions: &'a [u32], n_heads: usize, n_kv_heads: usize, table: &'a RopeTable },
    /// [`Device::silu_mul`] of the fused `[gate; up]` output into `out`.
    SiluMul { out: &'a mut Tensor },
    /// None, but the caller adds the output to `resid` next (the residual stream after o_proj
    /// and down_proj), so a device may add the LoRA delta straight into `resid` instead of the
    /// output (the same sum up to rounding order): then the delta need not wait for the
    /// projection (CUDA computes it beside the GEMM). The caller's next op on `resid` must be
    /// that add ([`Device::add_inplace`], [`Device::add_rms_norm`] or
    /// [`Device::rms_norm_before_lora`] with the output as the delta), before anything reads
    /// `resid`: a device may also defer the delta into that op (CUDA's
    /// `QUIVER_CUDA_LORA_EPILOGUE=2`).
    Residual { resid: &'a mut Tensor },
}

impl Epilogue<'_> {
    /// Applies the epilogue to the projection output `y` (`m` rows, by weight `w`) as its own op.
    pub fn run<D: Device + ?Sized>(self, d: &D, y: &mut Tensor, m: usize, w: &Weight) {
        match self {
            Epilogue::Plain | Epilogue::Residual { .. } => {}
            Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => d.rope_qk(y, m, positions, n_heads, n_kv_heads, table),
            Epilogue::SiluMul { out } => d.silu_mul(y, m, w.rows / 2, out),
        }
    }
}

/// A projection without a delta and its epilogue, through the device's fused ops (the
/// `lora: None` case of [`Device::matmul_lora`], for devices overriding it too).
pub fn epilogue_after_matmul<D: Device + ?Sized>(d: &D, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, epilogue: Epilogue<'_>, y: &mut Tensor) {
    match epilogue {
        Epilogue::Plain | Epilogue::Residual { .. } => d.matmul(x, m, w, bias, y),
        Epilogue::RopeQk { positions, n_heads, n_kv_heads, table } => d.matmul_rope_qk(x, m, w, bias, y, positions, n_heads, n_kv_heads, table),
        Epilogue::SiluMul { out } => {
            debug_assert!(bias.is_none(), "a fused gate_up projection has no bias");
            d.matmul_silu_mul(x, m, w, y, out)
        }
    }
}

const NO_HOST_DRAWS: &str = "a device that keeps no host draws must override sample_launch, sample_collect and resolve_drawn";

/// The ops a model needs. One implementation per device; the model holds `Arc<dyn Device>`.
pub trait Device: Send + Sync {
    fn kind(&self) -> DeviceKind;

    /// A zeroed activation buffer of `len` floats.
    fn alloc(&self, len: usize) -> Tensor;
    /// Copy the first `len` floats to host memory.
    fn to_host(&self, t: &Tensor, len: usize, out: &mut [f32]);
    /// Draws one token per spec from `logits` (`[rows, vocab]` as the forward left them; see
    /// [`sample`] for the semantics every device shares), with its logprobs when asked: a
    /// [`Device::sample_launch`] and its [`Device::sample_collect`]. Only the results cross to
    /// the host.
    fn sample(&self, logits: &Tensor, vocab: usize, specs: &[sample::SampleSpec], out: &mut [sample::SampleOut]) {
        self.sample_launch(logits, vocab, specs);
        self.sample_collect(&mut out[..specs.len()]);
    }
    /// Queues the draws of [`Device::sample`] behind the work queued so far, without waiting for
    /// them: a later step's ids may name them ([`sample::DRAWN`]) before the host has them. At
    /// most one launch is outstanding: collect it before the next. A host device draws here
    /// ([`sample::HostDraws`]).
    fn sample_launch(&self, logits: &Tensor, vocab: usize, specs: &[sample::SampleSpec]) {
        self.host_draws().expect(NO_HOST_DRAWS).launch(self, logits, vocab, specs)
    }
    /// The results of the last [`Device::sample_launch`], one per spec, into the start of `out`,
    /// waiting for them if they are not on the host yet (CUDA: they come down on the copy
    /// stream); at once on a host device. The draws stay nameable until the next launch.
    fn sample_collect(&self, out: &mut [sample::SampleOut]) {
        self.host_draws().expect(NO_HOST_DRAWS).collect(out)
    }
    /// Called by the forward after [`Device::stage_batch`], before any op reads the step's ids:
    /// every `DRAWN | i` in `ids` becomes the token drawn for spec `i` of the last
    /// [`Device::sample_launch`], where the step's ops read ids. A host device writes the
    /// resolved ids into `resolved` and returns them (or `ids` when it names no draw); CUDA
    /// patches its staged copy of `ids` with a gather from the draws' device buffer, queued
    /// behind the draw, and returns `ids`. The ops of the step then take the returned slice.
    fn resolve_drawn<'a>(&self, ids: &'a [u32], resolved: &'a mut Vec<u32>) -> &'a [u32] {
        self.host_draws().expect(NO_HOST_DRAWS).resolve(ids, resolved)
    }
    /// Applies a step's [`logit_edits::LogitEdits`] (penalties, logit bias, bans, allowed-token
    /// masks) to their rows of `logits` (`[rows, vocab]`, `edits.vocab()` wide) in place, queued
    /// like any op, before the draws that read them. The default edits host memory (the CPU).
    fn edit_logits(&self, logits: &mut Tensor, edits: &logit_edits::LogitEdits) {
        edits.apply_host(logits.as_cpu_mut());
    }
    /// Where a device that draws on the host keeps its draws between launch and collect (the
    /// defaults of the three ops above use it); `None` for a device that overrides them.
    fn host_draws(&self) -> Option<&sample::HostDraws> {
        None
    }
    /// Copy host data into the start of `t`.
    fn upload(&self, data: &[f32], t: &mut Tensor);
    /// A new tensor holding `data` (norm weights, biases, rope tables: small vectors the ops read).
    fn tensor_from(&self, data: &[f32]) -> Tensor {
        let mut t = self.alloc(data.len());
        self.upload(data, &mut t);
        t
    }
    /// Move weights onto the device (identity on CPU).
    fn load_weight(&self, w: Weight) -> Weight {
        w
    }
    /// One line of the device's own counters for benchmark reports (CUDA: recorded, replayed and
    /// eager steps), if it keeps any.
    fn stats(&self) -> Option<String> {
        None
    }
    /// Blocks until every op queued so far has finished (benchmarks time whole steps with it);
    /// a device that computes synchronously has nothing to wait for.
    fn wait(&self) {}
    /// `(free, total)` bytes of the device's own memory, for devices that have one (the CPU
    /// shares host memory and says `None`).
    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }
    /// Whether this device's attention kernels handle heads of `head_dim`; checked when a model
    /// is loaded, so an unsupported model is refused up front instead of failing mid-step.
    fn check_head_dim(&self, _head_dim: usize) -> Result<(), String> {
        Ok(())
    }
    /// Whether this device has the ops a model's layers need beyond the dense decoder's: the
    /// q/k RMSNorm (Qwen3, OLMoE) and the mixture-of-experts ops; checked at load like the head
    /// size, naming what is missing.
    fn check_layer_ops(&self, _qk_norm: bool, _moe: bool) -> Result<(), String> {
        Ok(())
    }
    /// Whether one buffer of `bytes` can be allocated (the largest weight a model loads, a
    /// layer's stacked experts): checked at load, so a model too big for the device's largest
    /// allocation is an error naming the limit, not a failure mid-load.
    fn check_alloc(&self, _bytes: usize) -> Result<(), String> {
        Ok(())
    }
    /// The devices and collectives of a tensor-parallel group of `ranks` ranks built from this
    /// device (rank r gets element r), or why this device cannot run one. Each rank's device
    /// must run its step on the thread that calls it (its rank's thread), since a rank waits in
    /// collectives for the others.
    fn tensor_parallel_group(&self, _ranks: usize) -> Result<Vec<(Arc<dyn Device>, Arc<dyn Collective>)>, String> {
        Err(format!("the {} device has no collectives between ranks", self.kind()))
    }
    /// The embedding gather of one vocab-parallel shard: `table` holds vocab rows
    /// `start..start + table.rows`; a row whose id falls there gets its table row, any other
    /// row zeros (the ranks' outputs are summed next). Only devices that form tensor-parallel
    /// groups ([`Device::tensor_parallel_group`]) are asked.
    fn embedding_vocab_range(&self, _table: &Weight, _ids: &[u32], _start: usize, _out: &mut Tensor) {
        panic!("the {} device has no vocab-parallel embedding: it forms no tensor-parallel group", self.kind())
    }
    /// Bytes per K/V element in the caches this device allocates.
    fn kv_elem_bytes(&self) -> usize {
        4
    }
    /// Called once per forward step before any op, with every host-side metadata slice the
    /// step's ops will receive (`extra`: the LoRA groups packed for the device, see
    /// [`lora::pack_tiles`]). A device with its own memory copies them over in one transfer
    /// and serves later ops from that copy; the CPU reads the slices where they are.
    fn stage_batch(&self, _ids: &[u32], _batch: &AttnBatch<'_>, _logits_rows: &[u32], _extra: &[&[u32]]) {}
    /// Runs `body`: every op of one forward step between [`Device::stage_batch`] and the
    /// final copy to host, over `rows` token rows. `shape` identifies everything that fixes the
    /// step's launches (row and sequence layout, logits rows); steps with equal shapes differ only
    /// in the staged data. A device may record the ops the first time it meets a shape and replay
    /// the recording afterwards (CUDA graphs). `None` asks for eager execution, e.g. when a hook
    /// inside the step copies through the host.
    fn run_step(&self, _rows: usize, _shape: Option<u64>, body: &mut dyn FnMut()) {
        body()
    }

    /// `y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias[n])`.
    fn matmul(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor);
    /// `out[t] = table[ids[t]]` for an embedding table `[vocab, hidden]`.
    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor);
    /// `out = rmsnorm(x) * w` row-wise over `rows × dim`.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor);
    /// `resid += delta` then `out = rmsnorm(resid) * w`.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor);
    /// `resid += delta` over `len` floats.
    fn add_inplace(&self, resid: &mut Tensor, delta: &Tensor, len: usize);
    /// The RMSNorm whose output `out` is the input of the LoRA projection `next`, which the
    /// caller makes right after through [`Device::matmul_lora`] with the same call: `rms_norm`
    /// of `x`, or with `delta` `add_rms_norm` (`x += delta` first). A device may compute
    /// `next`'s shrink in the norm's own pass and hand it to that `matmul_lora` (CUDA in decode
    /// steps: the shrink then costs no launch and the projection waits for nothing). The default
    /// is the norm alone.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_before_lora(&self, x: &mut Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor, next: &LoraCall<'_>) {
        let _ = next;
        match delta {
            Some(d) => self.add_rms_norm(x, d, w, eps, rows, dim, out),
            None => self.rms_norm(x, w, eps, rows, dim, out),
        }
    }
    /// Rotate-half RoPE applied in place to the q and k parts of a fused `[rows, q+k+v]` buffer.
    fn rope_qk(&self, qkv: &mut Tensor, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, table: &RopeTable);
    /// `out[r, i] = silu(gu[r, i]) * gu[r, inter + i]` for a fused `[rows, 2·inter]` buffer.
    fn silu_mul(&self, gate_up: &Tensor, rows: usize, inter: usize, out: &mut Tensor);
    /// [`Device::matmul`] by a fused `[gate; up]` weight into `gate_up`, then
    /// [`Device::silu_mul`] into `out`. A device may do both in one pass (then `gate_up` is left
    /// as it was): at batch 1 each kernel less shortens a chain of latency-bound launches.
    fn matmul_silu_mul(&self, x: &Tensor, m: usize, w: &Weight, gate_up: &mut Tensor, out: &mut Tensor) {
        self.matmul(x, m, w, None, gate_up);
        self.silu_mul(gate_up, m, w.rows / 2, out);
    }
    /// [`Device::matmul`] by a fused qkv weight, then [`Device::rope_qk`] on the result; a
    /// device may do both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn matmul_rope_qk(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, qkv: &mut Tensor, positions: &[u32], n_heads: usize, n_kv_heads: usize, table: &RopeTable) {
        self.matmul(x, m, w, bias, qkv);
        self.rope_qk(qkv, m, positions, n_heads, n_kv_heads, table);
    }
    /// A projection with its LoRA delta: `y = x·Wᵀ (+ bias)`, then `y += Δ(x)` for the rows of
    /// `lora` (none: no delta), then `epilogue` — the model's one seam for a projection that
    /// may carry adapters (llama.cpp's `build_lora_mm`), so a device may fold the delta into
    /// the projection's own pass and keep the epilogue fused (CUDA at one row). The default is
    /// those steps one after another, exactly as separate calls.
    #[allow(clippy::too_many_arguments)]
    fn matmul_lora(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, lora: Option<&LoraCall<'_>>, epilogue: Epilogue<'_>, y: &mut Tensor) {
        let Some(call) = lora else { return epilogue_after_matmul(self, x, m, w, bias, epilogue, y) };
        self.matmul(x, m, w, bias, y);
        self.lora_apply(call, LoraX::Dense(x), y);
        epilogue.run(self, y, m, w);
    }
    /// Writes each row's k/v (from the fused qkv buffer) into the paged cache of `layer`, then
    /// computes causal attention of each new query against its sequence's whole context.
    /// `out` is `[rows, n_heads·head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(&self, qkv: &Tensor, batch: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor);
    /// Gather rows: `out[i] = x[rows[i]]` with row width `dim`.
    fn gather_rows(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor);
    // ---- LoRA (see the `lora` module for the layouts and the op's contract) ----

    /// Zeroed slot buffers of one LoRA site, in this device's memory and element type.
    fn lora_alloc_site(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        LoraSiteBuffers::host(shape)
    }
    /// Makes `w`, the base weight of LoRA site `site` (a weight this device loaded), keep the B
    /// of the site's first slots beside its rows (the slots written so far copied there, later
    /// writes follow), and records where in `site.tail` ([`LoraTail`]; a later attach of another
    /// weight takes the tail over), on a device whose GEMMs add the delta that way (CUDA under
    /// default, not under `QUIVER_CUDA_LORA_TAIL=0`). Elsewhere nothing changes.
    fn lora_attach_tail(&self, _w: &mut Weight, _site: &LoraSiteBuffers) {}
    /// A rank / scaling table for `entries` sites of `slots` slots (with a device mirror where
    /// the kernels need one).
    fn lora_alloc_table(&self, entries: usize, slots: usize) -> LoraTable {
        LoraTable::host(entries, slots)
    }
    /// Rewrites slot `slot` of `buf`: `fill(a, b)` receives that slot's A (`n·R·in`) and Bᵀ
    /// (`R·b_ld`) zeroed, as f32, and writes the adapter into them; the device then holds them
    /// in its own element type. Every element of the slot is rewritten (the zero-tail invariant).
    fn lora_write_slot(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        let a = &mut buf.a.host_mut()[slot * al..(slot + 1) * al];
        a.fill(0.0);
        let b = &mut buf.b.host_mut()[slot * bl..(slot + 1) * bl];
        b.fill(0.0);
        fill(a, b);
    }
    /// Host memory for `elems` pool elements laid out as this device's pool holds them, from
    /// which [`Self::lora_write_slot_image`] copies without converting; `None` (the default)
    /// where the pool is host memory and [`Self::lora_write_slot`] is already one pass.
    fn lora_image(&self, _elems: usize) -> Option<LoraImage> {
        None
    }
    /// Writes one site's slot contents into `image` at element `offset`: `fill` as for
    /// [`Self::lora_write_slot`] (zeroed f32 A and Bᵀ of `shape`).
    fn lora_image_fill(&self, _image: &mut LoraImage, _offset: usize, _shape: LoraSiteShape, _fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        unreachable!("lora_image_fill on a device that makes no LoRA images")
    }
    /// Rewrites slot `slot` of `buf` from the site at `offset` of `image`, queued behind the
    /// device's earlier work (a step still reading the old adapter finishes first); the host
    /// does not wait for the copy.
    fn lora_write_slot_image(&self, _buf: &mut LoraSiteBuffers, _slot: usize, _image: &LoraImage, _offset: usize) {
        unreachable!("lora_write_slot_image on a device that makes no LoRA images")
    }
    /// Copies the host side of `table` into its device mirror (after slots were loaded or freed).
    fn lora_sync_table(&self, _table: &mut LoraTable) {}
    /// Rows per tile of the packed groups this device reads; 0 when it reads the host slices of
    /// [`LoraGroups`] (nothing is packed or staged).
    fn lora_tile_rows(&self) -> usize {
        0
    }
    /// Whether LoRA on MoE experts can run here for `slots` adapter slots over `experts`
    /// experts (the pool asks before allocating expert sites and refuses them with the reason).
    /// The default runs [`Self::lora_experts`] on [`MoeRouting`]'s host copy; a device whose
    /// routing stays in its own memory either groups on the device or says why not.
    fn lora_experts_supported(&self, _slots: usize, _experts: usize) -> Result<(), String> {
        Ok(())
    }
    /// `y[p] += Δ_{w·E+e}(x[p])` for every routed position p of `route` (expert e, token row
    /// of adapter slot w; base rows untouched): `x` and `y` are the grouped `[m·k, in]` input and
    /// `[m·k, out]` output of the experts' grouped GEMM (see [`LoraExpertCall`]). The default
    /// runs the call's host path on the host routing.
    fn lora_experts(&self, call: &LoraExpertCall<'_>, route: &MoeRouting, x: &Tensor, y: &mut Tensor) {
        let h = route.as_host().expect("lora_experts on a routing in device memory: the device must implement lora_experts");
        (call.host)(h, x, y)
    }
    /// `y[t] += Δ(x[t])` for every row `t` of `call.groups` (the `lora` module's formula); `y` is
    /// row-major `[call.groups.rows, out]`.
    fn lora_apply(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor);

    /// Allocate a paged KV store.
    fn alloc_kv(&self, layout: KvLayout) -> KvStorage {
        KvStorage {
            layout,
            k: (0..layout.num_layers).map(|_| self.alloc(layout.layer_len())).collect(),
            v: (0..layout.num_layers).map(|_| self.alloc(layout.layer_len())).collect(),
        }
    }

    // ---- Qwen3 / OLMoE attention and mixture-of-experts layers (see `moe`)

    /// RMSNorm in place over the q and k parts of a fused `[rows, q | k | v]` buffer (before
    /// RoPE), in the groups `norm` gives; the v part is untouched.
    fn qk_norm(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm);
    /// Moves `E` expert weights of one shape onto the device.
    fn load_experts(&self, rows: usize, cols: usize, experts: Vec<Weight>) -> ExpertWeights {
        ExpertWeights { num_experts: experts.len(), rows, cols, data: moe::ExpertData::PerExpert(experts.into_iter().map(|w| self.load_weight(w)).collect()) }
    }
    /// Routing buffers for up to `max_rows` rows.
    fn alloc_routing(&self, max_rows: usize, spec: RouterSpec) -> MoeRouting {
        MoeRouting::host(max_rows, spec)
    }
    /// Routes `m` rows of router logits `[m, E]` (see [`moe::HostRouting::route`]).
    fn moe_route(&self, logits: &Tensor, m: usize, route: &mut MoeRouting);
    /// `out[p] = x[row_of[p]]` for the `m·k` grouped positions of the last routing; rows are
    /// `dim` wide.
    fn moe_gather(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor);
    /// `y[p] = x[p] · W_e(p)ᵀ` over the `m·k` grouped rows of the last routing, where `e(p)` is
    /// the expert position p is grouped under: one GEMM per expert over its rows.
    fn moe_matmul(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor);
    /// `out[r] = Σ_j weight(r, j) · y[pos_of(r, j)]` over each row's k choices in order, rows
    /// `dim` wide (overwrites `out`).
    fn moe_combine(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor);
    /// `out[r] += sigmoid(gate[r]) · x[r]` for `rows` rows of `dim` (Qwen2-MoE's shared expert;
    /// `gate` is `[rows, 1]`).
    fn add_sigmoid_gated(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize);
}

/// Builds the device named by `kind`, or says why it cannot be used here.
pub fn open_device(kind: DeviceKind) -> anyhow::Result<Arc<dyn Device>> {
    match kind {
        DeviceKind::Cpu => Ok(Arc::new(cpu::CpuDevice::new())),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(ordinal) => Ok(Arc::new(cuda::CudaDevice::new(ordinal)?)),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda(_) => anyhow::bail!(
            "device {kind} requested but this build has no CUDA support (rebuild with `--features cuda`)"
        ),
        DeviceKind::Xpu(_) | DeviceKind::OpenCl(_) => Ok(Arc::new(opencl::OpenClDevice::new(kind)?)),
    }
}
