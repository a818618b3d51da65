//! `bench serve` against tiny in-test OpenAI-style servers (raw TCP, chunked SSE) with known
//! delays and known misbehaviour.

use quiver_bench::serve::{bench_serve, AdapterStyle, Endpoint, ServeBenchArgs, ServeReport};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// First chunk after `first_ms`, then one every `gap_ms`; `max_tokens` chunks; usage at the end.
    Stream { first_ms: u64, gap_ms: u64 },
    Http500,
    /// A valid first chunk, then garbage that is not JSON.
    Malformed,
    /// Streams `max_tokens + extra` tokens.
    IgnoreMax { extra: usize },
    /// Every second request gets HTTP 503, the others stream normally.
    Flaky,
    /// Two tokens, then the connection drops without ending the chunked body.
    Truncated,
}

struct Fake {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

fn start(mode: Mode) -> Fake {
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let b2 = bodies.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            let counter = Arc::new(AtomicUsize::new(0));
            loop {
                let (s, _) = l.accept().await.unwrap();
                let (b, c) = (b2.clone(), counter.clone());
                tokio::spawn(async move {
                    let _ = handle(s, mode, b, c).await;
                });
            }
        });
    });
    let addr = rx.recv().unwrap();
    Fake { url: format!("http://{addr}"), bodies }
}

async fn read_request(s: &mut TcpStream) -> std::io::Result<(String, Value)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap()))
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body = serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null);
    Ok((head, body))
}

async fn chunk(s: &mut TcpStream, data: &str) -> std::io::Result<()> {
    s.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes()).await?;
    s.flush().await
}

async fn plain(s: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let r = format!("HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
    s.write_all(r.as_bytes()).await?;
    s.flush().await
}

fn token_event(chat: bool, i: usize) -> String {
    let v = if chat {
        json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": format!("t{i}")}, "finish_reason": null}]})
    } else {
        json!({"object": "text_completion", "choices": [{"index": 0, "text": format!("t{i}"), "finish_reason": null}]})
    };
    format!("data: {v}\n\n")
}

async fn handle(mut s: TcpStream, mode: Mode, bodies: Arc<Mutex<Vec<Value>>>, counter: Arc<AtomicUsize>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let (head, body) = read_request(&mut s).await?;
    if head.starts_with("GET /v1/models") {
        return plain(&mut s, "200 OK", r#"{"object":"list","data":[{"id":"fake-model","object":"model"}]}"#).await;
    }
    bodies.lock().unwrap().push(body.clone());
    let chat = head.contains("/chat/completions");
    let max = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let prompt_tokens = body["prompt"].as_array().map(|a| a.len()).unwrap_or(3);
    let n = counter.fetch_add(1, Ordering::SeqCst);
    let (first_ms, gap_ms, ntok) = match mode {
        Mode::Http500 => return plain(&mut s, "500 Internal Server Error", r#"{"error":{"message":"boom"}}"#).await,
        Mode::Flaky if n % 2 == 1 => return plain(&mut s, "503 Service Unavailable", "overloaded").await,
        Mode::Stream { first_ms, gap_ms } => (first_ms, gap_ms, max),
        Mode::IgnoreMax { extra } => (5, 5, max + extra),
        Mode::Malformed | Mode::Flaky | Mode::Truncated => (5, 5, max),
    };
    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n").await?;
    s.flush().await?;
    tokio::time::sleep(Duration::from_millis(first_ms)).await;
    if chat {
        // role-only first chunk, as OpenAI/vLLM send it: must not count as a token
        chunk(&mut s, &format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))).await?;
    }
    for i in 0..ntok {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(gap_ms)).await;
        }
        chunk(&mut s, &token_event(chat, i)).await?;
        if matches!(mode, Mode::Truncated) && i == 1 {
            return Ok(()); // drop the connection mid-body
        }
        if matches!(mode, Mode::Malformed) {
            chunk(&mut s, "data: {\"choices\": [ this is not json\n\n").await?;
        }
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": ntok, "total_tokens": prompt_tokens + ntok}});
    chunk(&mut s, &format!("data: {usage}\n\n")).await?;
    chunk(&mut s, "data: [DONE]\n\n").await?;
    s.write_all(b"0\r\n\r\n").await?;
    s.flush().await
}

fn args(url: &str, n: usize, out_tokens: usize) -> ServeBenchArgs {
    ServeBenchArgs {
        base_url: url.to_string(),
        model: Some("base-model".into()),
        num_prompts: n,
        random_input_len: 12,
        random_output_len: out_tokens,
        random_range_ratio: 1.0,
        no_progress: true,
        timeout: 10.0,
        ..Default::default()
    }
}

fn run(a: &ServeBenchArgs) -> ServeReport {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(bench_serve(a)).unwrap()
}

