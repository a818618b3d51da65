//! OpenCL implementation of the device ops: Intel GPUs (`--device xpu[:N]`) through Intel's
//! compute runtime, and any OpenCL device (`--device opencl[:N]`: PoCL, NVIDIA's OpenCL, Intel's
//! CPU runtime for tests).
//!
//! `opencl3` loads `libOpenCL.so.1` at run time, so every build has this device and a machine
//! without OpenCL, or without an Intel GPU, gets an error naming what is missing. Our OpenCL C
//! kernels (`common.cl`, `kernels.cl`, `gemm.cl`, `lora.cl`, `moe.cl`, `logit_edits.cl`, and `dpas.cl` for Intel's
//! matrix extension) are compiled at start-up for the device, tile sizes as `-D` defines from the same
//! values the host's launch grids use (`tiles.rs`; `QUIVER_OPENCL_TILES` overrides them, so the
//! kernels can be tuned on real hardware without a code change).
//!
//! Invariants:
//! - One in-order command queue. Ops enqueue kernels and return; `to_host` is a blocking read,
//!   the end of every step. Per-step metadata (token ids, positions, block tables, logits rows,
//!   the LoRA groups) goes over in one write from [`Device::stage_batch`]; kernels take the
//!   staged buffer and the word offset of each slice, found by the slice's address and length.
//!   A slice that was not staged is uploaded on the side (correct, just slower).
//! - Activations, the KV cache and the LoRA pool are f32; weights are f32 or bf16 and every
//!   product accumulates in f32.
//! - Every element of every op is computed in an order that depends only on its own row (the
//!   GEMM and GEMV share one multiply-add chain over k), so a row's result does not depend on its
//!   batch, as on the CPU device: the engine's batched = alone test holds bit for bit.
//! - Buffers never shrink; growing one releases the old buffer, which OpenCL keeps alive until
//!   the commands queued on it have run.

mod attention;
mod gemm;
pub mod kernel_set;
mod logit_edits;
mod lora;
mod memory;
mod moe;
mod platform;
mod program;
pub mod testing;
mod tiles;
mod transfer;

pub use kernel_set::KernelSet;
pub use memory::ClBuf;
pub use moe::ClRouting;

use crate::{AttnBatch, DType, Device, DeviceKind, ExpertWeights, KvStorage, LoraCall, LoraSiteBuffers, LoraSiteShape, LoraTable, LoraX, MoeRouting, QkNorm, RopeTable, RouterSpec, Tensor, Weight, WeightData};
use anyhow::{anyhow, bail, Result};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::Device as ClDevice;
use opencl3::kernel::Kernel;
use opencl3::types::{cl_mem, CL_BLOCKING};
use platform::Caps;
use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use transfer::State;

/// Work-items per row of the norms (`ROW_WG` in common.cl).
const ROW_WG: usize = 64;
/// Work-items per (row, head) of attention and the dims each holds (`ATTN_WG`, `ATTN_DPW`).
const ATTN_WG: usize = 64;
const ATTN_DPW: usize = 4;
/// Largest head the attention kernel holds.
const MAX_HEAD_DIM: usize = ATTN_WG * ATTN_DPW;

/// A kernel argument.
#[derive(Clone, Copy)]
enum Arg {
    Mem(cl_mem),
    I32(i32),
    F32(f32),
}

fn mem(t: &Tensor) -> cl_mem {
    match t.storage() {
        crate::Storage::OpenCl(b) => b.mem(),
        _ => panic!("OpenCL op given a tensor of another device"),
    }
}

pub struct OpenClDevice {
    kind: DeviceKind,
    name: String,
    caps: Caps,
    set: KernelSet,
    tiles: tiles::Tiles,
    // Field order: kernels and buffers are released before the queue and the context.
    kernels: HashMap<String, Kernel>,
    state: Mutex<State>,
    /// Held from a kernel's first `clSetKernelArg` to its enqueue (kernel objects are shared).
    launch_lock: Mutex<()>,
    queue: CommandQueue,
    ctx: Context,
    allocated: Arc<AtomicUsize>,
    /// Draws happen on the host, from rows read back (see `sample::HostDraws`).
    draws: crate::sample::HostDraws,
    /// The logit edits' buffers (see `logit_edits.rs`).
    logit_edits: Mutex<logit_edits::EditBufs>,
}

