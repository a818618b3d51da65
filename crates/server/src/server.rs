//! The axum application: routes, auth, adapter resolution, SSE, graceful shutdown.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};

use crate::adapter_routes::{get_model, list_adapters, list_models, sgl_load, sgl_unload, v1_load, v1_unload};
use crate::adapters::on_demand_dir;
use crate::backend::{AdapterError, Backend, Event, EventStream, FinishReason, GenRequest, StopReason, TokenLogprob};
use crate::limits::{adapter_name_error, shown_path};
use crate::shutdown::{cut_error, until_cut, StreamCut};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{self, Common, ModelRef};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Names the base model answers to; the first is reported.
    pub served_model_names: Vec<String>,
    /// Where the base model came from (`root` of its model card).
    pub model_path: String,
    pub api_key: Option<String>,
    /// Sandbox root for adapters loaded at run time, and the on-demand resolver's directory.
    pub lora_dir: Option<PathBuf>,
    pub lora_enabled: bool,
    pub max_body_bytes: usize,
    /// How long running requests may take to finish after SIGTERM/SIGINT.
    pub shutdown_grace: Duration,
    /// vLLM's `--tool-call-parser`: how the model writes tool calls.
    pub tool_parser: Option<crate::tools::ToolParser>,
    /// vLLM's `--enable-auto-tool-choice`: `tool_choice: auto` is served (needs a parser).
    pub enable_auto_tool_choice: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_names: vec!["base".into()],
            model_path: String::new(),
            api_key: None,
            lora_dir: None,
            lora_enabled: true,
            max_body_bytes: 16 << 20,
            shutdown_grace: Duration::from_secs(30),
            tool_parser: None,
            enable_auto_tool_choice: false,
        }
    }
}

pub struct AppState {
    pub backend: Arc<dyn Backend>,
    pub cfg: ServerConfig,
    pub metrics: Metrics,
    shutting_down: AtomicBool,
    /// Generation streams alive (for the shutdown drain).
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    /// Serialises adapter loads/unloads so check-then-load is atomic for the HTTP layer.
    pub(crate) adapter_lock: tokio::sync::Mutex<()>,
    /// Fired when the shutdown grace is over: running streams end with an error.
    pub cut: StreamCut,
}

impl AppState {
    pub fn new(backend: Arc<dyn Backend>, cfg: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            backend,
            cfg,
            metrics: Metrics::default(),
            shutting_down: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            adapter_lock: tokio::sync::Mutex::new(()),
            cut: StreamCut::default(),
        })
    }
    pub fn served(&self) -> &str {
        &self.cfg.served_model_names[0]
    }
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
    /// Counts a request in flight for the shutdown drain until the guard drops.
    pub(crate) fn in_flight_guard(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }
    /// A response id; a client's `request_id` (vLLM) is used as given after the prefix.
    pub(crate) fn new_id(&self, prefix: &str, request_id: Option<&str>) -> String {
        if let Some(r) = request_id {
            return format!("{prefix}-{r}");
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        format!("{prefix}-{:x}{:08x}", t & 0xffff_ffff_ffff, n)
    }
}

