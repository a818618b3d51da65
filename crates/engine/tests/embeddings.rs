//! Embedding models through the engine (`Task::Embed`) against transformers + PEFT (f32, CPU)
//! and sentence-transformers, on the tiny random models of `scripts/reference_embed.py`: a
//! Qwen3 decoder with last-token pooling, L2 normalisation, an instruction prompt and
//! Matryoshka dimensions, and a Qwen2 decoder with mean pooling and no normalisation, each with
//! and without a PEFT adapter. All inputs of a model, base and adapter mixed, are submitted at
//! once (so they share forward passes) and must equal each input embedded alone, bit for bit.

mod common;

use common::*;
use quiver_engine::{EmbedRequest, Engine, EngineConfig, Task};
use quiver_kernels::DType;
use quiver_model::{EmbeddingSpec, Pooling};
use serde::Deserialize;

const MIN_COS: f64 = 0.99999;
const MAX_ABS: f32 = 1e-4;

#[derive(Deserialize)]
struct EmbedRef {
    cases: Vec<EmbedCase>,
}

#[derive(Deserialize)]
struct EmbedCase {
    name: String,
    #[serde(default)]
    text: String,
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default)]
    ids: Vec<u32>,
    embedding: Vec<f32>,
    #[serde(default)]
    embedding_32: Vec<f32>,
}

