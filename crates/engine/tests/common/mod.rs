//! Shared helpers for tests that need the real model and the HF reference data.
#![allow(dead_code)]

pub mod shown;

use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::{load_model, LoadedModel};
use serde::Deserialize;
use std::path::PathBuf;

/// The project cache (`$QUIVER_CACHE` or `<repo>/.cache`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("QUIVER_CACHE").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache")))
}

/// A file the test data step (`make test-data`, run by `make test`) must have produced. Missing
/// data fails the test: a parity test that silently passes proves nothing.
pub fn require(rel: &str) -> PathBuf {
    let p = cache_dir().join(rel);
    assert!(p.exists(), "{} is missing: run `make test` (or scripts/make-refs.sh) to fetch the model and build the reference data", p.display());
    p
}

/// The directory `scripts/gpu_models.py` wrote on the GPU machine (`$QUIVER_GPU_DATA`).
pub fn gpu_data_dir() -> PathBuf {
    let d = std::env::var_os("QUIVER_GPU_DATA").map(PathBuf::from).expect("QUIVER_GPU_DATA must name the directory scripts/gpu_models.py wrote");
    assert!(d.join("models").is_dir(), "{}: no models/ (run scripts/gpu_models.py first)", d.display());
    d
}

pub fn smollm2_gguf() -> PathBuf {
    require("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn load(path: &std::path::Path, dtype: DType) -> LoadedModel {
    load_model(path, open_device(DeviceKind::Cpu).unwrap(), dtype).unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()))
}

#[derive(Deserialize)]
pub struct RefFile {
    pub cases: Vec<RefCase>,
}

#[derive(Deserialize)]
pub struct RefCase {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub continuation_ids: Vec<u32>,
    pub top_ids: Vec<Vec<u32>>,
    pub top_logprobs: Vec<Vec<f32>>,
    /// MoE models: each position's router top-k margin in the reference run
    /// (`reference.router_margins`); empty for dense models.
    #[serde(default)]
    pub router_margin: Vec<f32>,
}