#[test]
fn slow_server_timings_within_tolerance() {
    let f = start(Mode::Stream { first_ms: 200, gap_ms: 50 });
    let mut a = args(&f.url, 4, 5);
    a.max_concurrency = Some(4);
    a.lora_names = vec!["x".into(), "y".into()];
    a.lora_distribution = quiver_bench::serve::LoraDistribution::Distinct;
    a.ignore_eos = true;
    a.extra_body = Some(r#"{"top_k": 1}"#.into());
    let r = run(&a);
    let s = &r.summary;
    assert_eq!((s.completed, s.failed), (4, 0), "{:?}", s.errors);
    assert_eq!(s.total_output_tokens, 20);
    assert_eq!(s.total_input_tokens, 48);
    // TTFT ≈ 200 ms, ITL ≈ 50 ms, TPOT ≈ 50 ms, E2E ≈ 400 ms
    assert!((190.0..300.0).contains(&s.ttft_ms.mean), "TTFT {:?}", s.ttft_ms);
    assert!((190.0..330.0).contains(&s.ttft_ms.p99), "TTFT {:?}", s.ttft_ms);
    assert_eq!(s.itl_ms.count, 16);
    assert!((40.0..70.0).contains(&s.itl_ms.mean), "ITL {:?}", s.itl_ms);
    assert!((40.0..70.0).contains(&s.itl_ms.median), "ITL {:?}", s.itl_ms);
    assert!((40.0..70.0).contains(&s.tpot_ms.mean), "TPOT {:?}", s.tpot_ms);
    assert!((390.0..550.0).contains(&s.e2el_ms.mean), "E2E {:?}", s.e2el_ms);
    // all 4 ran concurrently: duration ≈ 0.4 s, concurrency ≈ 4
    assert!(s.duration_s < 0.8, "{}", s.duration_s);
    assert!(s.concurrency > 2.5, "{}", s.concurrency);
    assert_eq!(s.per_adapter.len(), 2);
    assert!(s.per_adapter.iter().all(|p| p.completed == 2));
    // what the server saw
    let bodies = f.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 4);
    let mut models: Vec<&str> = bodies.iter().map(|b| b["model"].as_str().unwrap()).collect();
    models.sort();
    assert_eq!(models, ["x", "x", "y", "y"]);
    for b in bodies.iter() {
        assert_eq!(b["prompt"].as_array().unwrap().len(), 12);
        assert_eq!(b["max_tokens"], 5);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["top_k"], 1);
    }
}

#[test]
fn chat_endpoint_ignores_role_chunk_and_detects_model() {
    let f = start(Mode::Stream { first_ms: 100, gap_ms: 20 });
    let mut a = args(&f.url, 2, 4);
    a.endpoint = Endpoint::Chat;
    a.model = None; // read from /v1/models
    a.lora_names = vec!["x".into(), "y".into()];
    a.adapter_style = AdapterStyle::Llamacpp;
    let r = run(&a);
    assert_eq!(r.model, "fake-model");
    let s = &r.summary;
    assert_eq!((s.completed, s.failed), (2, 0), "{:?}", s.errors);
    assert_eq!(s.total_output_tokens, 8);
    assert!(s.ttft_ms.mean >= 95.0, "{:?}", s.ttft_ms);
    assert_eq!(s.itl_ms.count, 6);
    let bodies = f.bodies.lock().unwrap();
    for b in bodies.iter() {
        assert_eq!(b["model"], "fake-model");
        assert_eq!(b["lora"].as_array().unwrap().len(), 2);
        assert!(b["messages"][0]["content"].as_str().unwrap().len() > 10);
    }
}

fn assert_all_failed(r: &ServeReport, n: usize, category: &str) {
    let s = &r.summary;
    assert_eq!((s.num_requests, s.completed, s.failed), (n, 0, n), "{:?}", s.errors);
    assert_eq!(s.errors.get(category), Some(&n), "{:?}", s.errors);
    let t = quiver_bench::metrics::format_table(s, "x");
    assert!(t.contains(category));
}

#[test]
fn http_500_counted_as_failed() {
    let f = start(Mode::Http500);
    let r = run(&args(&f.url, 3, 4));
    assert_all_failed(&r, 3, "HTTP 500");
}

#[test]
fn malformed_sse_counted_as_failed() {
    let f = start(Mode::Malformed);
    let r = run(&args(&f.url, 3, 4));
    assert_all_failed(&r, 3, "malformed SSE");
}

#[test]
fn ignoring_max_tokens_counted_as_failed() {
    let f = start(Mode::IgnoreMax { extra: 3 });
    let r = run(&args(&f.url, 2, 4));
    assert_all_failed(&r, 2, "max_tokens exceeded");
}

