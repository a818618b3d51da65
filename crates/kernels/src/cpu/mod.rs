//! CPU implementation of the device ops: our own weight GEMM on packed panels (panel.rs), the
//! dot-product tiles LoRA and attention share (dot.rs), hand-written loops elsewhere,
//! threads through rayon. Scratch space comes from thread-local buffers that only grow, so a
//! steady-state decode step allocates nothing.

pub mod amx;
mod attention;
mod dot;
mod lora;
pub mod lora_tiles;
mod moe;
pub mod panel;
pub mod simd;

use crate::{AttnBatch, Device, DeviceKind, ExpertWeights, KvStorage, LoraCall, LoraX, MoeRouting, QkNorm, RopeTable, Tensor, Weight, WeightData};
use rayon::prelude::*;
use std::sync::Arc;


/// A raw pointer that parallel tasks may share: each task touches only its own part of the
/// buffer behind it (the callers' safety arguments say which).
#[derive(Clone, Copy)]
struct SyncPtr<T>(*const T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

/// Which GEMM the CPU device uses for weights, for benchmark reports.
pub fn gemm_kind() -> &'static str {
    if amx::enabled() { "amx bf16x3 tiles" } else { "f32 fma" }
}

/// The CPU device. Every op works on the buffers it is given; the one state kept between calls
/// is the last draw (`Device::sample_launch`), which the next step's ids may name.
#[derive(Default)]
pub struct CpuDevice {
    lora_images: bool,
    draws: crate::sample::HostDraws,
    /// Runs each step on the calling thread (the device of a tensor-parallel group's ranks,
    /// whose threads wait in collectives: on rayon workers, more ranks than workers would
    /// deadlock).
    steps_on_caller: bool,
}

impl CpuDevice {
    pub fn new() -> Self {
        CpuDevice::default()
    }
    /// A CPU device that also makes LoRA adapter images (`Device::lora_image`: the pool's f32
    /// slot contents, copied into a slot on activation), which a host-memory pool does not
    /// need; it runs the pool's image path where a test can compare it with the direct one.
    pub fn with_lora_images() -> Self {
        CpuDevice { lora_images: true, ..Default::default() }
    }
}

/// Rows per rayon task for row-wise elementwise ops: big enough to amortize scheduling.
const ROW_CHUNK: usize = 8;

/// Below this many elements a row-wise op runs on the calling thread: handing it to the pool
/// and waking the caller back (~6 µs here) costs more than the op, and a decode step issues
/// hundreds of them (all of a layer's small ops at 1–64 rows).
const PAR_MIN_ELEMS: usize = 1 << 16;

/// `f(row index, out row)` for every `row`-long row of `out`, in parallel only when the op is
/// big enough to pay for it.
fn for_rows(out: &mut [f32], row: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    for_rows_if(out.len() >= PAR_MIN_ELEMS, out, row, f)
}

/// `for_rows` with the choice made by the caller (`work` is not always the output size).
fn for_rows_if(parallel: bool, out: &mut [f32], row: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if !parallel {
        out.chunks_mut(row).enumerate().for_each(|(i, o)| f(i, o));
    } else {
        out.par_chunks_mut(row * ROW_CHUNK).enumerate().for_each(|(c, o)| {
            for (i, orow) in o.chunks_mut(row).enumerate() {
                f(c * ROW_CHUNK + i, orow);
            }
        });
    }
}

/// `for_rows` over two buffers with rows in step: `f(i, a row i, b row i)`.
fn for_rows2(a: &mut [f32], arow: usize, b: &mut [f32], brow: usize, f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync + Send) {
    if a.len() < PAR_MIN_ELEMS {
        a.chunks_mut(arow).zip(b.chunks_mut(brow)).enumerate().for_each(|(i, (x, y))| f(i, x, y));
    } else {
        a.par_chunks_mut(arow * ROW_CHUNK).zip(b.par_chunks_mut(brow * ROW_CHUNK)).enumerate().for_each(|(c, (x, y))| {
            for (i, (xr, yr)) in x.chunks_mut(arow).zip(y.chunks_mut(brow)).enumerate() {
                f(c * ROW_CHUNK + i, xr, yr);
            }
        });
    }
}

fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (xv * inv) * wv;
    }
}

impl Device for CpuDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn host_draws(&self) -> Option<&crate::sample::HostDraws> {
        Some(&self.draws)
    }

    /// The step runs on a worker of the rayon pool, so each parallel op inside it is a join
    /// between workers (the other one steals half) instead of a job injected from outside that
    /// the calling thread sleeps on: two futex round trips per op on the critical path, a few
    /// hundred ops per step.
    fn run_step(&self, _rows: usize, _shape: Option<u64>, body: &mut dyn FnMut()) {
        if self.steps_on_caller || rayon::current_thread_index().is_some() {
            return body();
        }
        struct Body<'a, 'b>(&'a mut (dyn FnMut() + 'b));
        // SAFETY: the caller blocks in `join` until the body has run, so the body is only ever
        // used by one thread at a time, as if the caller had run it; nothing in a forward pass
        // is tied to the thread that issued it.
        unsafe impl Send for Body<'_, '_> {}
        let b = Body(body);
        rayon::join(
            move || {
                let b = b;
                (b.0)()
            },
            || (),
        );
    }

    fn alloc(&self, len: usize) -> Tensor {
        Tensor::zeros_cpu(len)
    }

    /// Ranks simulated as threads of this process: one device shared by every rank (so each
    /// finds the last draws wherever its ids name them), running steps on the rank's thread,
    /// and the in-process collectives.
    fn tensor_parallel_group(&self, ranks: usize) -> Result<Vec<(Arc<dyn Device>, Arc<dyn crate::Collective>)>, String> {
        if !(1..=crate::comm::MAX_HOST_RANKS).contains(&ranks) {
            return Err(format!("{ranks} ranks: the CPU simulates 1 to {}", crate::comm::MAX_HOST_RANKS));
        }
        let device: Arc<dyn Device> = Arc::new(CpuDevice { lora_images: self.lora_images, steps_on_caller: true, ..Default::default() });
        Ok(crate::comm::host_group(ranks).into_iter().map(|c| (device.clone(), c)).collect())
    }

    fn embedding_vocab_range(&self, table: &Weight, ids: &[u32], start: usize, out: &mut Tensor) {
        let h = table.cols;
        let out = &mut out.as_cpu_mut()[..ids.len() * h];
        for_rows(out, h, |i, row| match (ids[i] as usize).checked_sub(start).filter(|&r| r < table.rows) {
            Some(r) => table.row_f32(r, row),
            None => row.fill(0.0),
        });
    }

    fn lora_apply(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        lora::apply(call, x, y.as_cpu_mut());
    }

    fn lora_image(&self, elems: usize) -> Option<crate::LoraImage> {
        self.lora_images.then(|| crate::LoraImage { elems, filled: false, layout: 0, data: Box::new(vec![0.0f32; elems]) })
    }

    fn lora_image_fill(&self, image: &mut crate::LoraImage, offset: usize, shape: crate::LoraSiteShape, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        let (al, bl) = (shape.a_slot_len(), shape.b_slot_len());
        let v = image.data.downcast_mut::<Vec<f32>>().expect("a CPU LoRA image");
        let (a, b) = v[offset..offset + al + bl].split_at_mut(al);
        a.fill(0.0);
        b.fill(0.0);
        fill(a, b);
    }

    fn lora_write_slot_image(&self, buf: &mut crate::LoraSiteBuffers, slot: usize, image: &crate::LoraImage, offset: usize) {
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        let v = image.data.downcast_ref::<Vec<f32>>().expect("a CPU LoRA image");
        buf.a.host_mut()[slot * al..(slot + 1) * al].copy_from_slice(&v[offset..offset + al]);
        buf.b.host_mut()[slot * bl..(slot + 1) * bl].copy_from_slice(&v[offset + al..offset + al + bl]);
    }

    /// Weights are repacked once here for the GEMM that runs them at every M: column panels
    /// (see `panel`), or AMX tiles when that mode is on (see `amx`).
    fn load_weight(&self, w: Weight) -> Weight {
        let amx = amx::enabled();
        let data = match &w.data {
            WeightData::F32(v) if amx => WeightData::Tiled(amx::TiledWeight::from_f32(w.rows, w.cols, v)),
            WeightData::Bf16(v) if amx => WeightData::Tiled(amx::TiledWeight::from_bf16(w.rows, w.cols, v)),
            WeightData::F32(v) => WeightData::Panels(panel::PanelWeight::from_f32(w.rows, w.cols, v)),
            WeightData::Bf16(v) => WeightData::Panels(panel::PanelWeight::from_bf16(w.rows, w.cols, v)),
            _ => return w,
        };
        Weight { data, ..w }
    }

    fn to_host(&self, t: &Tensor, len: usize, out: &mut [f32]) {
        out[..len].copy_from_slice(&t.as_cpu()[..len]);
    }

    fn upload(&self, data: &[f32], t: &mut Tensor) {
        t.as_cpu_mut()[..data.len()].copy_from_slice(data);
    }

    fn sample(&self, logits: &Tensor, vocab: usize, specs: &[crate::sample::SampleSpec], out: &mut [crate::sample::SampleOut]) {
        use rayon::prelude::*;
        // Rows are independent (each draw depends only on its own row and spec), so they are
        // drawn in parallel; the scratch is per worker thread and reused.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<(f32, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let l = logits.as_cpu();
        specs.par_iter().zip(out.par_iter_mut()).for_each(|(s, o)| {
            SCRATCH.with(|sc| crate::sample::sample_rows_host(l, vocab, std::slice::from_ref(s), std::slice::from_mut(o), &mut sc.borrow_mut()));
        });
    }

    fn matmul(&self, x: &Tensor, m: usize, w: &Weight, bias: Option<&Tensor>, y: &mut Tensor) {
        let (k, n) = (w.cols, w.rows);
        let x = &x.as_cpu()[..m * k];
        let y = &mut y.as_cpu_mut()[..m * n];
        match &w.data {
            WeightData::F32(_) | WeightData::Bf16(_) => panic!("CPU matmul given a weight not loaded through Device::load_weight"),
            WeightData::Tiled(t) => amx::matmul(x, m, t, y),
            WeightData::Panels(p) => panel::matmul(x, m, p, y),
            #[cfg(feature = "cuda")]
            WeightData::Cuda(..) => panic!("CPU matmul given a weight in CUDA memory"),
            WeightData::OpenCl(..) => panic!("CPU matmul given a weight in OpenCL memory"),
        }
        if let Some(b) = bias {
            let b = b.as_cpu();
            for_rows(y, n, |_, row| {
                for (o, &bv) in row.iter_mut().zip(b) {
                    *o += bv;
                }
            });
        }
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) {
        let h = table.cols;
        let out = &mut out.as_cpu_mut()[..ids.len() * h];
        for_rows(out, h, |i, row| table.row_f32(ids[i] as usize, row));
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        let x = &x.as_cpu()[..rows * dim];
        let w = &w.as_cpu()[..dim];
        let out = &mut out.as_cpu_mut()[..rows * dim];
        for_rows(out, dim, |i, orow| rms_norm_row(&x[i * dim..(i + 1) * dim], w, eps, orow));
    }

    fn add_rms_norm(&self, resid: &mut Tensor, delta: &Tensor, w: &Tensor, eps: f32, rows: usize, dim: usize, out: &mut Tensor) {
        let w = &w.as_cpu()[..dim];
        let r = &mut resid.as_cpu_mut()[..rows * dim];
        let d = &delta.as_cpu()[..rows * dim];
        let out = &mut out.as_cpu_mut()[..rows * dim];
        for_rows2(out, dim, r, dim, |i, orow, rrow| {
            for (a, b) in rrow.iter_mut().zip(&d[i * dim..(i + 1) * dim]) {
                *a += b;
            }
            rms_norm_row(rrow, w, eps, orow);
        });
    }

    fn add_inplace(&self, resid: &mut Tensor, delta: &Tensor, len: usize) {
        let r = &mut resid.as_cpu_mut()[..len];
        let d = &delta.as_cpu()[..len];
        for_rows(r, 4096, |i, a| {
            for (x, y) in a.iter_mut().zip(&d[i * 4096..]) {
                *x += y;
            }
        });
    }

    fn rope_qk(&self, qkv: &mut Tensor, rows: usize, positions: &[u32], n_heads: usize, n_kv_heads: usize, t: &RopeTable) {
        let hd = t.head_dim;
        let width = (n_heads + 2 * n_kv_heads) * hd;
        let half = t.rotary_dim / 2;
        let qkv = &mut qkv.as_cpu_mut()[..rows * width];
        let (cos_t, sin_t) = (t.cos.as_cpu(), t.sin.as_cpu());
        for_rows(qkv, width, |i, row| {
            let pos = (positions[i] as usize).min(t.max_pos - 1);
            let cos = &cos_t[pos * half..(pos + 1) * half];
            let sin = &sin_t[pos * half..(pos + 1) * half];
            // q heads then k heads are contiguous at the start of the fused row.
            for head in row[..(n_heads + n_kv_heads) * hd].chunks_mut(hd) {
                let (a, b) = head[..t.rotary_dim].split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * cos[i] - x1 * sin[i];
                    b[i] = x1 * cos[i] + x0 * sin[i];
                }
            }
        });
    }

    fn silu_mul(&self, gate_up: &Tensor, rows: usize, inter: usize, out: &mut Tensor) {
        let gu = &gate_up.as_cpu()[..rows * 2 * inter];
        let out = &mut out.as_cpu_mut()[..rows * inter];
        for_rows(out, inter, |i, o| {
            let (gate, up) = gu[i * 2 * inter..(i + 1) * 2 * inter].split_at(inter);
            simd::silu_mul(gate, up, o);
        });
    }

    fn paged_attention(&self, qkv: &Tensor, batch: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
        attention::paged_attention(qkv, batch, kv, layer, n_heads, scale, out)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], dim: usize, out: &mut Tensor) {
        let x = x.as_cpu();
        let out = &mut out.as_cpu_mut()[..rows.len() * dim];
        for (o, &r) in out.chunks_mut(dim).zip(rows) {
            o.copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]);
        }
    }

    fn qk_norm(&self, qkv: &mut Tensor, rows: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, norm: &QkNorm) {
        moe::qk_norm(qkv, rows, n_heads, n_kv_heads, head_dim, norm)
    }

    fn moe_route(&self, logits: &Tensor, m: usize, route: &mut MoeRouting) {
        moe::route(logits, m, route)
    }

    fn moe_gather(&self, x: &Tensor, dim: usize, route: &MoeRouting, out: &mut Tensor) {
        moe::gather(x, dim, route, out)
    }

    fn moe_matmul(&self, x: &Tensor, route: &MoeRouting, w: &ExpertWeights, y: &mut Tensor) {
        moe::matmul(x, route, w, y)
    }

    fn moe_combine(&self, y: &Tensor, route: &MoeRouting, dim: usize, out: &mut Tensor) {
        moe::combine(y, route, dim, out)
    }

    fn add_sigmoid_gated(&self, out: &mut Tensor, x: &Tensor, gate: &Tensor, rows: usize, dim: usize) {
        moe::add_sigmoid_gated(out, x, gate, rows, dim)
    }
}
