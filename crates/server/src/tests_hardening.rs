//! Regression tests for the hostile-input probe (issue 20) over the mock backend: adapter
//! names, metric series, `Retry-After`, refusals before reading a body, case-insensitive
//! auth, request shapes, and server paths kept out of responses.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use tower::ServiceExt;

use crate::backend::Backend;
use crate::server::router;
use crate::tests::{call, env, error_of, post, Env};

async fn send(e: &Env, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let resp = router(e.st.clone()).oneshot(req).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    (status, headers, resp.into_body().collect().await.unwrap().to_bytes().to_vec())
}

async fn metrics_text(e: &Env) -> String {
    String::from_utf8(call(e, "GET", "/metrics", None, None).await.1).unwrap()
}

/// A 1 MB adapter name was accepted and `/metrics` grew to 134 MB. Every route that takes a
/// name now refuses an over-long one with a short 400 naming the field (3 KB here: the mock
/// server's body limit is 4 KB; the end-to-end suite sends 1 MB).
#[tokio::test]
async fn huge_adapter_names_are_refused_on_every_route() {
    let e = env(None);
    let big = "n".repeat(3000);
    for (path, body, field) in [
        ("/v1/load_lora_adapter", json!({"lora_name": big, "lora_path": "alpha"}), "lora_name"),
        ("/load_lora_adapter", json!({"lora_name": big, "lora_path": "alpha"}), ""),
        ("/v1/unload_lora_adapter", json!({"lora_name": big}), "lora_name"),
        ("/v1/completions", json!({"model": big, "prompt": "x"}), "model"),
        ("/v1/completions", json!({"model": "base", "lora_path": big, "prompt": "x"}), "lora_path"),
        ("/v1/chat/completions", json!({"model": big, "messages": [{"role": "user", "content": "x"}]}), "model"),
        ("/generate", json!({"text": "x", "lora_path": big}), "lora_path"),
    ] {
        let (s, b) = call(&e, "POST", path, Some(&body.to_string()), None).await;
        assert_eq!(s, 400, "{path} {field}");
        assert!(b.len() < 1000, "{path}: a {}-byte answer", b.len());
        if !field.is_empty() {
            assert_eq!(error_of(&serde_json::from_slice(&b).unwrap()).1, Some(field), "{path}");
        }
    }
    // Names with characters that break labels or the `base:adapter` form.
    for bad in ["a,b", "a\"b", "a b", "a:b"] {
        let (s, _) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": bad, "lora_path": "alpha"}).to_string()).await;
        assert_eq!(s, 400, "{bad}");
    }
    assert!(e.mock.adapters().is_empty());
    assert!(metrics_text(&e).await.len() < 20_000);
}

