//! `quiver bench serve`: an OpenAI-API streaming load generator (vLLM/SGLang `bench_serving` style).
//!
//! Speaks plain OpenAI `/v1/completions` or `/v1/chat/completions` with `stream: true`, so the
//! same run measures Quiver, llama.cpp's `llama-server`, vLLM or SGLang. Every failure (connection
//! refused, HTTP errors, malformed SSE, timeouts, a server overrunning `max_tokens`) is recorded
//! as a failed request with its reason; the run always completes and prints its table.

use crate::dataset::{self, Prompt, PromptData, RandomSpec, Tok};
use crate::metrics::{self, RequestOutcome, Summary};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// POST /v1/completions (random prompts are sent as token-id arrays)
    Completions,
    /// POST /v1/chat/completions (one user message)
    Chat,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraDistribution {
    /// Each request picks an adapter uniformly at random.
    Uniform,
    /// Round-robin: consecutive requests use different adapters.
    Distinct,
    /// Zipf over adapter rank: P(k) ∝ 1/k^alpha (`--zipf-alpha`).
    Skewed,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdapterStyle {
    /// `"model": "<adapter>"` (vLLM, Quiver).
    Model,
    /// `"model": "<base>:<adapter>"` (SGLang, Quiver).
    Sglang,
    /// `"model": "<base>", "lora": [{"id": i, "scale": 1.0}, …]` with every other adapter at 0
    /// (llama.cpp `llama-server`; `--lora-names` must be in the server's `--lora` order).
    Llamacpp,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetName {
    Random,
    Sharegpt,
}

/// Flags of `quiver bench serve`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct ServeBenchArgs {
    /// Server root URL (a trailing `/v1` is accepted).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Served base model name; default: the first id of GET /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Adapters to spread requests over (none = base model only).
    #[arg(long, num_args = 1..)]
    pub lora_names: Vec<String>,
    #[arg(long, value_enum, default_value_t = LoraDistribution::Uniform)]
    pub lora_distribution: LoraDistribution,
    /// Zipf exponent for `--lora-distribution skewed`.
    #[arg(long, default_value_t = 1.5)]
    pub zipf_alpha: f64,
    /// Fraction of requests sent to the base model when adapters are given (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub base_share: f64,
    #[arg(long, value_enum, default_value_t = AdapterStyle::Model)]
    pub adapter_style: AdapterStyle,
    #[arg(long, value_enum, default_value_t = DatasetName::Random)]
    pub dataset: DatasetName,
    /// ShareGPT JSON file for `--dataset sharegpt`.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Fixed max_tokens for ShareGPT prompts (default: the length of the recorded reply).
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 1024)]
    pub random_output_len: usize,
    /// Lengths uniform in [max(1, len·ratio), len] (SGLang semantics); 1.0 = exact lengths.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random token ids are drawn from [100, vocab); taken from `--tokenizer` when given.
    #[arg(long, default_value_t = 32000)]
    pub random_vocab_size: usize,
    /// HF tokenizer.json (or its directory): exact token counts for text prompts.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Requests per second (Poisson arrivals); `inf` sends everything at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Unmeasured requests sent first.
    #[arg(long, default_value_t = 0)]
    pub warmup_requests: usize,
    /// Send `ignore_eos: true` so every request generates max_tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `temperature` sent with each request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// JSON object merged into every request body (server-specific fields).
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Bearer token for the Authorization header.
    #[arg(long)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Write the result (config + metrics) as JSON.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Include every request's timings in the JSON.
    #[arg(long)]
    pub save_detailed: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Parser)]
struct DefaultsWrap {
    #[command(flatten)]
    a: ServeBenchArgs,
}

impl Default for ServeBenchArgs {
    fn default() -> Self {
        DefaultsWrap::parse_from(["bench"]).a
    }
}

