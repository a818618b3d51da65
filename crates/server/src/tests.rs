//! Route tests over a mock backend (no model): status codes, error shapes, response shapes.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::backend::*;
use crate::server::{router, AppState, ServerConfig};

#[derive(Default)]
pub(crate) struct Mock {
    adapters: Mutex<Vec<AdapterInfo>>,
    version: AtomicU64,
    pub queue_full: AtomicBool,
    last: Mutex<Option<GenRequest>>,
}

impl Backend for Mock {
    fn model_type(&self) -> String {
        "mock".into()
    }
    fn max_model_len(&self) -> usize {
        64
    }
    fn max_token_bytes(&self) -> usize {
        1
    }
    fn max_queued_requests(&self) -> usize {
        8
    }
    fn encode(&self, text: &str, _: bool) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(|b| b as u32).collect())
    }
    fn token_text(&self, id: u32) -> String {
        char::from_u32(id).map(String::from).unwrap_or_default()
    }
    fn has_chat_template(&self) -> bool {
        true
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().filter_map(|&i| char::from_u32(i)).collect()
    }
    fn render_chat(&self, m: &[quiver_model::chat::ChatMessage], add_generation_prompt: bool, _: serde_json::Map<String, Value>, _: Option<&str>) -> Result<String, String> {
        let mut s: String = m.iter().map(|m| format!("{}:{}\n", m.role, m.content)).collect();
        if add_generation_prompt {
            s.push_str("assistant:");
        }
        Ok(s)
    }
    fn submit(&self, req: GenRequest) -> Result<EventStream, SubmitError> {
        if self.queue_full.load(Ordering::SeqCst) {
            return Err(SubmitError::QueueFull);
        }
        if let Some(a) = &req.adapter {
            if !self.adapters.lock().unwrap().iter().any(|x| &x.name == a) {
                return Err(SubmitError::UnknownAdapter(a.clone()));
            }
        }
        if req.constraint == Some(quiver_engine::Constraint::Regex("(".into())) {
            return Err(SubmitError::InvalidConstraint("unbalanced parenthesis".into()));
        }
        *self.last.lock().unwrap() = Some(req.clone());
        // Base says "b", adapters say their first letter; each token is one char.
        let ch = req.adapter.as_deref().and_then(|a| a.chars().next()).unwrap_or('b');
        let mut evs = vec![];
        // Prompt token j (j >= 1) scores -j/10, and its top alternative is the token after it.
        if let Some(k) = req.prompt_logprobs {
            let lps = req.prompt[1..].iter().enumerate().map(|(j, &t)| TokenLogprob { logprob: -(j as f32 + 1.0) / 10.0, top: (0..k as u32).map(|a| (t + 1 + a, -0.01)).collect(), rank: 2 }).collect();
            evs.push(Event::PromptLogprobs(lps));
        }
        for i in 0..req.n {
            for _ in 0..req.max_tokens {
                let lp = req.logprobs.map(|k| TokenLogprob { logprob: -0.5, top: (0..k as u32).map(|j| (ch as u32 + j, -0.5 - j as f32)).collect(), rank: 1 });
                evs.push(Event::Token { index: i, token_id: ch as u32, text: ch.to_string(), logprob: lp });
            }
            evs.push(Event::Finished { index: i, reason: FinishReason::Length, stop_reason: None, prompt_tokens: req.prompt.len(), completion_tokens: req.max_tokens });
        }
        Ok(Box::pin(futures::stream::iter(evs)))
    }
    fn load_adapter(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected: Option<u64>) -> Result<AdapterInfo, AdapterError> {
        let mut a = self.adapters.lock().unwrap();
        let cur = a.iter().position(|x| x.name == name);
        if let (Some(e), true) = (expected, load_inplace) {
            let actual = cur.map(|i| a[i].version);
            if actual != Some(e) {
                return Err(AdapterError::VersionMismatch { name: name.into(), expected: e, actual });
            }
        }
        if cur.is_some() && !load_inplace {
            return Err(AdapterError::AlreadyLoaded(name.into()));
        }
        let info = AdapterInfo { name: name.into(), path: path.into(), version: self.version.fetch_add(1, Ordering::SeqCst) + 1, pinned, rank: 8 };
        match cur {
            Some(i) => a[i] = info.clone(),
            None => a.push(info.clone()),
        }
        Ok(info)
    }
    fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        let mut a = self.adapters.lock().unwrap();
        let n = a.len();
        a.retain(|x| x.name != name);
        if a.len() == n {
            return Err(AdapterError::NotFound(name.into()));
        }
        Ok(())
    }
    fn adapters(&self) -> Vec<AdapterInfo> {
        self.adapters.lock().unwrap().clone()
    }
    fn stats(&self) -> Stats {
        Stats { max_loras: 4, adapters: vec![AdapterStats { name: "x".into(), running: 1, waiting: 0 }], ..Default::default() }
    }
    fn shutdown(&self) {}
}