/// See [`AppState::in_flight_guard`].
pub(crate) struct InFlight(Arc<AppState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub fn router(st: Arc<AppState>) -> Router {
    let limit = st.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(crate::completions::completions))
        .route("/v1/chat/completions", post(crate::chat::chat_completions))
        .route("/v1/models", get(list_models))
        .route("/v1/embeddings", post(crate::embeddings::embeddings))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/load_lora_adapter", post(v1_load))
        .route("/v1/unload_lora_adapter", post(v1_unload))
        .route("/v1/lora_adapters", get(list_adapters))
        .route("/generate", post(crate::sglang::generate))
        .route("/load_lora_adapter", post(sgl_load))
        .route("/unload_lora_adapter", post(sgl_unload))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/get_model_info", get(model_info))
        .route("/metrics", get(metrics))
        .route("/version", get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION")})) }))
        .fallback(|| async { ApiError::not_found("Not found") })
        .layer(middleware::from_fn_with_state(st.clone(), guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(st)
}

/// API key, shutdown refusal and per-route response counts.
async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string()).unwrap_or_else(|| "other".into());
    // Refused before the body is read: tell the client this connection ends here, or the
    // unread body left on it would make its next keep-alive request fail.
    let has_body = req.headers().get(header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() != b"0") || req.headers().contains_key(header::TRANSFER_ENCODING);
    let refuse = |e: ApiError| {
        st.metrics.http(&route, e.status.as_u16());
        let mut r = e.into_response();
        if has_body {
            r.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        }
        r
    };
    if let Some(key) = &st.cfg.api_key {
        if path != "/health" {
            // The auth scheme is case-insensitive (RFC 7235).
            let ok = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim_start().split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .is_some_and(|(_, k)| constant_time_eq(k.trim().as_bytes(), key.as_bytes()));
            if !ok {
                return refuse(ApiError::new(StatusCode::UNAUTHORIZED, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)"));
            }
        }
    }
    if st.is_shutting_down() && path != "/metrics" {
        return refuse(ApiError::unavailable());
    }
    let resp = next.run(req).await;
    st.metrics.http(&route, resp.status().as_u16());
    resp
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(crate) fn body_bytes(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|e| ApiError::new(e.status(), format!("Could not read the request body: {}", e.body_text())))
}

// ---------------------------------------------------------------------------------------------
// Adapter resolution

/// Which adapter (if any) a request runs on; loads it from `--lora-dir` on demand.
pub(crate) async fn resolve_adapter(st: &Arc<AppState>, model: Option<&str>, lora_path: Option<&str>) -> Result<Option<String>, ApiError> {
    let shown = model.unwrap_or_default();
    let name = match request::resolve_model_ref(model, lora_path, &st.cfg.served_model_names) {
        ModelRef::Base => return Ok(None),
        ModelRef::Adapter(name) => name,
    };
    if let Some(why) = adapter_name_error(&name) {
        let param = if lora_path.is_some_and(|l| l.trim() == name) { "lora_path" } else { "model" };
        return Err(ApiError::field(param, format!("`{param}` does not name a valid adapter: {why}")));
    }
    let not_found = || ApiError::model_not_found(if shown.is_empty() || st.cfg.served_model_names.iter().any(|s| s == shown) { &name } else { shown });
    if st.backend.adapters().iter().any(|a| a.name == name) {
        return Ok(Some(name));
    }
    if !st.cfg.lora_enabled {
        return Err(not_found());
    }
    let Some(dir) = st.cfg.lora_dir.clone().and_then(|root| on_demand_dir(&root, &name)) else {
        return Err(not_found());
    };
    let _g = st.adapter_lock.lock().await;
    if st.backend.adapters().iter().any(|a| a.name == name) {
        return Ok(Some(name));
    }
    let b = st.backend.clone();
    let n2 = name.clone();
    let r = tokio::task::spawn_blocking(move || b.load_adapter(&n2, &dir, false, false, None)).await.map_err(|e| ApiError::internal(e.to_string()))?;
    match r {
        Ok(info) => {
            tracing::info!(adapter = %info.name, path = %shown_path(st.cfg.lora_dir.as_deref(), &info.path), "loaded on demand");
            Ok(Some(name))
        }
        Err(AdapterError::AlreadyLoaded(_)) => Ok(Some(name)),
        Err(e) => Err(ApiError::bad_request(format!("Could not load adapter `{name}` from --lora-dir: {e}"))),
    }
}

// ---------------------------------------------------------------------------------------------
// Submission and metrics tracking

/// Wraps an engine stream: records TTFT/ITL/e2e and token counts, counts in-flight streams.
/// Dropping it drops the engine stream, which cancels the request.
struct Tracked {
    inner: EventStream,
    st: Arc<AppState>,
    adapter: String,
    start: Instant,
    last: Vec<Option<Instant>>,
    done: Vec<bool>,
}

impl Tracked {
    fn new(inner: EventStream, st: Arc<AppState>, adapter: String, n: usize) -> Self {
        st.in_flight.fetch_add(1, Ordering::SeqCst);
        Tracked { inner, st, adapter, start: Instant::now(), last: vec![None; n], done: vec![false; n] }
    }
}

impl Stream for Tracked {
    type Item = Event;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = &mut *self;
        let r = this.inner.as_mut().poll_next(cx);
        if let Poll::Ready(Some(ev)) = &r {
            let now = Instant::now();
            match ev {
                Event::Token { index, .. } => {
                    if let Some(slot) = this.last.get_mut(*index) {
                        match slot {
                            None => this.st.metrics.first_token(&this.adapter, now - this.start),
                            Some(prev) => this.st.metrics.inter_token(&this.adapter, now - *prev),
                        }
                        *slot = Some(now);
                    }
                }
                Event::Finished { index, reason, prompt_tokens, completion_tokens, .. } => {
                    if let Some(d) = this.done.get_mut(*index).filter(|d| !**d) {
                        *d = true;
                        this.st.metrics.finished(&this.adapter, Some(*reason), *prompt_tokens, *completion_tokens, now - this.start);
                    }
                }
                Event::PromptLogprobs(_) => {}
                Event::Error(_) => {
                    for d in this.done.iter_mut().filter(|d| !**d) {
                        *d = true;
                        this.st.metrics.finished(&this.adapter, None, 0, 0, now - this.start);
                    }
                }
            }
        }
        r
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let e2e = self.start.elapsed();
        for d in self.done.iter().filter(|d| !**d) {
            let _ = d;
            self.st.metrics.finished(&self.adapter, Some(FinishReason::Abort), 0, 0, e2e);
        }
        self.st.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) type Merged = Pin<Box<dyn Stream<Item = (usize, Event)> + Send>>;

pub(crate) struct Job {
    pub adapter: Option<String>,
    pub prompts: Vec<Vec<u32>>,
    pub common: Common,
    pub logprobs: Option<usize>,
    /// Score each prompt (see `GenRequest::prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
    pub default_max_tokens: Option<usize>,
}

/// The last `k` tokens of a prompt (vLLM's `truncate_prompt_tokens`); true when it cut.
pub(crate) fn truncate_prompt(mut ids: Vec<u32>, k: Option<usize>) -> (Vec<u32>, bool) {
    match k {
        Some(k) if ids.len() > k => {
            ids.drain(..ids.len() - k);
            (ids, true)
        }
        _ => (ids, false),
    }
}

/// vLLM's `stop_reason`: the stop string, the stop token id, or null (EOS, length); for a
/// grammar dead end (finish_reason `abort`) what went wrong.
pub(crate) fn stop_reason_json(r: &Option<StopReason>) -> Value {
    match r {
        None => Value::Null,
        Some(StopReason::Token(t)) => json!(t),
        Some(StopReason::Text(s)) | Some(StopReason::Grammar(s)) => json!(s),
    }
}

/// Tokenizes nothing; checks lengths, submits every prompt, merges the streams tagged by prompt.
pub(crate) fn submit_all(st: &Arc<AppState>, job: Job) -> Result<(Merged, Vec<usize>), ApiError> {
    let max_len = st.backend.max_model_len();
    let label = job.adapter.clone().unwrap_or_default();
    let max_queued = st.backend.max_queued_requests();
    if job.prompts.len() > max_queued {
        // Not a transient overload: this request can never be taken whole.
        return Err(ApiError::field(
            "prompt",
            format!("this request has {} prompts but the server queues at most {max_queued} requests; send at most {max_queued} prompts per request", job.prompts.len()),
        ));
    }
    let mut streams = Vec::with_capacity(job.prompts.len());
    let mut prompt_lens = Vec::new();
    for p in job.prompts {
        if p.is_empty() {
            return Err(ApiError::field("prompt", "the prompt is empty"));
        }
        let max_tokens = match job.common.max_tokens.or(job.default_max_tokens) {
            Some(m) => m,
            None if p.len() < max_len => max_len - p.len(),
            None => 1,
        };
        if p.len() + max_tokens > max_len {
            st.metrics.rejected(&label, "too_long");
            return Err(ApiError::field(
                if job.common.max_tokens.is_some() { "max_tokens" } else { "prompt" },
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                    p.len() + max_tokens,
                    p.len()
                ),
            ));
        }
        prompt_lens.push(p.len());
        let req = GenRequest {
            prompt: p,
            adapter: job.adapter.clone(),
            sampling: job.common.sampling.clone(),
            max_tokens,
            stop: job.common.stop.clone(),
            stop_token_ids: job.common.stop_token_ids.clone(),
            ignore_eos: job.common.ignore_eos,
            logprobs: job.logprobs,
            n: job.common.n,
            prompt_logprobs: job.prompt_logprobs,
            min_tokens: job.common.out.min_tokens,
            include_stop_str_in_output: job.common.out.include_stop_str_in_output,
            skip_special_tokens: job.common.out.skip_special_tokens,
            constraint: job.common.constraint.as_ref().map(|c| c.0.clone()),
        };
        match st.backend.submit(req) {
            Ok(s) => streams.push(Tracked::new(s, st.clone(), label.clone(), job.common.n)),
            Err(e) => {
                st.metrics.rejected(&label, match e {
                    crate::backend::SubmitError::QueueFull => "queue_full",
                    crate::backend::SubmitError::UnknownAdapter(_) => "unknown_adapter",
                    crate::backend::SubmitError::TooLong { .. } => "too_long",
                    crate::backend::SubmitError::Invalid(_) | crate::backend::SubmitError::InvalidConstraint(_) => "invalid",
                    crate::backend::SubmitError::ShuttingDown => "shutting_down",
                });
                // Earlier streams drop here: cancelled. A constraint error names its field.
                return Err(match (&e, &job.common.constraint) {
                    (crate::backend::SubmitError::InvalidConstraint(m), Some((_, field))) => ApiError::field(field, format!("`{field}`: invalid constraint: {m}")),
                    _ => e.into(),
                });
            }
        }
    }
    let merged = futures::stream::select_all(streams.into_iter().enumerate().map(|(i, s)| s.map(move |e| (i, e)).boxed()));
    Ok((Box::pin(merged), prompt_lens))
}

/// A generated token and its logprob record.
pub(crate) type TokLp = (u32, TokenLogprob);

#[derive(Default, Clone)]
pub(crate) struct ChoiceAcc {
    pub text: String,
    pub ids: Vec<u32>,
    pub logprobs: Vec<TokLp>,
    pub finish: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub completion_tokens: usize,
}

/// A whole response: choice `p*n + i`, prompt tokens summed, and each prompt's logprobs
/// when it was scored.
pub(crate) struct Collected {
    pub choices: Vec<ChoiceAcc>,
    pub prompt_tokens: usize,
    pub prompt_logprobs: Vec<Option<Vec<TokenLogprob>>>,
}

/// Runs merged streams to the end (non-streaming responses).
pub(crate) async fn collect(st: &AppState, mut s: Merged, n: usize, num_prompts: usize) -> Result<Collected, ApiError> {
    let mut ch = vec![ChoiceAcc::default(); n * num_prompts];
    let mut prompt_tokens = vec![0usize; num_prompts];
    let mut prompt_logprobs = vec![None; num_prompts];
    let mut cut = std::pin::pin!(st.cut.fired());
    loop {
        let next = tokio::select! {
            biased;
            ev = s.next() => ev,
            _ = &mut cut => return Err(cut_error()),
        };
        let Some((p, ev)) = next else { break };
        match ev {
            Event::Token { index, token_id, text, logprob } => {
                let c = &mut ch[p * n + index.min(n - 1)];
                c.text.push_str(&text);
                c.ids.push(token_id);
                if let Some(lp) = logprob {
                    c.logprobs.push((token_id, lp));
                }
            }
            Event::PromptLogprobs(l) => prompt_logprobs[p] = Some(l),
            Event::Finished { index, reason, stop_reason, prompt_tokens: pt, completion_tokens } => {
                let c = &mut ch[p * n + index.min(n - 1)];
                c.finish = Some(reason);
                c.stop_reason = stop_reason;
                c.completion_tokens = completion_tokens;
                prompt_tokens[p] = pt;
            }
            Event::Error(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    }
    Ok(Collected { choices: ch, prompt_tokens: prompt_tokens.iter().sum(), prompt_logprobs })
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub(crate) fn finish_str(f: Option<FinishReason>) -> Value {
    f.map_or(Value::Null, |f| Value::from(f.as_str()))
}

pub(crate) fn sse_response(st: &AppState, s: impl Stream<Item = Value> + Send + 'static) -> Response {
    let events = until_cut(s, &st.cut).map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string()))).chain(futures::stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// Appends the `stream_options.include_usage` chunk; `completion` is summed from the finish
/// events as they pass.
#[allow(clippy::too_many_arguments)]
pub(crate) fn with_usage_tail(
    s: Pin<Box<dyn Stream<Item = Value> + Send>>,
    include: bool,
    completion: Arc<AtomicUsize>,
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    prompt_total: usize,
) -> impl Stream<Item = Value> + Send {
    let tail = futures::stream::once(async move {
        let c = completion.load(Ordering::Relaxed);
        json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(prompt_total, c)})
    })
    .filter(move |_| futures::future::ready(include));
    s.chain(tail)
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.is_shutting_down() {
        ApiError::unavailable().into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

async fn model_info(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "model_path": st.cfg.model_path, "tokenizer_path": st.cfg.model_path, "served_model_name": st.served(),
        "is_generation": true, "model_type": st.backend.model_type(), "max_model_len": st.backend.max_model_len(),
        "preferred_sampling_params": Value::Null, "weight_version": "default", "has_image_understanding": false,
        "lora_enabled": st.cfg.lora_enabled,
    }))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let stats = st.backend.stats();
    // Series of adapters unloaded since (and recreated by their last streams) go.
    let loaded: Vec<String> = st.backend.adapters().into_iter().map(|a| a.name).collect();
    st.metrics.retain_adapters(|n| loaded.iter().any(|l| l == n));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render(st.served(), &stats)).into_response()
}