/// What `--output-json` holds: run metadata, the settings, the metrics (flattened, top level) and
/// optionally every request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServeReport {
    /// `"serve"`.
    pub bench: String,
    /// RFC 3339 UTC time the run started.
    pub date: String,
    /// The served model name used as base.
    pub model: String,
    /// The flags the run used (`api_key` omitted).
    pub config: Value,
    /// Warmup requests that failed (not part of the metrics).
    pub warmup_failed: usize,
    #[serde(flatten)]
    pub summary: Summary,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<Vec<RequestOutcome>>,
}

/// Which adapter each request uses: `None` = base model, `Some(i)` = `lora_names[i]`.
pub fn assign_adapters(n: usize, n_adapters: usize, dist: LoraDistribution, alpha: f64, base_share: f64, seed: u64) -> Vec<Option<usize>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6c6f7261);
    if n_adapters == 0 {
        return vec![None; n];
    }
    let weights: Vec<f64> = (1..=n_adapters).map(|k| 1.0 / (k as f64).powf(alpha)).collect();
    let total: f64 = weights.iter().sum();
    let mut rr = 0usize;
    (0..n)
        .map(|_| {
            if base_share > 0.0 && rng.random::<f64>() < base_share {
                return None;
            }
            Some(match dist {
                LoraDistribution::Uniform => rng.random_range(0..n_adapters),
                LoraDistribution::Distinct => {
                    let i = rr % n_adapters;
                    rr += 1;
                    i
                }
                LoraDistribution::Skewed => {
                    let mut u = rng.random::<f64>() * total;
                    let mut k = n_adapters - 1;
                    for (i, w) in weights.iter().enumerate() {
                        if u < *w {
                            k = i;
                            break;
                        }
                        u -= w;
                    }
                    k
                }
            })
        })
        .collect()
}

/// The JSON body of one request.
pub fn build_body(args: &ServeBenchArgs, model: &str, prompt: &Prompt, adapter: Option<usize>, extra: &Map<String, Value>) -> Value {
    let mut b = Map::new();
    let name = adapter.map(|i| args.lora_names[i].as_str());
    let model_field = match (args.adapter_style, name) {
        (_, None) | (AdapterStyle::Llamacpp, _) => model.to_string(),
        (AdapterStyle::Model, Some(a)) => a.to_string(),
        (AdapterStyle::Sglang, Some(a)) => format!("{model}:{a}"),
    };
    b.insert("model".into(), json!(model_field));
    if args.adapter_style == AdapterStyle::Llamacpp && !args.lora_names.is_empty() {
        let lora: Vec<Value> =
            (0..args.lora_names.len()).map(|j| json!({"id": j, "scale": if Some(j) == adapter { 1.0 } else { 0.0 }})).collect();
        b.insert("lora".into(), Value::Array(lora));
    }
    match (args.endpoint, &prompt.data) {
        (Endpoint::Completions, PromptData::Ids(ids)) => {
            b.insert("prompt".into(), json!(ids));
        }
        (Endpoint::Completions, PromptData::Text(t)) => {
            b.insert("prompt".into(), json!(t));
        }
        (Endpoint::Chat, PromptData::Text(t)) => {
            b.insert("messages".into(), json!([{"role": "user", "content": t}]));
        }
        (Endpoint::Chat, PromptData::Ids(ids)) => {
            // not produced by our datasets for chat; send something rather than panic
            b.insert("messages".into(), json!([{"role": "user", "content": format!("{ids:?}")}]));
        }
    }
    b.insert("max_tokens".into(), json!(prompt.output_len));
    b.insert("temperature".into(), json!(args.temperature));
    b.insert("stream".into(), json!(true));
    b.insert("stream_options".into(), json!({"include_usage": true}));
    if args.ignore_eos {
        b.insert("ignore_eos".into(), json!(true));
    }
    for (k, v) in extra {
        b.insert(k.clone(), v.clone());
    }
    Value::Object(b)
}

fn root_url(base: &str) -> String {
    let b = base.trim_end_matches('/');
    b.strip_suffix("/v1").unwrap_or(b).to_string()
}

fn snippet(s: &str) -> String {
    let s = s.trim().replace('\n', " ");
    if s.chars().count() > 200 {
        s.chars().take(200).collect::<String>() + "…"
    } else {
        s
    }
}