#[test]
fn unreachable_server_counted_as_failed() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut a = args(&format!("http://127.0.0.1:{port}/v1"), 3, 4);
    a.model = None; // detection fails too: warning, not an error
    a.warmup_requests = 1;
    let r = run(&a);
    assert_all_failed(&r, 3, "connection failed");
    assert_eq!(r.warmup_failed, 1);
    let t = quiver_bench::metrics::format_table(&r.summary, "x");
    assert!(!t.contains("-0.00"), "{t}");
}

#[test]
fn server_dying_mid_stream_counted_as_failed() {
    let f = start(Mode::Truncated);
    let r = run(&args(&f.url, 2, 4));
    assert_eq!(r.summary.failed, 2, "{:?}", r.summary.errors);
    assert!(r.summary.errors.keys().all(|k| k == "stream error" || k == "malformed SSE"), "{:?}", r.summary.errors);
}

#[test]
fn sweep_end_to_end_writes_report_and_plots() {
    let f = start(Mode::Stream { first_ms: 5, gap_ms: 5 });
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
base_url = "{}"
model = "m"
num_prompts = 2
ignore_eos = true

[[scenario]]
name = "prefill_64"
input_len = 64
output_len = 2
concurrency = 1

[[scenario]]
name = "decode"
input_len = 8
output_len = 3
concurrency = [1, 2]

[[config]]
name = "base"

[[config]]
name = "2-distinct"
lora_names = ["a0", "a1"]
distribution = "distinct"
"#,
        f.url
    );
    let file = dir.path().join("s.toml");
    std::fs::write(&file, toml).unwrap();
    let out = dir.path().join("out");
    let mut a = quiver_bench::SweepArgs {
        scenarios: file,
        out_dir: out.clone(),
        base_url: None,
        model: None,
        endpoint: None,
        adapter_style: None,
        extra_body: None,
        api_key: None,
        only: vec![],
        configs: vec![],
        render_only: false,
        no_progress: true,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let e = rt.block_on(quiver_bench::sweep::sweep(&a)).unwrap();
    assert_eq!(e.len(), 6);
    assert!(e.iter().all(|e| e.report.summary.completed == 2 && e.report.summary.failed == 0));
    assert_eq!(f.bodies.lock().unwrap().len(), 12);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| decode_2 | 2-distinct |"), "{md}");
    assert!(md.contains("## Cost of LoRA vs base"));
    for p in ["decode_throughput.svg", "decode_ttft.svg", "decode_tpot.svg", "decode_e2e.svg", "decode_itl_p99.svg"] {
        assert!(out.join("plots").join(p).exists(), "{p}");
    }
    // prefill ran at a single concurrency: no plot
    assert!(!out.join("plots/prefill_throughput.svg").exists());
    assert!(out.join("results/decode_1__base.json").exists());
    assert!(out.join("sweep.json").exists());
    // rebuild from the stored JSON without a server
    std::fs::remove_file(out.join("report.md")).unwrap();
    a.render_only = true;
    let e2 = rt.block_on(quiver_bench::sweep::sweep(&a)).unwrap();
    assert_eq!(e2.len(), 6);
    assert_eq!(std::fs::read_to_string(out.join("report.md")).unwrap(), md.replace(&e[0].report.date, &e2[0].report.date));
}

#[test]
fn flaky_server_counts_add_up_and_json_has_every_field() {
    let f = start(Mode::Flaky);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sub/result.json");
    let mut a = args(&f.url, 6, 3);
    a.max_concurrency = Some(1); // serialize so the server's counter alternates deterministically
    a.request_rate = 200.0;
    a.output_json = Some(out.clone());
    a.save_detailed = true;
    a.lora_names = vec!["x".into()];
    a.base_share = 0.5;
    quiver_bench::run_serve(a).unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for k in [
        "bench",
        "date",
        "model",
        "config",
        "warmup_failed",
        "num_requests",
        "completed",
        "failed",
        "errors",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_token_throughput",
        "peak_output_throughput",
        "concurrency",
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2el_ms",
        "per_adapter",
        "requests",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v:#}");
    }
    for k in ["count", "mean", "median", "std", "p90", "p99", "min", "max"] {
        assert!(v["ttft_ms"].get(k).is_some(), "missing ttft_ms.{k}");
    }
    assert_eq!(v["bench"], "serve");
    assert_eq!(v["config"]["num_prompts"], 6);
    assert!(v["config"].get("api_key").is_none());
    assert_eq!(v["num_requests"], 6);
    assert_eq!(v["completed"], 3);
    assert_eq!(v["failed"], 3);
    assert_eq!(v["errors"]["HTTP 503"], 3);
    assert_eq!(v["total_output_tokens"], 9);
    assert_eq!(v["total_input_tokens"], 36);
    assert_eq!(v["requests"].as_array().unwrap().len(), 6);
    let per: usize = v["per_adapter"].as_array().unwrap().iter().map(|p| p["completed"].as_u64().unwrap() as usize + p["failed"].as_u64().unwrap() as usize).sum();
    assert_eq!(per, 6);
}