pub fn read_ref(rel: &str) -> RefFile {
    let p = require(rel);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// log_softmax of one row, in f64 for a reference-quality normaliser.
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// Max |Δlogprob| over the reference's top tokens at each position of `case`, given our logits
/// for prompt+continuation (`[len, vocab]`); NaN where any is NaN.
pub fn logprob_deltas(case: &RefCase, logits: &[f32], vocab: usize) -> Vec<f32> {
    let n = case.prompt_ids.len() + case.continuation_ids.len();
    assert_eq!(case.top_ids.len(), n, "{}: reference positions", case.name);
    assert_eq!(logits.len(), n * vocab);
    (0..n)
        .map(|i| {
            let lp = log_softmax(&logits[i * vocab..(i + 1) * vocab]);
            case.top_ids[i].iter().zip(&case.top_logprobs[i]).map(|(&t, &want)| (lp[t as usize] - want).abs()).fold(0.0f32, |a, d| if d > a || d.is_nan() { d } else { a })
        })
        .collect()
}

/// Max |Δlogprob| over the reference's top tokens at every position of `case`, and where.
pub fn max_logprob_delta(case: &RefCase, logits: &[f32], vocab: usize) -> (f32, usize) {
    worst_of(logprob_deltas(case, logits, vocab).into_iter().enumerate())
}

/// Where greedy tokens `a` first leave `b` (a difference in length counts).
pub fn first_divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

/// Where greedy `got` first leaves the case's reference continuation: that token's index, and
/// the reference's logprob of its own pick minus its logprob of ours at that position (`None`
/// when ours is outside its top tokens or one run stopped early). A gap within the logprob
/// error is a near-tie any rounding may flip; the reference's own greedy run and its
/// teacher-forced scoring can already disagree there (tiny-llama-bias numbers-plain, token 19:
/// 4e-5 apart).
pub fn greedy_divergence(case: &RefCase, got: &[u32]) -> Option<(usize, Option<f32>)> {
    let want = &case.continuation_ids;
    let p = first_divergence(got, want)?;
    // Logits row `prompt + p - 1` predicts continuation token p.
    let row = case.prompt_ids.len() + p - 1;
    let lp = |t: u32| case.top_ids[row].iter().position(|&x| x == t).map(|j| case.top_logprobs[row][j]);
    let gap = match (want.get(p).and_then(|&t| lp(t)), got.get(p).and_then(|&t| lp(t))) {
        (Some(a), Some(b)) => Some(a - b),
        _ => None,
    };
    Some((p, gap))
}

fn worst_of(deltas: impl Iterator<Item = (usize, f32)>) -> (f32, usize) {
    deltas.fold((0.0f32, 0usize), |w, (i, d)| if d > w.0 || d.is_nan() { (d, i) } else { w })
}

/// The router top-k margin under which a GPU run may pick other experts than the float32
/// reference: bf16 activations and KV move a router logit of size ~2 by ~1e-2 (2^-8 relative),
/// and a position routed differently has logprobs that differ by more than rounding (0.2-0.7 on
/// the random MoE models) without any arithmetic being wrong.
pub const ROUTER_NEAR_TIE: f32 = 0.02;

/// A case's logprobs against its reference, with MoE routing near-ties told apart.
pub struct RoutedDeltas {
    /// Worst |Δlogprob| over the positions held to the tolerance, and where.
    pub held: (f32, usize),
    /// Positions over the tolerance excused by routing: (position, |Δlogprob|, its router
    /// margin). A margin below the near-tie bound is a near-tie itself; one above it lies after
    /// an excused near-tie of the same case, whose other expert reaches it through the KV cache
    /// (on a 2-layer model with hidden 64 one position's keys and values weigh a lot).
    pub excused: Vec<(usize, f32, f32)>,
}

/// `max_logprob_delta`, except that a position over `tol` where the reference's router margin is
/// below `near_tie` (a routing near-tie), and any position over `tol` after one, are listed apart
/// instead of counted; `near_tie` 0 (or a dense model) holds every position to `tol`.
pub fn routed_deltas(case: &RefCase, logits: &[f32], vocab: usize, tol: f32, near_tie: f32) -> RoutedDeltas {
    let d = logprob_deltas(case, logits, vocab);
    let margin = |i: usize| case.router_margin.get(i).copied().unwrap_or(f32::INFINITY);
    let first_tie = (0..d.len()).find(|&i| d[i] > tol && margin(i) < near_tie);
    let excused = |i: usize| d[i] > tol && first_tie.is_some_and(|f| i >= f);
    RoutedDeltas {
        held: worst_of((0..d.len()).filter(|&i| !excused(i)).map(|i| (i, d[i]))),
        excused: (0..d.len()).filter(|&i| excused(i)).map(|i| (i, d[i], margin(i))).collect(),
    }
}

/// Prints why each of a case's positions in `excused` (`RoutedDeltas`) was excused.
pub fn print_excused(label: &str, excused: &[(usize, f32, f32)]) {
    for &(p, d, m) in excused {
        let why = if m < ROUTER_NEAR_TIE { "a router near-tie" } else { "after a router near-tie" };
        eprintln!("{label}: position {p} is {d:.4} off, reference router margin {m:.2e} ({why})");
    }
}

/// Checks the positions a GPU MoE test excused as routing near-ties (`RoutedDeltas`): at most
/// one position in `max_share`, and none off by more than another expert's output explains
/// (`cap`).
pub fn assert_routing_excuses_bounded(label: &str, excused: &[(usize, f32, f32)], positions: usize, max_share: usize, cap: f32) {
    let worst = excused.iter().map(|x| x.1).fold(0.0f32, f32::max);
    let ties = excused.iter().filter(|x| x.2 < ROUTER_NEAR_TIE).count();
    eprintln!(
        "{label}: {} of {positions} positions excused by routing ({ties} router near-ties under margin {ROUTER_NEAR_TIE}, {} after one), worst |Δlogprob| there {worst:.4}",
        excused.len(),
        excused.len() - ties
    );
    assert!(excused.len() * max_share <= positions, "{label}: {} positions excused by routing in {positions} (more than 1 in {max_share})", excused.len());
    assert!(worst <= cap, "{label}: a position excused by routing is {worst} off (> {cap})");
}

// ---- engine test helpers ------------------------------------------------------------------

use quiver_engine::testing::{temp_dir, tiny_model, write_random_adapter};
use quiver_engine::{AdapterLora, BaseOnly, GenerateOptions, Generator, SamplingParams};
use quiver_lora::{AdapterKey, LoraConfig, LoraManager, LoraModelDims, LoraModule};
use quiver_model::LlamaModel;

/// The tiny random model (2 layers, hidden 64) over SmolLM2's tokenizer; same seed = same weights.
pub fn tiny(seed: u64) -> LoadedModel {
    tiny_model(&smollm2_gguf(), seed).unwrap()
}

/// `k` random rank-`rank` adapters on every projection, in a fresh temp dir.
pub fn make_adapters(tag: &str, dims: &LoraModelDims, k: usize, rank: usize, b_std: f32, seed: u64) -> Vec<PathBuf> {
    let root = temp_dir(tag);
    (0..k)
        .map(|i| {
            let p = root.join(format!("adapter{i}"));
            write_random_adapter(&p, dims, &LoraModule::PROJECTIONS, rank, 2.0 * rank as f32, b_std, seed + i as u64).unwrap();
            p
        })
        .collect()
}

/// A LoRA manager for oracle runs holding `paths` as `a0, a1, ...`.
pub fn oracle_manager(model: &LlamaModel, paths: &[PathBuf]) -> (LoraManager, Vec<AdapterKey>) {
    let cfg = LoraConfig { max_loras_per_batch: paths.len().max(1), max_loaded_loras: paths.len().max(1), max_lora_rank: 64, ..Default::default() };
    let mut m = LoraManager::new(model.lora_dims(), cfg, model.device.clone()).unwrap();
    let keys = paths.iter().enumerate().map(|(i, p)| m.load_adapter(&format!("a{i}"), p).unwrap()).collect();
    (m, keys)
}

/// Greedy tokens of `prompt` alone through `Generator` (the `quiver generate` path).
pub fn alone(model: &LlamaModel, lora: Option<(&mut LoraManager, AdapterKey)>, prompt: &[u32], max_tokens: usize, stop_ids: &[u32]) -> Vec<u32> {
    let mut g = Generator::new(model, prompt.len() + max_tokens + 1);
    let opts = GenerateOptions { max_tokens, sampling: SamplingParams::default(), stop_ids: stop_ids.to_vec(), prefill_chunk: 512 };
    let mut out = Vec::new();
    match lora {
        Some((manager, key)) => g.generate(prompt, &opts, &mut AdapterLora { manager, key: Some(key) }, |t| {
            out.push(t);
            true
        }),
        None => g.generate(prompt, &opts, &mut BaseOnly, |t| {
            out.push(t);
            true
        }),
    }
    .unwrap();
    out
}

/// Deterministic pseudo-random prompt of `len` ordinary tokens.
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as usize % (vocab.min(40000) - 200) + 100) as u32
        })
        .collect()
}