/// An error and its sources ("error sending request …: Connection refused (os error 111)").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

struct Req {
    url: String,
    body: Value,
    adapter: Option<String>,
    input_len: usize,
    max_tokens: usize,
    endpoint: Endpoint,
}

/// Send one streaming request and time it. Never fails: errors become a failed outcome.
async fn send_one(client: &reqwest::Client, api_key: Option<&str>, r: &Req, t0: Instant, timeout: Duration) -> RequestOutcome {
    let st = Instant::now();
    let mut out = RequestOutcome {
        adapter: r.adapter.clone(),
        input_tokens: r.input_len,
        max_tokens: r.max_tokens,
        start: st.duration_since(t0).as_secs_f64(),
        ..Default::default()
    };
    let res = tokio::time::timeout(timeout, stream_one(client, api_key, r, st, &mut out)).await;
    out.e2e = st.elapsed().as_secs_f64();
    let res = match res {
        Ok(r) => r,
        Err(_) => Err(format!("timeout: no complete response after {:.0} s", timeout.as_secs_f64())),
    };
    match res {
        Ok(()) => out.success = true,
        Err(e) => {
            out.success = false;
            out.error = Some(e);
        }
    }
    out
}

async fn stream_one(client: &reqwest::Client, api_key: Option<&str>, r: &Req, st: Instant, out: &mut RequestOutcome) -> std::result::Result<(), String> {
    let mut rb = client.post(&r.url).json(&r.body);
    if let Some(k) = api_key {
        rb = rb.bearer_auth(k);
    }
    let resp = rb.send().await.map_err(|e| {
        if e.is_timeout() {
            format!("timeout: {}", chain(&e))
        } else {
            format!("connection failed: {}", chain(&e))
        }
    })?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), snippet(&text)));
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut usage_prompt: Option<usize> = None;
    let mut usage_completion: Option<usize> = None;
    let mut done = false;
    while !done {
        let Some(item) = stream.next().await else { break };
        let bytes = item.map_err(|e| format!("stream error: {}", chain(&e)))?;
        let now = Instant::now();
        buf.extend(bytes.iter().copied().filter(|&c| c != b'\r'));
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let mut data = String::new();
            for line in event.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                } else if line.is_empty() || line.starts_with(':') || line.starts_with("event:") || line.starts_with("id:") || line.starts_with("retry:") {
                } else {
                    return Err(format!("malformed SSE: unexpected line {:?}", snippet(line)));
                }
            }
            if data.is_empty() {
                continue;
            }
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(&data).map_err(|e| format!("malformed SSE: {e} in {:?}", snippet(&data)))?;
            if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
                return Err(format!("server error in stream: {}", snippet(&err.to_string())));
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                if let Some(p) = u.get("prompt_tokens").and_then(|x| x.as_u64()) {
                    usage_prompt = Some(p as usize);
                }
                if let Some(c) = u.get("completion_tokens").and_then(|x| x.as_u64()) {
                    usage_completion = Some(c as usize);
                }
            }
            let Some(choice) = v.get("choices").and_then(|c| c.as_array()).and_then(|c| c.first()) else {
                continue;
            };
            let text = match r.endpoint {
                Endpoint::Completions => choice.get("text").and_then(|t| t.as_str()).unwrap_or(""),
                Endpoint::Chat => {
                    let d = choice.get("delta");
                    let c = d.and_then(|d| d.get("content")).and_then(|t| t.as_str()).unwrap_or("");
                    if c.is_empty() {
                        d.and_then(|d| d.get("reasoning_content")).and_then(|t| t.as_str()).unwrap_or("")
                    } else {
                        c
                    }
                }
            };
            if text.is_empty() {
                continue;
            }
            match last {
                None => out.ttft = now.duration_since(st).as_secs_f64(),
                Some(l) => out.itl.push(now.duration_since(l).as_secs_f64()),
            }
            last = Some(now);
            out.chunks += 1;
        }
    }
    if !buf.iter().all(|c| c.is_ascii_whitespace()) && !done {
        let rest = String::from_utf8_lossy(&buf).to_string();
        if rest.trim() != "data: [DONE]" {
            return Err(format!("malformed SSE: truncated event {:?}", snippet(&rest)));
        }
    }
    if let Some(p) = usage_prompt {
        out.input_tokens = p;
    }
    out.output_tokens = usage_completion.unwrap_or(out.chunks);
    let produced = out.output_tokens.max(out.chunks);
    if produced > r.max_tokens {
        return Err(format!("max_tokens exceeded: server returned {produced} tokens, asked for at most {}", r.max_tokens));
    }
    if out.chunks == 0 {
        return Err("empty response: the stream carried no tokens".into());
    }
    Ok(())
}