fn read(rel: &str) -> EmbedRef {
    let p = require(rel);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn compare(what: &str, got: &[f32], want: &[f32]) -> (f64, f32) {
    assert_eq!(got.len(), want.len(), "{what}: dimensions");
    let dot: f64 = got.iter().zip(want).map(|(&a, &b)| a as f64 * b as f64).sum();
    let n = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let cos = dot / (n(got) * n(want));
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(cos >= MIN_COS && diff <= MAX_ABS, "{what}: cosine {cos:.7} (≥ {MIN_COS}), max |Δ| {diff:.2e} (≤ {MAX_ABS:.0e})");
    (cos, diff)
}

/// `model` and its `adapter` against their transformers and sentence-transformers references.
fn check_model(model: &str, adapter: &str, matryoshka: bool, pooling: Pooling) {
    let path = require(&format!("ref/models/{model}"));
    let lm = load(&path, DType::F32);
    let spec = EmbeddingSpec::for_model(&path, lm.model.config.hidden_size).unwrap();
    assert_eq!(spec.pooling, pooling);
    assert!(spec.fallback.is_none(), "{model} has sentence-transformers pooling files");
    let base = read(&format!("ref/ref/embed-{model}.json"));
    let with = read(&format!("ref/ref/embed-{adapter}.json"));
    let st = [read(&format!("ref/ref/embed-{model}-st.json")), read(&format!("ref/ref/embed-{adapter}-st.json"))];
    // Our tokenizer gives the reference's ids (instruction prompt prefixed, special tokens added).
    for c in &base.cases {
        let text = format!("{}{}", c.prompt_name.as_deref().and_then(|p| spec.prompt(p)).unwrap_or(""), c.text);
        assert_eq!(lm.tokenizer.encode(&text, true).unwrap(), c.ids, "{model} {}: token ids", c.name);
    }
    let h = Engine::start(lm, EngineConfig { kv_cache_memory: Some(32 << 20), task: Task::Embed(spec), ..Default::default() }).unwrap();
    h.load_adapter_blocking("a", &require(&format!("ref/adapters/{adapter}")), false, false, None).unwrap();
    let jobs: Vec<(Option<&str>, &EmbedCase, Option<usize>)> = base
        .cases
        .iter()
        .map(|c| (None, c, None))
        .chain(with.cases.iter().map(|c| (Some("a"), c, None)))
        .chain(matryoshka.then(|| base.cases.iter().map(|c| (None, c, Some(32)))).into_iter().flatten())
        .collect();
    let req = |a: Option<&str>, c: &EmbedCase, d: Option<usize>| EmbedRequest { input: c.ids.clone(), adapter: a.map(str::to_string), dimensions: d, normalize: None };
    // All at once: they share forward passes.
    let streams: Vec<_> = jobs.iter().map(|&(a, c, d)| h.submit_embed(req(a, c, d)).unwrap()).collect();
    let together: Vec<Vec<f32>> = streams.into_iter().map(|s| s.blocking_result().unwrap()).collect();
    let (mut worst_cos, mut worst_abs) = (1.0f64, 0.0f32);
    for (i, (&(a, c, d), got)) in jobs.iter().zip(&together).enumerate() {
        let alone = h.submit_embed(req(a, c, d)).unwrap().blocking_result().unwrap();
        assert!(alone == *got, "{model} {} (adapter {a:?}, dimensions {d:?}): batched differs from alone", c.name);
        let what = format!("{model} {} adapter {a:?} dimensions {d:?}", c.name);
        let want = if d.is_some() { &c.embedding_32 } else { &c.embedding };
        let (cos, abs) = compare(&format!("{what} vs transformers"), got, want);
        if d.is_none() {
            let st_case = &st[a.is_some() as usize].cases[i % base.cases.len()];
            assert_eq!(st_case.name, c.name);
            compare(&format!("{what} vs sentence-transformers"), got, &st_case.embedding);
        }
        worst_cos = worst_cos.min(cos);
        worst_abs = worst_abs.max(abs);
    }
    eprintln!("{model}: {} embeddings, worst cosine {worst_cos:.8}, worst max |Δ| {worst_abs:.2e}", jobs.len());
    h.shutdown_and_join();
}

#[test]
fn last_token_pooled_qwen3_embeddings_with_and_without_adapter_match_transformers() {
    check_model("tiny-qwen3-embed", "tiny-qwen3-embed-r8", true, Pooling::LastToken);
}

#[test]
fn mean_pooled_qwen2_embeddings_with_and_without_adapter_match_transformers() {
    check_model("tiny-qwen2-embed-mean", "tiny-qwen2-embed-mean-r4-rslora", false, Pooling::Mean);
}

#[test]
fn dimensions_without_matryoshka_and_generation_on_an_embedding_engine_are_refused() {
    let path = require("ref/models/tiny-qwen2-embed-mean");
    let lm = load(&path, DType::F32);
    let spec = EmbeddingSpec::for_model(&path, lm.model.config.hidden_size).unwrap();
    let h = Engine::start(lm, EngineConfig { kv_cache_memory: Some(16 << 20), task: Task::Embed(spec), ..Default::default() }).unwrap();
    let e = h.submit_embed(EmbedRequest { input: vec![5, 6, 7], dimensions: Some(32), ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("matryoshka"), "{e}");
    let e = h.submit(quiver_engine::GenerateRequest { prompt: vec![5, 6], ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("embeddings"), "{e}");
    h.shutdown_and_join();
    // A bare decoder has no LM head: generation is refused at start.
    let e = Engine::start(load(&path, DType::F32), EngineConfig { kv_cache_memory: Some(16 << 20), ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("--task embed"), "{e}");
}

/// Mean pooling under KV pressure: small chunks and a pool too small for every input at once,
/// so sequences get preempted mid-input and recomputed; their sums restart and every vector
/// still matches transformers.
#[test]
fn mean_pooling_survives_preemption() {
    let path = require("ref/models/tiny-qwen2-embed-mean");
    let lm = load(&path, DType::F32);
    let spec = EmbeddingSpec::for_model(&path, lm.model.config.hidden_size).unwrap();
    let bpb = lm.model.kv_bytes_per_block(16);
    let base = read("ref/ref/embed-tiny-qwen2-embed-mean.json");
    let longest = base.cases.iter().map(|c| c.ids.len()).max().unwrap();
    // Room for the longest input and a little more: the others must wait or be preempted.
    let blocks = longest.div_ceil(16) + 4;
    let cfg = EngineConfig { kv_cache_memory: Some(blocks * bpb), chunked_prefill_size: 32, max_num_batched_tokens: 64, task: Task::Embed(spec), ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    let streams: Vec<_> = base.cases.iter().cycle().take(3 * base.cases.len()).map(|c| h.submit_embed(EmbedRequest { input: c.ids.clone(), ..Default::default() }).unwrap()).collect();
    for (s, c) in streams.into_iter().zip(base.cases.iter().cycle()) {
        compare(&format!("{} under preemption", c.name), &s.blocking_result().unwrap(), &c.embedding);
    }
    let preemptions = h.stats().preemptions;
    h.shutdown_and_join();
    assert!(preemptions > 0, "the pool was meant to run dry and preempt");
    eprintln!("{preemptions} preemptions");
}