/// Per-adapter series stayed after unload (and so did a huge name's).
#[tokio::test]
async fn unloaded_adapters_leave_no_metric_series() {
    let e = env(None);
    let (s, _) = post(&e, "/v1/load_lora_adapter", r#"{"lora_name":"gone","lora_path":"alpha"}"#).await;
    assert_eq!(s, 200);
    for model in ["gone", "base"] {
        let (s, _) = post(&e, "/v1/completions", &json!({"model": model, "prompt": "x", "max_tokens": 2}).to_string()).await;
        assert_eq!(s, 200);
    }
    assert!(metrics_text(&e).await.contains("adapter=\"gone\""));
    let (s, _) = post(&e, "/v1/unload_lora_adapter", r#"{"lora_name":"gone"}"#).await;
    assert_eq!(s, 200);
    let t = metrics_text(&e).await;
    assert!(!t.contains("adapter=\"gone\""), "series of an unloaded adapter remain");
    assert!(t.contains("adapter=\"\""), "base series must stay");
}

#[tokio::test]
async fn retry_after_on_429_and_503() {
    let e = env(None);
    e.mock.queue_full.store(true, Ordering::SeqCst);
    let req = Request::post("/v1/completions").header("content-type", "application/json").body(Body::from(r#"{"prompt":"x"}"#)).unwrap();
    let (s, h, _) = send(&e, req).await;
    assert_eq!(s, 429);
    assert_eq!(h.get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));
    e.st.begin_shutdown();
    let (s, h, _) = send(&e, Request::get("/v1/models").body(Body::empty()).unwrap()).await;
    assert_eq!(s, 503);
    assert!(h.contains_key("retry-after"));
}

/// More prompts than the queue can ever hold got a misleading 429 "overloaded".
#[tokio::test]
async fn more_prompts_than_the_queue_holds_is_a_400() {
    let e = env(None);
    let prompts: Vec<String> = (0..9).map(|i| i.to_string()).collect();
    let (s, v) = post(&e, "/v1/completions", &json!({"prompt": prompts, "max_tokens": 1}).to_string()).await;
    assert_eq!(s, 400, "{v}");
    let (msg, param) = error_of(&v);
    assert!(param == Some("prompt") && msg.contains("at most 8"), "{msg}");
    let (s, _) = post(&e, "/v1/completions", &json!({"prompt": &prompts[..8], "max_tokens": 1}).to_string()).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn generate_refuses_input_ids_as_a_string() {
    let e = env(None);
    let (s, v) = post(&e, "/generate", r#"{"input_ids":"1 2 3"}"#).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(error_of(&v).1, Some("input_ids"));
}

/// RFC 7235: the auth scheme is case-insensitive.
#[tokio::test]
async fn bearer_scheme_is_case_insensitive() {
    let e = env(Some("k3y"));
    for h in ["bearer k3y", "BEARER k3y", "Bearer  k3y"] {
        let (s, _, _) = send(&e, Request::get("/v1/models").header("authorization", h).body(Body::empty()).unwrap()).await;
        assert_eq!(s, 200, "{h}");
    }
    for h in ["Basic k3y", "Bearer nope", "bearerk3y"] {
        let (s, _, _) = send(&e, Request::get("/v1/models").header("authorization", h).body(Body::empty()).unwrap()).await;
        assert_eq!(s, 401, "{h}");
    }
}

/// A 401 on a POST whose body is never read closed the connection silently; the answer now
/// says `Connection: close`, so the client does not reuse it for its next request.
#[tokio::test]
async fn refusals_before_the_body_is_read_close_the_connection() {
    let e = env(Some("k3y"));
    let body = "x".repeat(200_000);
    let req = Request::post("/v1/completions").header("content-length", body.len()).body(Body::from(body)).unwrap();
    let (s, h, _) = send(&e, req).await;
    assert_eq!(s, 401);
    assert_eq!(h.get("connection").map(|v| v.to_str().unwrap()), Some("close"));
    // Without a body there is nothing left unread: keep-alive stays.
    let (s, h, _) = send(&e, Request::get("/v1/models").body(Body::empty()).unwrap()).await;
    assert_eq!(s, 401);
    assert!(!h.contains_key("connection"));
}

/// Errors and listings showed absolute server paths; they show paths relative to --lora-dir.
#[tokio::test]
async fn server_paths_are_not_exposed() {
    let e = env(None);
    let (s, _) = post(&e, "/v1/load_lora_adapter", &json!({"lora_name": "al", "lora_path": e.dir.join("loras/alpha")}).to_string()).await;
    assert_eq!(s, 200);
    let dir = e.dir.to_string_lossy().to_string();
    let (_, b) = call(&e, "GET", "/v1/models", None, None).await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["data"][1]["root"], "alpha", "{v}");
    let (_, b) = call(&e, "GET", "/v1/lora_adapters", None, None).await;
    let t = String::from_utf8(b).unwrap();
    assert!(t.contains("\"path\":\"alpha\"") && !t.contains(&dir), "{t}");
    let (_, v) = post(&e, "/load_lora_adapter", r#"{"lora_name":"x","lora_path":"missing"}"#).await;
    assert!(!v.to_string().contains(&dir), "{v}");
    assert_eq!(v["loaded_adapters"]["al"], "alpha");
}

/// A prompt too long for the context window by its byte count alone is refused before it is
/// tokenized (mock: one byte per token, 64-token window).
#[tokio::test]
async fn prompts_longer_than_the_window_in_bytes_are_refused_early() {
    let e = env(None);
    let (s, v) = post(&e, "/v1/completions", &json!({"prompt": "y".repeat(65), "max_tokens": 1}).to_string()).await;
    assert_eq!(s, 400);
    let (msg, param) = error_of(&v);
    assert!(param == Some("prompt") && msg.contains("maximum context length"), "{msg}");
    let (s, v) = post(&e, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "y".repeat(80)}]}).to_string()).await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&v).1, Some("messages"));
}
