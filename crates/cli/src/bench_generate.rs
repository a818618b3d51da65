//! `quiver bench generate`: raw forward-pass throughput of the model on this machine —
//! prefill (ppN), single-stream decode, and batched decode at several batch sizes — so it can be
//! compared with llama.cpp's `llama-bench` on the same weights.

use anyhow::Result;
use clap::Args;
use quiver_kernels::sample::{SampleOut, SampleSpec};
use quiver_kernels::{DType, Device, DeviceKind, Weight};
use quiver_lora::NoLora;
use quiver_model::{ForwardBatch, LlamaModel, LogitsFor};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchGenerateArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub shape: crate::bench_shapes::ShapeArgs,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Decode steps per batch size.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Batch sizes (concurrent sequences) for batched decode.
    /// Tokens already in each sequence's context when the timed decode steps start (a served
    /// 128-in / 128-out request decodes at 128..256).
    #[arg(long, default_value_t = 32)]
    pub decode_context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub batch_sizes: Vec<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

/// Median of the samples (the upper one of an even count); the bench commands' one statistic.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Tokens per second prefilling one `len`-token prompt.
fn prefill_tok_s(m: &LlamaModel, len: usize) -> f64 {
    let bs = 16;
    let nb = len.div_ceil(bs);
    let mut kv = m.alloc_kv(nb, bs);
    let mut ws = m.new_workspace(len, 1);
    let mut b = ForwardBatch::with_capacity(len, 1, nb);
    let toks: Vec<u32> = (0..len).map(|i| (i * 31 % 1000 + 100) as u32).collect();
    let table: Vec<u32> = (0..nb as u32).collect();
    b.push_seq(&toks, 0, &table, LogitsFor::Last);
    let t = Instant::now();
    m.forward(&b, &mut kv, &mut ws, &NoLora);
    len as f64 / t.elapsed().as_secs_f64()
}

/// Decode tokens per second with `n` sequences stepping together after a `prompt`-token prompt
/// each, and the tokens per second of prefilling those `n` prompts in one step.
fn decode_tok_s(m: &LlamaModel, n: usize, steps: usize, prompt_len: usize) -> (f64, f64) {
    let bs = 16;
    let ctx = prompt_len + steps + 1;
    let per = ctx.div_ceil(bs);
    let mut kv = m.alloc_kv(per * n, bs);
    let mut ws = m.new_workspace(prompt_len * n, n);
    let mut b = ForwardBatch::with_capacity(prompt_len * n, n, per);
    let tables: Vec<Vec<u32>> = (0..n).map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect()).collect();
    // Every sequence its own tokens: a mixture-of-experts model then routes the rows of a step
    // to different experts, as real traffic does (identical rows would all hit the same k).
    let span = (m.config.vocab_size - 100).min(20000);
    let token = |s: usize, i: usize| ((i * 31 + s * 7919) % span + 50) as u32;
    for (s, t) in tables.iter().enumerate() {
        let prompt: Vec<u32> = (0..prompt_len).map(|i| token(s, i)).collect();
        b.push_seq(&prompt, 0, t, LogitsFor::Last);
    }
    let t = Instant::now();
    m.forward_on_device(&b, &mut kv, &mut ws, &NoLora);
    m.device.wait();
    let prefill = (n * prompt_len) as f64 / t.elapsed().as_secs_f64();
    // Each step ends as a served one does: a greedy draw per row on the device, only the
    // tokens coming back.
    let specs: Vec<SampleSpec> = (0..n as u32).map(|row| SampleSpec { row, logprobs: -1, ..Default::default() }).collect();
    let mut outs = vec![SampleOut::default(); n];
    let start = Instant::now();
    for step in 0..steps {
        b.clear(per);
        for (s, t) in tables.iter().enumerate() {
            b.push_seq(&[token(s, prompt_len + step)], prompt_len + step, t, LogitsFor::Last);
        }
        m.forward_on_device(&b, &mut kv, &mut ws, &NoLora);
        m.sample(&ws, &specs, &mut outs);
    }
    ((n * steps) as f64 / start.elapsed().as_secs_f64(), prefill)
}

/// What the device itself sustains, measured through its own ops: copy bandwidth (`add_inplace`
/// over 2 × 128 MiB: two reads and a write per element) and GEMM throughput (a 512 × 4096 × 4096
/// matmul in the model's dtype). The rooflines the OpenCL device's numbers are set against.
pub(crate) struct Ceilings {
    pub(crate) copy_gb_s: f64,
    pub(crate) gemm_gflop_s: f64,
}

