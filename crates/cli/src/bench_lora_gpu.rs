//! The kernel half of `quiver bench lora --device cuda`: the LoRA kernels alone for a whole
//! step of a Llama-3.1-8B-shaped model (4 sites × 32 layers, distinct weights per layer, all
//! seven projections targeted), the way the peers' kernels were measured on the same GPU
//! (`REFERENCE.md` §6.4): `T` rows spread round-robin over `D` distinct adapters, a decode step
//! recorded once as a CUDA graph and replayed, or a prefill segment per adapter run eagerly.
//! Reports µs per step and per site, the adapter bytes the kernels must read (each distinct
//! adapter's A and Bᵀ once, bf16) as GB/s and as a fraction of the device copy bandwidth
//! measured in the same run.
//!
//! The pool is filled directly (one synthetic adapter per rank copied into every slot: the
//! slots' memory is distinct, which is all the kernels see), so a 64-slot rank-64 grid needs no
//! adapter files.

use crate::bench_generate::median;
use anyhow::Result;
use quiver_kernels::cuda::CudaDevice;
use quiver_kernels::{AttnBatch, Device, Tensor};
use quiver_lora::backend::create_backend;
use quiver_lora::batch::LoraBatchInfo;
use quiver_lora::mem_pool::LoraMemoryPool;
use quiver_lora::{EvictionPolicy, LinearSite, LoraAdapter, LoraModelDims, LoraModule, SiteRef};
use std::sync::Arc;
use std::time::Instant;

pub struct GpuKernelArgs<'a> {
    pub ordinal: usize,
    pub rows: &'a [usize],
    pub adapters: &'a [usize],
    pub ranks: &'a [usize],
    pub backends: &'a [String],
    pub reps: usize,
    pub layers: usize,
}

/// Llama-3.1-8B's projection shapes.
fn dims(layers: usize) -> LoraModelDims {
    LoraModelDims { num_layers: layers, hidden: 4096, q_out: 4096, kv_out: 1024, intermediate: 14336, vocab: 128256, moe: None }
}

/// Device copy bandwidth, bytes read + written per second, over 1 GiB.
fn copy_gbps(dev: &CudaDevice) -> Result<f64> {
    let n = 1 << 28;
    let src = dev.tensor_from(&vec![1.0f32; n]);
    let mut dst = dev.alloc(n);
    let ms = dev.time_ms(20, &mut || dev.copy(&src, &mut dst, n))?;
    Ok(2.0 * (n * 4) as f64 / (ms / 1e3) / 1e9)
}