pub(crate) struct Env {
    pub st: Arc<AppState>,
    pub mock: Arc<Mock>,
    pub dir: std::path::PathBuf,
}

pub(crate) fn env(api_key: Option<&str>) -> Env {
    let dir = std::env::temp_dir().join(format!("quiver-srv-test-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(dir.join("loras/alpha")).unwrap();
    std::fs::create_dir_all(dir.join("loras/ondemand")).unwrap();
    std::fs::create_dir_all(dir.join("outside")).unwrap();
    let mock = Arc::new(Mock::default());
    let cfg = ServerConfig { served_model_names: vec!["base".into()], api_key: api_key.map(str::to_string), lora_dir: Some(dir.join("loras")), max_body_bytes: 4096, ..Default::default() };
    let st = AppState::new(mock.clone(), cfg);
    Env { st, mock, dir }
}

fn rand_suffix() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

pub(crate) async fn call(e: &Env, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> (StatusCode, Vec<u8>) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let req = b.header("content-type", "application/json").body(Body::from(body.unwrap_or("").to_string())).unwrap();
    let resp = router(e.st.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, bytes)
}

pub(crate) async fn post(e: &Env, path: &str, body: &str) -> (StatusCode, Value) {
    let (s, b) = call(e, "POST", path, Some(body), None).await;
    (s, serde_json::from_slice(&b).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into())))
}

pub(crate) fn error_of(v: &Value) -> (&str, Option<&str>) {
    let e = &v["error"];
    assert!(e["type"].is_string() && e["code"].is_number(), "not an OpenAI error: {v}");
    (e["message"].as_str().unwrap(), e["param"].as_str())
}

#[tokio::test]
async fn completions_and_chat_shapes() {
    let e = env(None);
    let (s, v) = post(&e, "/v1/completions", r#"{"model":"base","prompt":["hi","yo"],"max_tokens":3,"n":2,"logprobs":2}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    assert_eq!(v["choices"][3]["index"], 3);
    assert_eq!(v["choices"][0]["text"], "bbb");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let (s, v) = post(&e, "/v1/chat/completions", r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"logprobs":true,"top_logprobs":2}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "bb");
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(v["object"], "chat.completion");
}

#[tokio::test]
async fn streaming_sse_with_usage() {
    let e = env(None);
    let (s, b) = call(&e, "POST", "/v1/chat/completions", Some(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#), None).await;
    assert_eq!(s, 200);
    let text = String::from_utf8(b).unwrap();
    let datas: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("delta")?.get("content")?.as_str().map(str::to_string)).collect();
    assert_eq!(content, "bb");
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 2);
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert!(chunks.iter().any(|c| c["choices"].get(0).is_some_and(|c| c["finish_reason"] == "length")));
}