// ---------------------------------------------------------------------------------------------
// Serving with graceful shutdown

/// Resolves when SIGTERM or SIGINT arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = futures::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Serves until `stop` resolves, then: refuse new requests with 503, let running ones finish
/// within the grace period, close the listener, and stop the engine.
pub async fn serve_with_shutdown(st: Arc<AppState>, listener: tokio::net::TcpListener, stop: impl std::future::Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let app = router(st.clone()).into_make_service_with_connect_info::<SocketAddr>();
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let st2 = st.clone();
    let grace = st.cfg.shutdown_grace;
    tokio::spawn(async move {
        stop.await;
        st2.begin_shutdown();
        // A second signal skips the drain.
        tokio::spawn(async {
            shutdown_signal().await;
            eprintln!("quiver: second signal, exiting without waiting for running requests");
            std::process::exit(130);
        });
        let t0 = Instant::now();
        tracing::warn!(in_flight = st2.in_flight(), "shutting down: refusing new requests, draining running ones (grace {:?})", grace);
        while st2.in_flight() > 0 && t0.elapsed() < grace {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if st2.in_flight() > 0 {
            tracing::warn!(in_flight = st2.in_flight(), "grace period over; cancelling the remaining requests");
            // Each stream ends with an error event and `[DONE]` (a response with an error);
            // give them a moment to be written before connections close.
            st2.cut.fire();
            let t1 = Instant::now();
            while st2.in_flight() > 0 && t1.elapsed() < Duration::from_secs(1) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let _ = tx.send(true);
    });
    let mut rx2 = rx.clone();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = rx.wait_for(|v| *v).await;
    });
    tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r?,
        _ = async move {
            let _ = rx2.wait_for(|v| *v).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => {}
    }
    st.backend.shutdown();
    Ok(())
}