/// A case whose reference is our own logits: the top 20 logprobs at every position of
/// `prompt + continuation` (`logits` `[len, vocab]`), for comparing two devices.
pub fn top20_case(name: String, prompt_ids: Vec<u32>, continuation_ids: Vec<u32>, logits: &[f32], vocab: usize) -> RefCase {
    let (mut top_ids, mut top_logprobs) = (Vec::new(), Vec::new());
    for row in logits.chunks(vocab) {
        let lp = log_softmax(row);
        let mut idx: Vec<u32> = (0..vocab as u32).collect();
        idx.select_nth_unstable_by(19, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]));
        idx.truncate(20);
        top_logprobs.push(idx.iter().map(|&i| lp[i as usize]).collect());
        top_ids.push(idx);
    }
    RefCase { name, prompt_ids, continuation_ids, top_ids, top_logprobs, router_margin: Vec::new() }
}

// ---- shared parity checks ----------------------------------------------------------------

use quiver_engine::{Engine, EngineConfig, FinishReason, GenerateRequest};
use quiver_engine::StepLora;
use quiver_lora::LoraHook;
use quiver_model::{ForwardBatch, LogitsFor};

/// Logprob tolerance against the PEFT references (f32).
pub const TOL: f32 = 1e-3;

/// The PEFT reference adapters of `scripts/reference.py`, in `ref/adapters/`.
pub const ADAPTERS: [&str; 5] = ["a-qv-r8", "b-all-r16-rslora", "c-patterns", "d-embed-head", "e-qk-r4"];