#[tokio::test]
async fn adapter_selection_forms() {
    let e = env(None);
    let (s, _) = post(&e, "/v1/load_lora_adapter", r#"{"lora_name":"alpha","lora_path":"alpha"}"#).await;
    assert_eq!(s, 200);
    for (model, extra, want) in [("alpha", "", 'a'), ("base:alpha", "", 'a'), ("base", r#","lora_path":"alpha""#, 'a'), ("base:", r#","lora_path":"alpha""#, 'b'), ("base", "", 'b')] {
        let (s, v) = post(&e, "/v1/completions", &format!(r#"{{"model":"{model}","prompt":"x","max_tokens":1{extra}}}"#)).await;
        assert_eq!(s, 200, "{model}: {v}");
        assert_eq!(v["choices"][0]["text"], want.to_string(), "{model}");
        assert_eq!(v["model"], model);
    }
    // Unknown adapter: 404 in OpenAI's shape.
    let (s, v) = post(&e, "/v1/completions", r#"{"model":"nope","prompt":"x"}"#).await;
    assert_eq!(s, 404);
    assert!(error_of(&v).0.contains("nope"));
    // On demand from --lora-dir.
    let (s, v) = post(&e, "/v1/completions", r#"{"model":"ondemand","prompt":"x","max_tokens":1}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "o");
    assert!(e.mock.adapters().iter().any(|a| a.name == "ondemand"));
    // Models list: base + adapters with parent.
    let (s, b) = call(&e, "GET", "/v1/models", None, None).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data[0]["id"], "base");
    assert!(data.iter().any(|m| m["id"] == "alpha" && m["parent"] == "base" && m["root"].as_str().unwrap().ends_with("alpha")));
}

#[tokio::test]
async fn load_unload_replace_and_sandbox() {
    let e = env(None);
    let alpha = e.dir.join("loras/alpha");
    let (s, _) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": "a1", "lora_path": alpha}).to_string()).await;
    assert_eq!(s, 200);
    // Same name again: 400.
    let (s, v) = post(&e, "/v1/load_lora_adapter", r#"{"lora_name":"a1","lora_path":"alpha"}"#).await;
    assert_eq!(s, 400);
    assert!(error_of(&v).0.contains("already"));
    // Replace in place with CAS.
    let ver = e.mock.adapters()[0].version;
    let (s, _) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": "a1", "lora_path": "alpha", "load_inplace": true, "expected_version": ver}).to_string()).await;
    assert_eq!(s, 200);
    let (s, v) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": "a1", "lora_path": "alpha", "load_inplace": true, "expected_version": ver}).to_string()).await;
    assert_eq!(s, 409, "{v}");
    // Outside the sandbox: 400 and nothing loaded.
    for p in ["../outside", e.dir.join("outside").to_str().unwrap(), "/etc"] {
        let (s, v) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": "evil", "lora_path": p}).to_string()).await;
        assert_eq!(s, 400, "{p}: {v}");
        assert_eq!(error_of(&v).1, Some("lora_path"));
    }
    assert!(!e.mock.adapters().iter().any(|a| a.name == "evil"));
    // Missing field.
    let (s, v) = post(&e, "/v1/load_lora_adapter", r#"{"lora_name":"x"}"#).await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&v).1, Some("lora_path"));
    // Unload.
    let (s, _) = post(&e, "/v1/unload_lora_adapter", r#"{"lora_name":"a1"}"#).await;
    assert_eq!(s, 200);
    let (s, _) = post(&e, "/v1/unload_lora_adapter", r#"{"lora_name":"a1"}"#).await;
    assert_eq!(s, 404);
    // SGLang's JSON.
    let (s, v) = post(&e, "/load_lora_adapter", r#"{"lora_name":"s","lora_path":"alpha","pinned":true}"#).await;
    assert_eq!(s, 200);
    assert_eq!(v["success"], true);
    assert!(v["loaded_adapters"]["s"].as_str().unwrap().ends_with("alpha"));
    assert!(e.mock.adapters().iter().any(|a| a.name == "s" && a.pinned));
    let (s, v) = post(&e, "/unload_lora_adapter", r#"{"lora_name":"zzz"}"#).await;
    assert_eq!(s, 400);
    assert_eq!(v["success"], false);
    assert!(v["error_message"].as_str().unwrap().contains("does not exist"), "{v}");
}

#[tokio::test]
async fn errors_statuses() {
    let e = env(None);
    for (body, field) in [
        (r#"{"prompt":"x","max_tokens":-3}"#, Some("max_tokens")),
        (r#"{"prompt":"x","temperature":-1}"#, Some("temperature")),
        (r#"{"prompt":"x","n":1000000}"#, Some("n")),
        (r#"{"prompt":"x","max_tokens":"many"}"#, Some("max_tokens")),
        (r#"{"prompt":"x","max_tokens":1000}"#, Some("max_tokens")),
        (r#"{"prompt": "#, None),
    ] {
        let (s, v) = post(&e, "/v1/completions", body).await;
        assert_eq!(s, 400, "{body}: {v}");
        let (msg, param) = error_of(&v);
        assert_eq!(param, field, "{body}");
        if msg.contains("context length") {
            continue;
        }
        if let Some(f) = field {
            assert!(msg.contains(f), "{msg}");
        }
    }
    e.mock.queue_full.store(true, Ordering::SeqCst);
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"x"}"#).await;
    assert_eq!(s, 429);
    error_of(&v);
    e.mock.queue_full.store(false, Ordering::SeqCst);
    // Body limit.
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(10000));
    let (s, _) = post(&e, "/v1/completions", &big).await;
    assert_eq!(s, 413);
    // Shutting down: 503.
    e.st.begin_shutdown();
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"x"}"#).await;
    assert_eq!(s, 503);
    error_of(&v);
}

#[tokio::test]
async fn api_key() {
    let e = env(Some("sekrit"));
    let (s, _) = call(&e, "GET", "/health", None, None).await;
    assert_eq!(s, 200);
    let (s, b) = call(&e, "GET", "/v1/models", None, None).await;
    assert_eq!(s, 401);
    error_of(&serde_json::from_slice(&b).unwrap());
    let (s, _) = call(&e, "GET", "/v1/models", None, Some("wrong")).await;
    assert_eq!(s, 401);
    let (s, _) = call(&e, "GET", "/v1/models", None, Some("sekrit")).await;
    assert_eq!(s, 200);
    let (s, _) = call(&e, "GET", "/metrics", None, None).await;
    assert_eq!(s, 401);
}

#[tokio::test]
async fn sglang_generate_and_info() {
    let e = env(None);
    let (s, v) = post(&e, "/generate", r#"{"text":"hello","sampling_params":{"max_new_tokens":3,"temperature":0}}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["text"], "bbb");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(v["meta_info"]["prompt_tokens"], 5);
    assert_eq!(e.mock.last.lock().unwrap().as_ref().unwrap().sampling.temperature, 0.0);
    let (s, v) = post(&e, "/generate", r#"{"input_ids":[[1,2],[3]],"sampling_params":{"max_new_tokens":1}}"#).await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 2);
    let (s, b) = call(&e, "POST", "/generate", Some(r#"{"text":"x","stream":true,"sampling_params":{"max_new_tokens":2}}"#), None).await;
    assert_eq!(s, 200);
    let t = String::from_utf8(b).unwrap();
    assert!(t.contains(r#""text":"bb""#) && t.trim_end().ends_with("data: [DONE]"), "{t}");
    let (s, b) = call(&e, "GET", "/get_model_info", None, None).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["is_generation"], true);
    let (s, b) = call(&e, "GET", "/metrics", None, None).await;
    assert_eq!(s, 200);
    let t = String::from_utf8(b).unwrap();
    assert!(t.contains("vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"x\""), "{t}");
    assert!(t.contains("vllm:generation_tokens_total{model_name=\"base\",adapter=\"\"} 7"), "{t}");
}

fn close(v: &Value, want: f64) -> bool {
    v.as_f64().is_some_and(|x| (x - want).abs() < 1e-6)
}

fn sse_chunks(b: &[u8]) -> Vec<Value> {
    let text = String::from_utf8(b.to_vec()).unwrap();
    let datas: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]", "{text}");
    datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[tokio::test]
async fn echo_puts_the_scored_prompt_first() {
    let e = env(None);
    // lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1.
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":[[104,105,106]],"echo":true,"logprobs":1,"max_tokens":1,"temperature":0}"#).await;
    assert_eq!(s, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "hijb", "a token-id prompt echoes its decoded text");
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"], json!(["h", "i", "j", "b"]));
    let tl = lp["token_logprobs"].as_array().unwrap();
    assert!(tl[0].is_null() && close(&tl[1], -0.1) && close(&tl[2], -0.2) && close(&tl[3], -0.5), "{tl:?}");
    assert!(lp["top_logprobs"][0].is_null());
    let top1 = lp["top_logprobs"][1].as_object().unwrap();
    assert!(close(&top1["i"], -0.1) && close(&top1["j"], -0.01), "the prompt token and its top alternative: {top1:?}");
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3]));
    assert!(c["prompt_logprobs"].is_null(), "vLLM's prompt_logprobs only when asked for");
    assert!(c["stop_reason"].is_null());
    assert_eq!(e.mock.last.lock().unwrap().as_ref().unwrap().prompt_logprobs, Some(1));
    // max_tokens 0 scores the prompt and generates nothing.
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"hi","echo":true,"max_tokens":0,"logprobs":0}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "hi");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["h", "i"]));
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(2), Some(0)));
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"hi","max_tokens":0}"#).await;
    assert_eq!((s.as_u16(), error_of(&v).1), (400, Some("max_tokens")), "max_tokens 0 needs echo");
    // vLLM's prompt_logprobs: per position the prompt token and the top ones, by id.
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"hi","prompt_logprobs":1,"max_tokens":1}"#).await;
    assert_eq!(s, 200, "{v}");
    let p = &v["choices"][0]["prompt_logprobs"];
    assert!(p[0].is_null() && p.as_array().unwrap().len() == 2, "{p}");
    assert_eq!((&p[1]["105"]["rank"], &p[1]["105"]["decoded_token"], &p[1]["106"]["rank"]), (&json!(2), &json!("i"), &json!(1)));
    assert_eq!(v["choices"][0]["text"], "b");
}

#[tokio::test]
async fn echo_streams_the_prompt_first_and_usage_continuously() {
    let e = env(None);
    let (s, b) = call(&e, "POST", "/v1/completions", Some(r#"{"prompt":"hi","echo":true,"logprobs":1,"max_tokens":2,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#), None).await;
    assert_eq!(s, 200);
    let chunks = sse_chunks(&b);
    assert_eq!(chunks[0]["choices"][0]["text"], "hi");
    assert_eq!(chunks[0]["choices"][0]["logprobs"]["tokens"], json!(["h", "i"]));
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("text")?.as_str().map(str::to_string)).collect();
    assert_eq!(text, "hibb");
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["text_offset"], json!([2]), "offsets continue after the echoed prompt");
    let used: Vec<u64> = chunks.iter().filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty())).map(|c| c["usage"]["completion_tokens"].as_u64().unwrap()).collect();
    assert_eq!(used, vec![0, 1, 2, 2], "usage on every chunk");
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"hi","stream":true,"prompt_logprobs":1}"#).await;
    assert_eq!((s.as_u16(), error_of(&v).1), (400, Some("prompt_logprobs")));
}

#[tokio::test]
async fn chat_continue_final_message_echo_and_model_card() {
    let e = env(None);
    let body = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure"}],"continue_final_message":true,"add_generation_prompt":false,"echo":true,"max_tokens":2}"#;
    let (s, v) = post(&e, "/v1/chat/completions", body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], "user:hi\nassistant:Sure".len(), "rendered prompt cut after the final message");
    assert_eq!(v["choices"][0]["message"]["content"], "Surebb");
    let (s, v) = post(&e, "/v1/chat/completions", r#"{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true,"add_generation_prompt":true}"#).await;
    assert_eq!((s.as_u16(), error_of(&v).1), (400, Some("continue_final_message")));
    let (s, v) = post(&e, "/v1/chat/completions", r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#).await;
    assert_eq!((s.as_u16(), error_of(&v).1), (400, Some("tools")));
    let (s, v) = post(&e, "/v1/chat/completions", r#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"},"max_tokens":1}"#).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(e.mock.last.lock().unwrap().as_ref().unwrap().constraint, Some(quiver_engine::Constraint::JsonObject));
    // The engine refusing a constraint is a 400 naming the field that gave it.
    let (s, v) = post(&e, "/v1/completions", r#"{"prompt":"x","guided_regex":"("}"#).await;
    assert_eq!((s.as_u16(), error_of(&v).1), (400, Some("guided_regex")), "{v}");
    let (s, b) = call(&e, "GET", "/v1/models/base", None, None).await;
    assert_eq!(s, 200);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["id"], "base");
    let (s, _) = call(&e, "GET", "/v1/models/nope", None, None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn output_options_reach_the_engine() {
    let e = env(None);
    let body = r#"{"prompt":"abcdef","min_tokens":2,"max_tokens":3,"include_stop_str_in_output":true,"skip_special_tokens":false,"spaces_between_special_tokens":false,"logit_bias":{"7":3,"2":-200},"allowed_token_ids":[9,7],"truncate_prompt_tokens":4,"request_id":"abc"}"#;
    let (s, v) = post(&e, "/v1/completions", body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["id"], "cmpl-abc");
    let r = e.mock.last.lock().unwrap().clone().unwrap();
    assert_eq!((r.min_tokens, r.include_stop_str_in_output, r.skip_special_tokens), (2, true, false));
    assert_eq!(r.sampling.logit_bias, vec![(2, -100.0), (7, 3.0)]);
    assert_eq!(r.sampling.allowed_token_ids, vec![7, 9]);
    assert_eq!(r.prompt, b"cdef".iter().map(|&b| b as u32).collect::<Vec<_>>(), "the last 4 prompt tokens");
}
