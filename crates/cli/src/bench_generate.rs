//! `quiver bench generate`: raw forward-pass throughput of the model on this machine —
//! prefill (ppN), single-stream decode, and batched decode at several batch sizes — so it can be
//! compared with llama.cpp's `llama-bench` on the same weights.

use anyhow::Result;
use clap::Args;
use quiver_kernels::sample::{SampleOut, SampleSpec};
use quiver_kernels::{DType, DeviceKind};
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

/// Decode tokens per second with `n` sequences stepping together after a `prompt`-token prompt each.
fn decode_tok_s(m: &LlamaModel, n: usize, steps: usize, prompt_len: usize) -> f64 {
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
    m.forward(&b, &mut kv, &mut ws, &NoLora);
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
    (n * steps) as f64 / start.elapsed().as_secs_f64()
}

pub fn run(a: BenchGenerateArgs) -> Result<()> {
    let (lm, label) = a.shape.model_or_file(a.model.clone(), a.device, a.dtype)?;
    let m = &lm.model;
    let threads = rayon::current_num_threads();
    println!("model {label} | dtype {:?} | device {} | {} threads | cpu gemm {}", a.dtype, a.device, threads, quiver_kernels::cpu::gemm_kind());
    // Warm-up: fault in weights and grow scratch buffers.
    decode_tok_s(m, 1, 4, 32);
    let pp = median((0..a.reps).map(|_| prefill_tok_s(m, a.prompt_len)).collect());
    println!("pp{:<5} {:>10.1} tok/s", a.prompt_len, pp);
    let mut rows = Vec::new();
    for &n in &a.batch_sizes {
        let tg = median((0..a.reps).map(|_| decode_tok_s(m, n, a.decode_steps, a.decode_context)).collect());
        println!("decode batch {:<4} {:>10.1} tok/s  ({:.1} tok/s per sequence)", n, tg, tg / n as f64);
        rows.push(serde_json::json!({"batch": n, "tok_s": tg}));
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