/// A manager on the model's device holding the PEFT reference adapters.
pub fn peft_manager(model: &LlamaModel, slots: usize) -> (LoraManager, Vec<AdapterKey>) {
    let cfg = LoraConfig { max_loras_per_batch: slots, max_lora_rank: 16, target_modules: LoraModule::ALL.to_vec(), ..Default::default() };
    let mut mgr = LoraManager::new(model.lora_dims(), cfg, model.device.clone()).unwrap();
    let keys = ADAPTERS.iter().map(|a| mgr.load_adapter(a, require(&format!("ref/adapters/{a}"))).unwrap()).collect();
    (mgr, keys)
}

/// One sequence per (adapter, case); runs them all in one forward and checks every row against
/// its own adapter's reference within `tol`. Returns the logits, `[rows, vocab]` in sequence order.
pub fn check_mixed(model: &LlamaModel, mgr: &mut LoraManager, seqs: &[(Option<AdapterKey>, &RefCase, &str)], tol: f32) -> Vec<f32> {
    check_mixed_routed(model, mgr, seqs, tol, 0.0).0
}

/// `check_mixed` with MoE routing near-ties (`routed_deltas`) listed apart: returns the logits,
/// the near-ties and how many positions were checked.
#[allow(clippy::type_complexity)]
pub fn check_mixed_routed(model: &LlamaModel, mgr: &mut LoraManager, seqs: &[(Option<AdapterKey>, &RefCase, &str)], tol: f32, near_tie: f32) -> (Vec<f32>, Vec<(usize, f32, f32)>, usize) {
    let vocab = model.config.vocab_size;
    let bs = 16;
    let lens: Vec<usize> = seqs.iter().map(|(_, c, _)| c.prompt_ids.len() + c.continuation_ids.len()).collect();
    let per: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let total_tokens: usize = lens.iter().sum();
    let mut kv = model.alloc_kv(per.iter().sum(), bs);
    let mut batch = ForwardBatch::with_capacity(total_tokens, seqs.len(), *per.iter().max().unwrap());
    let mut next = 0u32;
    for ((_, c, _), &nb) in seqs.iter().zip(&per) {
        let mut toks = c.prompt_ids.clone();
        toks.extend(&c.continuation_ids);
        let table: Vec<u32> = (next..next + nb as u32).collect();
        next += nb as u32;
        batch.push_seq(&toks, 0, &table, LogitsFor::All);
    }
    let keys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.0).collect();
    let mut ws = model.new_workspace(total_tokens, total_tokens);
    let hook = mgr.prepare_batch(&keys, &batch.seq_starts, &batch.logits_rows).unwrap();
    let logits = model.forward(&batch, &mut kv, &mut ws, &hook);
    let (mut off, mut excused) = (0, Vec::new());
    for ((_, c, label), &len) in seqs.iter().zip(&lens) {
        let r = routed_deltas(c, &logits[off * vocab..(off + len) * vocab], vocab, tol, near_tie);
        let (d, pos) = r.held;
        print_excused(&format!("{label} {}", c.name), &r.excused);
        assert!(d <= tol, "{label} case {}: max |Δlogprob| {d} at position {pos} > {tol}", c.name);
        eprintln!("{label} {}: max |Δlogprob| {d:.2e}", c.name);
        excused.extend(r.excused);
        off += len;
    }
    (logits.to_vec(), excused, total_tokens)
}

/// Runs one adapter through the single-sequence generator.
pub struct OneAdapter<'a> {
    pub mgr: &'a mut LoraManager,
    pub key: AdapterKey,
}

impl StepLora for OneAdapter<'_> {
    fn with_hook(&mut self, batch: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook)) {
        let hook = self.mgr.prepare_batch(&[Some(self.key)], &batch.seq_starts, &batch.logits_rows).unwrap();
        f(&hook)
    }
}


/// Greedy continuation of `case` with one adapter through the single-sequence generator; it
/// must be the reference's token for token.
pub fn assert_greedy_matches(g: &mut quiver_engine::Generator, mgr: &mut LoraManager, key: AdapterKey, case: &RefCase, label: &str) {
    let opts = GenerateOptions { max_tokens: case.continuation_ids.len(), sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 128 };
    let mut out = Vec::new();
    g.generate(&case.prompt_ids, &opts, &mut OneAdapter { mgr, key }, |t| {
        out.push(t);
        true
    })
    .unwrap();
    assert_eq!(out, case.continuation_ids, "{label} case {}: greedy continuation differs from PEFT", case.name);
}