pub(crate) fn measure_ceilings(dev: &dyn Device, dtype: DType) -> Ceilings {
    let len = 32 << 20;
    let (mut a, b) = (dev.alloc(len), dev.tensor_from(&vec![1.0f32; len]));
    let time = |f: &mut dyn FnMut()| {
        f();
        dev.wait();
        median(
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    dev.wait();
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        )
    };
    let copy_s = time(&mut || dev.add_inplace(&mut a, &b, len));
    let (m, n, k) = (512usize, 4096usize, 4096usize);
    let w = dev.load_weight(Weight::from_f32(n, k, (0..n * k).map(|i| ((i % 251) as f32 - 125.0) * 1e-3).collect(), dtype));
    let (x, mut y) = (dev.tensor_from(&vec![0.5f32; m * k]), dev.alloc(m * n));
    let gemm_s = time(&mut || dev.matmul(&x, m, &w, None, &mut y));
    Ceilings { copy_gb_s: 3.0 * (len * 4) as f64 / copy_s / 1e9, gemm_gflop_s: 2.0 * (m * n * k) as f64 / gemm_s / 1e9 }
}

/// Weight elements one token's forward pass reads (every projection and the LM head; the
/// embedding is a gather).
fn weight_elems(m: &LlamaModel) -> f64 {
    let c = &m.config;
    let (h, q, kv) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    (c.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size) + c.vocab_size * h) as f64
}

pub fn run(a: BenchGenerateArgs) -> Result<()> {
    anyhow::ensure!(a.decode_context >= 1, "--decode-context must be at least 1 (a decode step needs a context)");
    let (lm, label) = a.shape.model_or_file(a.model.clone(), a.device, a.dtype)?;
    let m = &lm.model;
    let threads = rayon::current_num_threads();
    println!("model {label} | dtype {:?} | device {} | {} threads | cpu gemm {}", a.dtype, a.device, threads, quiver_kernels::cpu::gemm_kind());
    // OpenCL devices report their numbers against what the device sustains (issue #23).
    let ceilings = matches!(a.device, DeviceKind::Xpu(_) | DeviceKind::OpenCl(_)).then(|| measure_ceilings(&*m.device, a.dtype));
    if let Some(c) = &ceilings {
        println!("device ceilings: copy {:.1} GB/s (add_inplace), GEMM {:.1} GFLOP/s (512x4096x4096 {:?})", c.copy_gb_s, c.gemm_gflop_s, a.dtype);
    }
    let wbytes = weight_elems(m) * if a.dtype == DType::Bf16 { 2.0 } else { 4.0 };
    // Warm-up: fault in weights and grow scratch buffers.
    let _ = decode_tok_s(m, 1, 4, 32);
    let pp = median((0..a.reps).map(|_| prefill_tok_s(m, a.prompt_len)).collect());
    print!("pp{:<5} {:>10.1} tok/s", a.prompt_len, pp);
    if let Some(c) = &ceilings {
        let gf = 2.0 * weight_elems(m) * pp / 1e9;
        print!("  {gf:.1} GFLOP/s = {:.2} of the GEMM ceiling", gf / c.gemm_gflop_s);
    }
    println!();
    let mut rows = Vec::new();
    for &n in &a.batch_sizes {
        let runs: Vec<(f64, f64)> = (0..a.reps).map(|_| decode_tok_s(m, n, a.decode_steps, a.decode_context)).collect();
        let tg = median(runs.iter().map(|r| r.0).collect());
        // The batch's prompts prefilled in one step (the first rep faults in scratch for them).
        let pf = median(runs.iter().skip((runs.len() > 1) as usize).map(|r| r.1).collect());
        print!("decode batch {:<4} {:>10.1} tok/s  ({:.1} tok/s per sequence; its {n} prompts prefilled at {pf:.0} tok/s)", n, tg, tg / n as f64);
        if let Some(c) = &ceilings {
            // A decode step streams every weight once whatever the batch.
            let gb = wbytes * tg / n as f64 / 1e9;
            print!("  weights {gb:.1} GB/s = {:.2} of copy", gb / c.copy_gb_s);
        }
        println!();
        rows.push(serde_json::json!({"batch": n, "tok_s": tg, "prefill_tok_s": pf, "prompt_len": a.decode_context}));
    }
    if let Some(p) = a.output_json {
        let j = serde_json::json!({
            "model": label,
            "dtype": format!("{:?}", a.dtype), "threads": threads,
            "prefill": {"prompt_len": a.prompt_len, "tok_s": pp},
            "decode": rows,
        });
        std::fs::write(&p, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}