/// Ask GET /v1/models for the first model id.
async fn detect_model(client: &reqwest::Client, root: &str, api_key: Option<&str>) -> Result<String> {
    let mut rb = client.get(format!("{root}/v1/models")).timeout(Duration::from_secs(10));
    if let Some(k) = api_key {
        rb = rb.bearer_auth(k);
    }
    let v: Value = rb.send().await?.error_for_status()?.json().await?;
    v.get("data")
        .and_then(|d| d.as_array())
        .and_then(|d| d.first())
        .and_then(|m| m.get("id"))
        .and_then(|s| s.as_str())
        .map(String::from)
        .context("/v1/models has no model ids")
}

fn load_prompts(args: &ServeBenchArgs, n: usize) -> Result<Vec<Prompt>> {
    let tok = args.tokenizer.as_deref().map(Tok::load).transpose()?;
    match args.dataset {
        DatasetName::Random => {
            let spec = RandomSpec {
                input_len: args.random_input_len,
                output_len: args.random_output_len,
                range_ratio: args.random_range_ratio,
                vocab_size: args.random_vocab_size,
                id_low: 100,
                as_text: args.endpoint == Endpoint::Chat,
            };
            dataset::random_prompts(&spec, n, tok.as_ref(), args.seed)
        }
        DatasetName::Sharegpt => {
            let p = args.dataset_path.as_deref().context("--dataset sharegpt needs --dataset-path FILE")?;
            dataset::sharegpt_prompts(p, n, args.sharegpt_output_len, tok.as_ref(), args.seed)
        }
    }
}

fn parse_extra(args: &ServeBenchArgs) -> Result<Map<String, Value>> {
    match &args.extra_body {
        None => Ok(Map::new()),
        Some(s) => match serde_json::from_str::<Value>(s).context("--extra-body is not valid JSON")? {
            Value::Object(m) => Ok(m),
            _ => bail!("--extra-body must be a JSON object"),
        },
    }
}

async fn run_batch(
    client: &reqwest::Client,
    args: &ServeBenchArgs,
    reqs: Vec<Req>,
    rate: f64,
    seed: u64,
    pb: Option<indicatif::ProgressBar>,
) -> (Vec<RequestOutcome>, f64) {
    let sem = args.max_concurrency.map(|c| Arc::new(tokio::sync::Semaphore::new(c.max(1))));
    let api_key: Option<Arc<str>> = args.api_key.as_deref().map(Arc::from);
    let timeout = Duration::from_secs_f64(args.timeout.max(0.001));
    let mut rng = StdRng::seed_from_u64(seed ^ 0x706f6973);
    let t0 = Instant::now();
    let mut arrival = 0.0f64;
    let mut handles = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.into_iter().enumerate() {
        if rate.is_finite() && rate > 0.0 && i > 0 {
            let u: f64 = rng.random::<f64>();
            arrival += -(1.0 - u).ln() / rate;
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(arrival)).into()).await;
        }
        let (client, sem, key, pb) = (client.clone(), sem.clone(), api_key.clone(), pb.clone());
        handles.push(tokio::spawn(async move {
            let _permit = match &sem {
                Some(s) => Some(s.clone().acquire_owned().await.expect("semaphore closed")),
                None => None,
            };
            let o = send_one(&client, key.as_deref(), &r, t0, timeout).await;
            if let Some(pb) = pb {
                pb.inc(1);
            }
            o
        }));
    }
    let mut outs = Vec::with_capacity(handles.len());
    for h in handles {
        outs.push(h.await.unwrap_or_else(|e| RequestOutcome { error: Some(format!("client task failed: {e}")), ..Default::default() }));
    }
    (outs, t0.elapsed().as_secs_f64())
}