pub fn run(a: &GpuKernelArgs<'_>) -> Result<Vec<serde_json::Value>> {
    let cuda = Arc::new(CudaDevice::new(a.ordinal)?);
    let copy = copy_gbps(&cuda)?;
    let dev: Arc<dyn Device> = cuda.clone();
    let d = dims(a.layers);
    println!("\n== LoRA kernels on {}: {} layers × 4 sites of the Llama-3.1-8B shape, all 7 projections ==", cuda.name(), a.layers);
    println!("device copy {copy:.0} GB/s (read + write, this run)");
    println!("{:<8} {:>4} {:>4} {:>5} {:<10} {:>11} {:>9} {:>10} {:>8} {:>7}", "layout", "rank", "ads", "rows", "backend", "µs/step", "µs/site", "adapter MB", "GB/s", "%copy");
    let mut out = Vec::new();
    let max_ads = a.adapters.iter().copied().max().unwrap_or(1).max(1);
    for &rank in a.ranks {
        let adapter = LoraAdapter::synthetic("bench", &d, &LoraModule::PROJECTIONS, rank, 2.0 * rank as f32, 0.01, 11 + rank as u64)?;
        let mut pool = LoraMemoryPool::new(dev.clone(), d, max_ads, rank, &LoraModule::PROJECTIONS, EvictionPolicy::Lru)?;
        // Activation: the host's share (queuing) and the whole (until the copies land).
        let per_adapter = pool.size_bytes() as f64 / max_ads as f64;
        let times = crate::bench_lora::activation_times(&mut pool, &adapter, max_ads.max(4), &*dev)?;
        let again: Vec<(f64, f64)> = times[1..].to_vec();
        let med = |f: &dyn Fn(&(f64, f64)) -> f64| {
            let mut v: Vec<f64> = again.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "rank {rank}: adapter of {:.1} MB activated in {:.2} ms the first time (its image made), then {:.2} ms (median of {}; host {:.2} ms of it)",
            per_adapter / 1e6,
            times[0].1,
            med(&|t| t.1),
            again.len(),
            med(&|t| t.0)
        );
        out.push(serde_json::json!({"kind": "activation", "rank": rank, "adapter_mb": per_adapter / 1e6, "first_ms": times[0].1, "again_ms": med(&|t| t.1), "again_host_ms": med(&|t| t.0)}));
        for backend in a.backends {
            let be = create_backend(backend, dev.kind()).map_err(anyhow::Error::msg)?;
            for &ads in a.adapters {
                for &rows in a.rows {
                    if ads > rows {
                        continue;
                    }
                    for layout in ["decode", "prefill"] {
                        // Prefill: one contiguous segment per adapter (at least 16 rows each).
                        if layout == "prefill" && rows < 16 * ads {
                            continue;
                        }
                        let (slots, starts): (Vec<Option<u32>>, Vec<u32>) = if layout == "decode" {
                            ((0..rows).map(|i| Some((i % ads) as u32)).collect(), (0..=rows as u32).collect())
                        } else {
                            ((0..ads).map(|i| Some(i as u32)).collect(), (0..=ads).map(|i| (i * rows / ads) as u32).collect())
                        };
                        let logits: Vec<u32> = starts[1..].iter().map(|&e| e - 1).collect();
                        let mut info = LoraBatchInfo::with_capacity(max_ads, rows, 16, dev.lora_tile_rows());
                        info.build(&slots, &starts, &logits, |_| rank as u32)?;
                        let nseq = starts.len() - 1;
                        let (positions, ctx, tables) = (vec![0u32; rows], vec![1u32; nseq], vec![0u32; nseq]);
                        let attn = AttnBatch { seq_starts: &starts, positions: &positions, ctx_lens: &ctx, block_tables: &tables, block_table_stride: 1 };
                        let ids = vec![0u32; rows];
                        let (t, l) = (&info.tokens, &info.logits);
                        let staged: [&[u32]; 4] = [&t.packed_segments, &t.packed_chunks, &l.packed_segments, &l.packed_chunks];
                        // One input and one output per site shape, shared by the layers (as the
                        // model's workspace is); the adapters' weights differ per layer.
                        let mut bufs: Vec<(LinearSite, Tensor, Tensor)> = LinearSite::ALL
                            .iter()
                            .map(|&s| {
                                let (din, w, n) = d.site_dims(s);
                                let x: Vec<f32> = (0..rows * din).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.01).collect();
                                (s, dev.tensor_from(&x), dev.alloc(rows * w[..n].iter().sum::<usize>()))
                            })
                            .collect();
                        let mut body = || {
                            for layer in 0..d.num_layers {
                                for (s, x, y) in bufs.iter_mut() {
                                    let (buffers, entry) = pool.site(layer, *s).expect("every projection is targeted");
                                    be.apply(&*dev, SiteRef { buffers, table: pool.table(), entry }, &info.tokens, quiver_kernels::LoraX::Dense(x), y);
                                }
                            }
                        };
                        dev.stage_batch(&ids, &attn, &logits, &staged);
                        // Decode steps are recorded on first use and replayed (CUDA graph).
                        let key = Some(0x1a2b ^ rows as u64 ^ ((ads as u64) << 20) ^ ((rank as u64) << 40));
                        let mut time_once = || {
                            let t0 = Instant::now();
                            dev.run_step(rows, key, &mut body);
                            dev.wait();
                            t0.elapsed().as_secs_f64()
                        };
                        time_once();
                        time_once();
                        let secs = median((0..a.reps.max(1)).map(|_| time_once()).collect());
                        let sites = 4 * d.num_layers;
                        let distinct = ads.min(rows) as f64;
                        let bytes = distinct * per_adapter;
                        let gbps = bytes / secs / 1e9;
                        println!(
                            "{:<8} {:>4} {:>4} {:>5} {:<10} {:>11.1} {:>9.2} {:>10.1} {:>8.0} {:>6.1}%",
                            layout, rank, ads, rows, backend, secs * 1e6, secs * 1e6 / sites as f64, bytes / 1e6, gbps, 100.0 * gbps / copy
                        );
                        out.push(serde_json::json!({"device": cuda.name(), "layout": layout, "rank": rank, "adapters": ads, "rows": rows, "backend": backend,
                            "us_per_step": secs * 1e6, "us_per_site": secs * 1e6 / sites as f64, "adapter_bytes": bytes, "gbps": gbps, "copy_gbps": copy}));
                    }
                }
            }
        }
    }
    if let Some(s) = dev.stats() {
        println!("{s}");
    }
    Ok(out)
}
