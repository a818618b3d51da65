//! The kernel half of `quiver bench lora`: shrink + expand of one layer's four LoRA sites (qkv,
//! o, gate_up, down; all seven projections targeted) through the production hook, per backend,
//! over rows × distinct adapters × ranks, on SmolLM2- and Llama-3.1-8B-shaped layers. Reports
//! GFLOP/s and GB/s next to this machine's GEMM peak and memory bandwidth, measured in the same
//! run, so the numbers read as fractions of what the CPU can do.

use crate::bench_generate::median;
use anyhow::Result;
use quiver_engine::testing::{temp_dir, write_random_adapter};
use quiver_kernels::{open_device, DType, Device, DeviceKind, Weight};
use quiver_lora::{AdapterKey, LinearSite, LoraConfig, LoraHook, LoraManager, LoraModelDims, LoraModule};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

/// A layer shape to time (one layer: the kernels' cost is per layer).
pub struct Shape {
    pub name: &'static str,
    pub dims: LoraModelDims,
}

pub fn shape(name: &str) -> Result<Shape> {
    let d = |hidden, q_out, kv_out, intermediate| LoraModelDims { num_layers: 1, hidden, q_out, kv_out, intermediate, vocab: 1024, moe: None };
    Ok(match name {
        "smollm2" => Shape { name: "smollm2", dims: d(576, 576, 192, 1536) },
        "llama8b" => Shape { name: "llama8b", dims: d(4096, 4096, 1024, 14336) },
        _ => anyhow::bail!("unknown LoRA kernel shape `{name}` (smollm2, llama8b)"),
    })
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn median_s(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps.max(1))
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Read bandwidth (GB/s, all threads over a buffer far larger than the caches) and f32 GEMM
/// throughput (GFLOP/s, the CPU device's own matmul at a prefill-like shape).
pub fn machine_peaks(dev: &dyn Device) -> (f64, f64) {
    let big: Vec<f32> = (0..64 << 20).map(|i| (i % 7) as f32).collect();
    let bw_s = median_s(5, || {
        let s: f32 = big.par_chunks(1 << 16).map(|c| quiver_kernels::cpu::simd::dot(c, c)).sum();
        std::hint::black_box(s);
    });
    let bw = (big.len() * 4) as f64 / bw_s / 1e9;
    let (m, k, n) = (256, 2048, 2048);
    let x = dev.tensor_from(&(0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect::<Vec<_>>());
    let w = dev.load_weight(Weight::from_f32(n, k, (0..n * k).map(|i| ((i % 11) as f32 - 5.0) * 0.01).collect(), DType::F32));
    let mut y = dev.alloc(m * n);
    let g_s = median_s(5, || dev.matmul(&x, m, &w, None, &mut y));
    (bw, 2.0 * (m * k * n) as f64 / g_s / 1e9)
}

pub struct KernelArgs<'a> {
    pub shapes: &'a [String],
    pub rows: &'a [usize],
    pub adapters: &'a [usize],
    pub ranks: &'a [usize],
    pub backends: &'a [String],
    pub reps: usize,
}

pub fn run(a: &KernelArgs<'_>) -> Result<Vec<serde_json::Value>> {
    let dev = open_device(DeviceKind::Cpu)?;
    let (bw, peak) = machine_peaks(dev.as_ref());
    println!("\n== LoRA kernels: one layer, 4 sites (7 projections), shrink + expand through the hook ==");
    println!("machine: read bandwidth {bw:.1} GB/s, f32 GEMM {peak:.0} GFLOP/s (this run), {} threads", rayon::current_num_threads());
    println!("{:<8} {:<8} {:>4} {:>4} {:>5} {:<10} {:>10} {:>9} {:>7} {:>8} {:>6}", "shape", "layout", "rank", "ads", "rows", "backend", "µs/layer", "GFLOP/s", "%peak", "GB/s", "%bw");
    let dir = temp_dir("bench-lora-kernels");
    let mut out = Vec::new();
    for sname in a.shapes {
        let sh = shape(sname)?;
        let dims = sh.dims;
        let max_ads = a.adapters.iter().copied().max().unwrap_or(1).max(1);
        for &rank in a.ranks {
            let paths: Vec<PathBuf> = (0..max_ads)
                .map(|i| {
                    let p = dir.join(format!("{}-r{rank}-{i}", sh.name));
                    write_random_adapter(&p, &dims, &LoraModule::PROJECTIONS, rank, 2.0 * rank as f32, 0.01, 7000 + i as u64)?;
                    Ok(p)
                })
                .collect::<Result<_>>()?;
            for backend in a.backends {
                let cfg = LoraConfig { max_loras_per_batch: max_ads, max_lora_rank: rank, max_loaded_loras: max_ads, backend: backend.clone(), ..Default::default() };
                let mut mgr = LoraManager::new(dims, cfg, quiver_kernels::open_device(DeviceKind::Cpu)?)?;
                let keys: Vec<AdapterKey> = paths.iter().enumerate().map(|(i, p)| mgr.load_adapter(&format!("a{i}"), p)).collect::<Result<_, _>>()?;
                for &ads in a.adapters {
                    for &rows in a.rows {
                        if ads > rows {
                            continue;
                        }
                        for layout in ["decode", "prefill"] {
                            if layout == "prefill" && rows < 16 {
                                continue;
                            }
                            // decode: one row per sequence, adapters interleaved (the chunked
                            // case); prefill: one sequence per adapter, contiguous rows.
                            let (seq, starts): (Vec<Option<AdapterKey>>, Vec<u32>) = if layout == "decode" {
                                ((0..rows).map(|i| Some(keys[i % ads])).collect(), (0..=rows as u32).collect())
                            } else {
                                ((0..ads).map(|i| Some(keys[i])).collect(), (0..=ads).map(|i| (i * rows / ads) as u32).collect())
                            };
                            let logits: Vec<u32> = starts[1..].iter().map(|&e| e - 1).collect();
                            let hook = mgr.prepare_batch(&seq, &starts, &logits)?;
                            let mut sites: Vec<(LinearSite, quiver_kernels::Tensor, quiver_kernels::Tensor)> = LinearSite::ALL
                                .iter()
                                .map(|&s| {
                                    let (din, w, n) = dims.site_dims(s);
                                    let dout: usize = w[..n].iter().sum();
                                    let x: Vec<f32> = (0..rows * din).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.01).collect();
                                    (s, dev.tensor_from(&x), dev.alloc(rows * dout))
                                })
                                .collect();
                            let t = median_s(a.reps, || {
                                for (s, x, y) in sites.iter_mut() {
                                    hook.linear(dev.as_ref(), 0, *s, x, rows, y);
                                }
                            });
                            // FLOPs of the math itself; bytes of every distinct adapter's A and
                            // B (read once at best) plus the activations read and written.
                            let (mut flops, mut wbytes, mut abytes) = (0f64, 0f64, 0f64);
                            for s in LinearSite::ALL {
                                let (din, w, n) = dims.site_dims(s);
                                let dout: usize = w[..n].iter().sum();
                                flops += 2.0 * (rows * rank * (n * din + dout)) as f64;
                                wbytes += (ads * rank * (n * din + dout) * 4) as f64;
                                abytes += (rows * (din + 2 * dout) * 4) as f64;
                            }
                            let gf = flops / t / 1e9;
                            let gb = (wbytes + abytes) / t / 1e9;
                            println!(
                                "{:<8} {:<8} {:>4} {:>4} {:>5} {:<10} {:>10.1} {:>9.1} {:>6.1}% {:>8.1} {:>5.1}%",
                                sh.name, layout, rank, ads, rows, backend, t * 1e6, gf, 100.0 * gf / peak, gb, 100.0 * gb / bw
                            );
                            out.push(serde_json::json!({"shape": sh.name, "layout": layout, "rank": rank, "adapters": ads, "rows": rows, "backend": backend,
                                "us_per_layer": t * 1e6, "gflops": gf, "gbps": gb, "peak_gflops": peak, "bandwidth_gbps": bw}));
                        }
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}