/// Run the benchmark and return its report (no printing besides the progress bar).
pub async fn bench_serve(args: &ServeBenchArgs) -> Result<ServeReport> {
    if !(0.0..=1.0).contains(&args.base_share) {
        bail!("--base-share must be in [0, 1]");
    }
    if args.request_rate <= 0.0 || args.request_rate.is_nan() {
        bail!("--request-rate must be > 0 (or inf)");
    }
    let extra = parse_extra(args)?;
    let date = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let root = root_url(&args.base_url);
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(args.max_concurrency.unwrap_or(256).min(1024))
        .build()
        .context("building HTTP client")?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => match detect_model(&client, &root, args.api_key.as_deref()).await {
            Ok(m) => m,
            Err(e) => {
                eprintln!("warning: could not read the model name from {root}/v1/models ({e:#}); using \"default\" (pass --model)");
                "default".into()
            }
        },
    };
    let n_total = args.warmup_requests + args.num_prompts;
    let prompts = load_prompts(args, n_total.max(1))?;
    let adapters = assign_adapters(n_total, args.lora_names.len(), args.lora_distribution, args.zipf_alpha, args.base_share, args.seed);
    let url = format!(
        "{root}/v1/{}",
        match args.endpoint {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat/completions",
        }
    );
    let mut reqs: Vec<Req> = (0..n_total)
        .map(|i| {
            let p = &prompts[i % prompts.len()];
            Req {
                url: url.clone(),
                body: build_body(args, &model, p, adapters[i], &extra),
                adapter: adapters[i].map(|a| args.lora_names[a].clone()),
                input_len: p.input_len,
                max_tokens: p.output_len,
                endpoint: args.endpoint,
            }
        })
        .collect();
    let measured = reqs.split_off(args.warmup_requests);

    let mut warmup_failed = 0;
    if !reqs.is_empty() {
        let (w, _) = run_batch(&client, args, reqs, f64::INFINITY, args.seed, None).await;
        let failed: Vec<&RequestOutcome> = w.iter().filter(|o| !o.success).collect();
        warmup_failed = failed.len();
        if let Some(f) = failed.first() {
            eprintln!("warning: {warmup_failed} warmup request(s) failed, e.g. {}", f.error.as_deref().unwrap_or("?"));
        }
    }

    let pb = if args.no_progress {
        None
    } else {
        let pb = indicatif::ProgressBar::new(measured.len() as u64);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests ({per_sec}, eta {eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(pb)
    };
    let (outcomes, duration) = run_batch(&client, args, measured, args.request_rate, args.seed, pb.clone()).await;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let summary = metrics::summarize(&outcomes, duration);
    let mut config = serde_json::to_value(args).unwrap_or(Value::Null);
    if let Some(o) = config.as_object_mut() {
        // JSON has no infinity
        if !args.request_rate.is_finite() {
            o.insert("request_rate".into(), json!("inf"));
        }
        o.insert("resolved_model".into(), json!(model));
    }
    Ok(ServeReport {
        bench: "serve".into(),
        date,
        model,
        config,
        warmup_failed,
        summary,
        requests: args.save_detailed.then_some(outcomes),
    })
}

/// Write a benchmark result as pretty JSON (shared convention of every `quiver bench` command).
pub fn write_json<T: Serialize>(path: &std::path::Path, value: &T) -> Result<()> {
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let s = serde_json::to_string_pretty(value)?;
    std::fs::write(path, s + "\n").with_context(|| format!("writing {}", path.display()))
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio runtime")
}

/// `quiver bench serve`: run, print the table, write `--output-json`.
pub fn run_serve(args: ServeBenchArgs) -> Result<()> {
    let rt = runtime()?;
    let report = rt.block_on(bench_serve(&args))?;
    let title = format!("Serving Benchmark Result ({})", report.model);
    println!("{}", metrics::format_table(&report.summary, &title));
    if let Some(p) = &args.output_json {
        write_json(p, &report)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ServeBenchArgs {
        ServeBenchArgs { lora_names: vec!["a".into(), "b".into(), "c".into()], ..Default::default() }
    }

    #[test]
    fn defaults_parse() {
        let a = ServeBenchArgs::default();
        assert!(a.request_rate.is_infinite());
        assert_eq!(a.num_prompts, 1000);
        let w = DefaultsWrap::parse_from(["b", "--request-rate", "inf", "--lora-names", "x", "y", "--endpoint", "chat"]);
        assert!(w.a.request_rate.is_infinite());
        assert_eq!(w.a.lora_names, ["x", "y"]);
        assert_eq!(w.a.endpoint, Endpoint::Chat);
    }

    #[test]
    fn distributions() {
        let d = assign_adapters(7, 3, LoraDistribution::Distinct, 1.5, 0.0, 0);
        assert_eq!(d, [0, 1, 2, 0, 1, 2, 0].map(Some));
        let u = assign_adapters(3000, 3, LoraDistribution::Uniform, 1.5, 0.0, 0);
        for k in 0..3 {
            let c = u.iter().filter(|x| **x == Some(k)).count();
            assert!((800..1200).contains(&c), "{c}");
        }
        // Zipf α=1 over 3: weights 1, 1/2, 1/3 → P = 6/11, 3/11, 2/11
        let z = assign_adapters(11000, 3, LoraDistribution::Skewed, 1.0, 0.0, 0);
        let c0 = z.iter().filter(|x| **x == Some(0)).count();
        let c2 = z.iter().filter(|x| **x == Some(2)).count();
        assert!((5700..6300).contains(&c0), "{c0}");
        assert!((1800..2200).contains(&c2), "{c2}");
        let b = assign_adapters(4000, 3, LoraDistribution::Uniform, 1.0, 0.25, 0);
        let nb = b.iter().filter(|x| x.is_none()).count();
        assert!((850..1150).contains(&nb), "{nb}");
        assert!(assign_adapters(5, 0, LoraDistribution::Uniform, 1.0, 0.0, 0).iter().all(|x| x.is_none()));
    }

    #[test]
    fn adapter_styles() {
        let p = Prompt { data: PromptData::Ids(vec![5, 6]), input_len: 2, output_len: 9 };
        let mut extra = Map::new();
        extra.insert("top_k".into(), json!(1));
        let mut a = args();
        a.ignore_eos = true;
        let b = build_body(&a, "base", &p, Some(1), &extra);
        assert_eq!(b["model"], "b");
        assert_eq!(b["prompt"], json!([5, 6]));
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["top_k"], 1);
        assert!(b.get("lora").is_none());
        assert_eq!(build_body(&a, "base", &p, None, &extra)["model"], "base");
        a.adapter_style = AdapterStyle::Sglang;
        assert_eq!(build_body(&a, "base", &p, Some(2), &extra)["model"], "base:c");
        a.adapter_style = AdapterStyle::Llamacpp;
        let b = build_body(&a, "base", &p, Some(1), &extra);
        assert_eq!(b["model"], "base");
        assert_eq!(b["lora"], json!([{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]));
        let b = build_body(&a, "base", &p, None, &extra);
        assert!(b["lora"].as_array().unwrap().iter().all(|l| l["scale"] == 0.0));
        a.endpoint = Endpoint::Chat;
        let pt = Prompt { data: PromptData::Text("hi".into()), input_len: 1, output_len: 3 };
        assert_eq!(build_body(&a, "base", &pt, None, &extra)["messages"][0]["content"], "hi");
        assert_eq!(root_url("http://h:1/v1/"), "http://h:1");
    }
}