// SAFETY: OpenCL handles may be used from any thread; the one call that is not thread-safe on a
// shared object (clSetKernelArg) happens under `launch_lock` together with its enqueue.
unsafe impl Send for OpenClDevice {}
unsafe impl Sync for OpenClDevice {}

impl OpenClDevice {
    /// Opens the device `kind` names (`Xpu` or `OpenCl`), picks its kernel set and compiles it.
    pub fn new(kind: DeviceKind) -> Result<Self> {
        let (intel_gpu, index) = match kind {
            DeviceKind::Xpu(i) => (true, i),
            DeviceKind::OpenCl(i) => (false, i),
            _ => bail!("OpenClDevice::new given {kind}"),
        };
        let caps = platform::select(intel_gpu, index)?;
        let set = platform::choose_kernels(&caps)?;
        Self::with_caps(kind, caps, set)
    }

    fn with_caps(kind: DeviceKind, caps: Caps, set: KernelSet) -> Result<Self> {
        let name = format!("{kind} ({}, {})", caps.name.trim(), caps.platform.trim());
        let tiles = tiles::Tiles::from_env(caps.is_gpu)?;
        // Refused here, naming the limit, rather than failing a launch mid-step.
        let need_wg = tiles.max_work_group().max(ROW_WG).max(ATTN_WG);
        if caps.max_work_group < need_wg {
            bail!("{name}: work-groups of at most {} work-items; Quiver's OpenCL kernels need {need_wg} (tiles {tiles:?})", caps.max_work_group);
        }
        // The attention kernel's q, s and slots arrays and the MoE grouping's cursors beside the GEMMs'.
        let need_local = tiles.local_mem_bytes().max(ATTN_WG * (ATTN_DPW + 2) * 4).max(moe::GROUP_LOCAL_BYTES);
        if caps.local_mem < need_local as u64 {
            bail!("{name}: {} bytes of local memory; Quiver's OpenCL kernels need {need_local} (tiles {tiles:?})", caps.local_mem);
        }
        let ctx = Context::from_device(&ClDevice::new(caps.id)).map_err(|e| anyhow!("{name}: creating an OpenCL context: {e}"))?;
        #[allow(deprecated)] // clCreateCommandQueue: the OpenCL 1.2 call every runtime has
        let queue = unsafe { CommandQueue::create(&ctx, caps.id, 0) }.map_err(|e| anyhow!("{name}: creating an OpenCL command queue: {e}"))?;
        let options = format!("-cl-std=CL1.2 -DROW_WG={ROW_WG} -DATTN_WG={ATTN_WG} -DMOE_MAX_EXPERTS={} {}", crate::moe::MAX_EXPERTS, tiles.defines(&set));
        let mut kernels = HashMap::new();
        let sources = [
            program::Source { file: "kernels.cl", text: include_str!("kernels.cl") },
            program::Source { file: "gemm.cl", text: include_str!("gemm.cl") },
            program::Source { file: "lora.cl", text: include_str!("lora.cl") },
            program::Source { file: "moe.cl", text: include_str!("moe.cl") },
        ];
        for src in sources.iter().chain(gemm::dpas_source(&set).as_ref()) {
            kernels.extend(program::build(&ctx, caps.id, &name, &set, src, &options)?);
        }
        let edits = program::Source { file: "logit_edits.cl", text: include_str!("logit_edits.cl") };
        kernels.extend(program::build(&ctx, caps.id, &name, &set, &edits, &format!("{options} {}", logit_edits::build_options(&caps)))?);
        eprintln!("quiver: {name}: {}", set.describe());
        let allocated = Arc::new(AtomicUsize::new(0));
        let state = State::new(&ctx, &allocated)?;
        Ok(OpenClDevice { kind, name, caps, set, tiles, kernels, state: Mutex::new(state), launch_lock: Mutex::new(()), queue, ctx, allocated, draws: Default::default(), logit_edits: Default::default() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kernel_set(&self) -> KernelSet {
        self.set
    }

    /// The subgroup width of the DPAS kernels, when the device runs them.
    fn dpas_lanes(&self) -> Option<usize> {
        match self.set {
            KernelSet::Dpas { lanes, .. } => Some(lanes),
            KernelSet::Portable => None,
        }
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> ! {
        panic!("{what} on {}: {e}", self.name)
    }

    /// A zeroed buffer of `bytes`.
    fn zeroed(&self, bytes: usize) -> ClBuf {
        // Models are checked at load (`Device::check_alloc`); this is the last line of defence.
        if let Err(e) = self.check_alloc(bytes) {
            panic!("{e}");
        }
        let mut b = ClBuf::new(&self.ctx, bytes, &self.allocated).unwrap_or_else(|e| self.fail("allocation", format!("{e:#}")));
        let size = b.bytes.max(4).next_multiple_of(4);
        // SAFETY: fills the whole buffer (its allocated size) with zero bytes.
        unsafe { self.queue.enqueue_fill_buffer(&mut b.buf, &[0u8], 0, size, &[]) }.unwrap_or_else(|e| self.fail("zeroing a buffer", e));
        b
    }

    /// Blocking copy of host data into `dst` at byte offset `at`.
    fn write<T: bytemuck::Pod>(&self, dst: &mut ClBuf, at: usize, data: &[T]) {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return;
        }
        assert!(at + bytes.len() <= dst.bytes.max(4), "OpenCL write of {} bytes at {at} into a buffer of {}", bytes.len(), dst.bytes);
        // SAFETY: in bounds (asserted); the write completes before the call returns.
        unsafe { self.queue.enqueue_write_buffer(&mut dst.buf, CL_BLOCKING, at, bytes, &[]) }.unwrap_or_else(|e| self.fail("host→device copy", e));
    }

    /// Enqueues kernel `name` over `global` work-items (rounded up to whole work-groups of
    /// `local`, or the runtime's choice without).
    fn launch(&self, name: &str, global: &[usize], local: Option<&[usize]>, args: &[Arg]) {
        let k = self.kernels.get(name).unwrap_or_else(|| panic!("no OpenCL kernel {name} on {}", self.name));
        let mut g = [1usize; 3];
        for (i, &n) in global.iter().enumerate() {
            g[i] = match local {
                Some(l) => n.max(1).next_multiple_of(l[i]),
                None => n.max(1),
            };
        }
        let _guard = self.launch_lock.lock().unwrap();
        for (i, a) in args.iter().enumerate() {
            // SAFETY: each argument matches the kernel's C parameter at its index (buffers as
            // cl_mem, int as i32, float as f32); the buffers are live objects of this context.
            let r = unsafe {
                match a {
                    Arg::Mem(m) => k.set_arg(i as u32, m),
                    Arg::I32(v) => k.set_arg(i as u32, v),
                    Arg::F32(v) => k.set_arg(i as u32, v),
                }
            };
            r.unwrap_or_else(|e| self.fail(&format!("setting argument {i} of kernel {name}"), e));
        }
        let lp = local.map_or(std::ptr::null(), |l| l.as_ptr());
        // SAFETY: sizes for `global.len()` dimensions; the arguments are set above.
        unsafe { self.queue.enqueue_nd_range_kernel(k.get(), global.len() as u32, std::ptr::null(), g.as_ptr(), lp, &[]) }
            .unwrap_or_else(|e| self.fail(&format!("launching kernel {name}"), e));
    }

    /// Waits for every queued command; surfaces asynchronous errors.
    pub fn finish(&self) -> Result<()> {
        self.queue.finish().map_err(|e| anyhow!("OpenCL queue of {}: {e}", self.name))
    }
}

impl Device for OpenClDevice {
    fn kind(&self) -> DeviceKind {
        self.kind
    }

    /// Draws happen on the host; ids naming them resolve into a host slice the device has
    /// not staged, which the ops reading it upload on the side (correct, one small copy more).
    fn host_draws(&self) -> Option<&crate::sample::HostDraws> {
        Some(&self.draws)
    }

    fn alloc(&self, len: usize) -> Tensor {
        Tensor::from_opencl(self.zeroed(len * 4))
    }

    fn edit_logits(&self, logits: &mut Tensor, edits: &crate::logit_edits::LogitEdits) {
        self.edit_logits_impl(logits, edits)
    }

    fn to_host(&self, t: &Tensor, len: usize, out: &mut [f32]) {
        if len == 0 {
            return;
        }
        let crate::Storage::OpenCl(b) = t.storage() else { panic!("OpenCL to_host given a tensor of another device") };
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out[..len]);
        // SAFETY: the tensor holds at least `len` floats; blocking, so `out` is written on return.
        unsafe { self.queue.enqueue_read_buffer(&b.buf, CL_BLOCKING, 0, dst, &[]) }.unwrap_or_else(|e| self.fail("device→host copy (or a kernel before it)", e));
    }

    fn upload(&self, data: &[f32], t: &mut Tensor) {
        assert!(data.len() <= t.capacity(), "upload of {} floats into a tensor of {}", data.len(), t.capacity());
        let crate::Storage::OpenCl(b) = &mut t.storage else { panic!("OpenCL upload given a tensor of another device") };
        self.write(b, 0, data);
    }

    fn load_weight(&self, w: Weight) -> Weight {
        let (rows, cols) = (w.rows, w.cols);
        let (b, dtype) = match &w.data {
            WeightData::F32(v) => {
                let mut b = self.zeroed(v.len() * 4);
                self.write(&mut b, 0, &v[..]);
                (b, DType::F32)
            }
            WeightData::Bf16(v) => {
                let mut b = self.zeroed(v.len() * 2);
                self.write(&mut b, 0, bytemuck::cast_slice::<half::bf16, u16>(&v[..]));
                (b, DType::Bf16)
            }
            WeightData::OpenCl(..) => return w,
            _ => panic!("OpenCL load_weight given a weight another device already loaded (build a fresh Weight per device)"),
        };
        Weight { rows, cols, data: WeightData::OpenCl(b, dtype) }
    }

    fn check_alloc(&self, bytes: usize) -> Result<(), String> {
        if bytes as u64 > self.caps.max_alloc {
            return Err(format!("{}: a buffer of {bytes} bytes is larger than the device's largest allocation ({} bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE)", self.name, self.caps.max_alloc));
        }
        Ok(())
    }

    fn check_head_dim(&self, head_dim: usize) -> Result<(), String> {
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {head_dim} is not supported on {} (even, at most {MAX_HEAD_DIM})", self.name));
        }
        Ok(())
    }

    /// A GPU's memory less what this device allocated (OpenCL reports no free memory); `None`
    /// for a CPU runtime, whose memory is the host's.
    fn memory_info(&self) -> Option<(usize, usize)> {
        if self.caps.is_cpu || !self.caps.is_gpu {
            return None;
        }
        let total = self.caps.global_mem as usize;
        Some((total.saturating_sub(self.allocated.load(std::sync::atomic::Ordering::Relaxed)), total))
    }

    fn wait(&self) {
        self.finish().unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn stats(&self) -> Option<String> {
        Some(format!("{}: {}", self.name, self.set.describe()))
    }

    fn stage_batch(&self, ids: &[u32], batch: &AttnBatch<'_>, logits_rows: &[u32], extra: &[&[u32]]) {
        let mut st = self.state.lock().unwrap();
        self.stage(&mut st, ids, batch, logits_rows, extra);
    }

    fn matmul(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        self.matmul_impl(x, m, w, bias, y)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) {
        if ids.is_empty() {
            return;
        }
        let WeightData::OpenCl(tb, dtype) = &table.data else { panic!("OpenCL embedding given a table of another device") };
        let name = if *dtype == DType::Bf16 { "embedding_bf16" } else { "embedding_f32" };
        let mut st = self.state.lock().unwrap();
        let (mb, off) = self.meta_ref(&mut st, ids);
        let dim = table.cols;
        self.launch(name, &[dim, ids.len()], None, &[Arg::Mem(tb.mem()), Arg::Mem(mb), Arg::I32(off), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::I32(ids.len() as i32)]);
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        if rows == 0 {
            return;
        }
        self.launch("rms_norm", &[rows * ROW_WG], Some(&[ROW_WG]), &[Arg::Mem(mem(x)), Arg::Mem(mem(w)), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::F32(eps)]);
    }

    fn add_rms_norm(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        if rows == 0 {
            return;
        }
        self.launch("add_rms_norm", &[rows * ROW_WG], Some(&[ROW_WG]), &[Arg::Mem(mem(resid)), Arg::Mem(mem(delta)), Arg::Mem(mem(w)), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::F32(eps)]);
    }

    fn add_inplace(&self, resid: &mut Tensor, delta: &Tensor, len: usize) {
        if len == 0 {
            return;
        }
        self.launch("add_inplace", &[len], None, &[Arg::Mem(mem(resid)), Arg::Mem(mem(delta)), Arg::I32(len as i32)]);
    }

    fn rope_qk(&self, qkv: &mut Tensor, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, t: &RopeTable) {
        if rows == 0 {
            return;
        }
        let half = t.rotary_dim / 2;
        let heads_qk = n_heads + n_kv_heads;
        let width = (n_heads + 2 * n_kv_heads) * t.head_dim;
        let mut st = self.state.lock().unwrap();
        let (mb, off) = self.meta_ref(&mut st, &positions[..rows]);
        self.launch(
            "rope_qk",
            &[heads_qk * half, rows],
            None,
            &[
                Arg::Mem(mem(qkv)),
                Arg::Mem(mb),
                Arg::I32(off),
                Arg::Mem(mem(&t.cos)),
                Arg::Mem(mem(&t.sin)),
                Arg::I32(heads_qk as i32),
                Arg::I32(t.head_dim as i32),
                Arg::I32(half as i32),
                Arg::I32(width as i32),
                Arg::I32(t.max_pos as i32),
                Arg::I32(rows as i32),
            ],
        );
    }

    fn silu_mul(&self, gate_up: &Tensor, rows: usize, inter: usize, out: &mut Tensor) {
        if rows == 0 {
            return;
        }
        self.launch("silu_mul", &[inter, rows], None, &[Arg::Mem(mem(gate_up)), Arg::Mem(mem(out)), Arg::I32(inter as i32), Arg::I32(rows as i32)]);
    }

    fn paged_attention(&self, qkv: &Tensor, batch: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        self.attention_impl(qkv, batch, kv, layer, n_heads, scale, out)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor) {
        if rows.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap();
        let (mb, off) = self.meta_ref(&mut st, rows);
        self.launch("gather_rows", &[dim, rows.len()], None, &[Arg::Mem(mem(x)), Arg::Mem(mb), Arg::I32(off), Arg::Mem(mem(out)), Arg::I32(dim as i32), Arg::I32(rows.len() as i32)]);
    }

    fn lora_alloc_site(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        self.lora_alloc_site_impl(shape)
    }

    fn lora_alloc_table(&self, entries: usize, slots: usize) -> LoraTable {
        self.lora_alloc_table_impl(entries, slots)
    }

    fn lora_write_slot(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        self.lora_write_slot_impl(buf, slot, fill)
    }

    fn lora_sync_table(&self, table: &mut LoraTable) {
        self.lora_sync_table_impl(table)
    }

    fn lora_tile_rows(&self) -> usize {
        lora::TILE_ROWS
    }

    fn lora_experts_supported(&self, _slots: usize, _experts: usize) -> Result<(), String> {
        Err("not on OpenCL yet (the routing stays on the device and no OpenCL kernel groups the routed rows by adapter and expert; the CPU and CUDA devices run it)".into())
    }

    fn lora_apply(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        self.lora_apply_impl(call, x, y)
    }

    fn qk_norm(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
        self.qk_norm_impl(qkv, rows, n_heads, n_kv_heads, head_dim, norm)
    }

    fn load_experts(&self, rows: usize, cols: usize, experts: Vec<Weight>) -> ExpertWeights {
        self.load_experts_impl(rows, cols, experts)
    }

    fn alloc_routing(&self, max_rows: usize, spec: RouterSpec) -> MoeRouting {
        self.alloc_routing_impl(max_rows, spec)
    }

    fn moe_route(&self, logits: &Tensor, m: usize, route: &mut MoeRouting) {
        self.route_impl(logits, m, route)
    }

    fn moe_gather(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
        self.gather_impl(x, dim, route, out)
    }

    fn moe_matmul(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
        self.grouped_matmul_impl(x, route, w, y)
    }

    fn moe_combine(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
        self.combine_impl(y, route, dim, out)
    }

    fn add_sigmoid_gated(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
        self.add_sigmoid_gated_impl(out, x, gate, rows, dim)
    }
}

impl Drop for OpenClDevice {
    fn drop(&mut self) {
        let _ = self.queue.finish();
    }
}