/// `n` concurrent greedy requests of `max_tokens` over 4 adapters and base rows (mixed prompt
/// lengths, chunked prefill interleaved with decode) through an engine on `lm`, each
/// token-identical to the request run alone on `oracle_lm` through `Generator`.
pub fn engine_matches_alone(lm: LoadedModel, oracle_lm: LoadedModel, n: usize, max_tokens: usize) {
    let dims = lm.model.lora_dims();
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("parity", &dims, 4, 16, 0.02, 7);
    let (mut oracle, keys) = oracle_manager(&oracle_lm.model, &paths);

    let cfg = EngineConfig {
        max_running_requests: 40,
        max_loras_per_batch: 4,
        max_lora_rank: 16,
        max_num_batched_tokens: 96,
        chunked_prefill_size: 24,
        kv_cache_memory: Some(512 << 20),
        ..Default::default()
    };
    let h = Engine::start(lm, cfg).unwrap();
    for (i, p) in paths.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }
    let cases: Vec<(Vec<u32>, Option<usize>)> = (0..n)
        .map(|i| {
            let len = [3usize, 9, 17, 30, 41, 64][i % 6] + i % 5;
            (prompt(i as u64, len, vocab), if i % 5 == 4 { None } else { Some(i % 4) })
        })
        .collect();
    let streams: Vec<_> = cases
        .iter()
        .map(|(p, a)| {
            h.submit(GenerateRequest { prompt: p.clone(), adapter: a.map(|a| format!("a{a}")), max_tokens, ignore_eos: true, ..Default::default() }).unwrap()
        })
        .collect();
    let got: Vec<_> = streams.into_iter().map(|s| s.collect_blocking()).collect();
    let stats = h.stats();
    assert!(stats.prefill_tokens > 0);
    h.shutdown_and_join();

    let mut distinct_outputs = std::collections::HashSet::new();
    for (i, ((p, a), c)) in cases.iter().zip(&got).enumerate() {
        assert!(c.error.is_none(), "request {i}: {:?}", c.error);
        assert_eq!(c.finish[0], Some(FinishReason::Length));
        let want = alone(&oracle_lm.model, a.map(|a| (&mut oracle, keys[a])), p, max_tokens, &[]);
        assert_eq!(c.tokens[0], want, "request {i} (adapter {a:?}, prompt {} tokens) differs from running alone", p.len());
        distinct_outputs.insert(c.tokens[0].clone());
    }
    // The adapters must actually change outputs, or the test proves nothing about routing.
    let p = &cases[0].0;
    let base = alone(&oracle_lm.model, None, p, max_tokens, &[]);
    let differing = (0..4).filter(|&a| alone(&oracle_lm.model, Some((&mut oracle, keys[a])), p, max_tokens, &[]) != base).count();
    assert!(differing >= 3, "only {differing} of 4 adapters change the greedy output of the base model");
}

/// 16 concurrent greedy requests of mixed lengths on `lm` (a small model), chunked prefill
/// interleaved with decode (so every expert of an MoE model sees other row groups than alone),
/// each token-identical to the request run alone on `oracle_lm`.
pub fn concurrent_requests_match_alone(lm: LoadedModel, oracle_lm: LoadedModel) {
    let vocab = lm.model.config.vocab_size;
    let cfg = EngineConfig { max_running_requests: 16, max_num_batched_tokens: 64, chunked_prefill_size: 20, kv_cache_memory: Some(64 << 20), ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    let max_tokens = 8;
    let prompts: Vec<Vec<u32>> = (0..16).map(|i| prompt(100 + i as u64, [2usize, 7, 19, 33, 50][i % 5] + i % 3, vocab)).collect();
    let streams: Vec<_> = prompts.iter().map(|p| h.submit(GenerateRequest { prompt: p.clone(), max_tokens, ignore_eos: true, ..Default::default() }).unwrap()).collect();
    let got: Vec<_> = streams.into_iter().map(|s| s.collect_blocking()).collect();
    h.shutdown_and_join();
    for (i, (p, c)) in prompts.iter().zip(&got).enumerate() {
        assert!(c.error.is_none(), "request {i}: {:?}", c.error);
        assert_eq!(c.tokens[0], alone(&oracle_lm.model, None, p, max_tokens, &[]), "request {i} (prompt {} tokens) differs from running alone", p.len());
    }
}
