//! Serving metrics (REFERENCE.md §6.3), computed from per-request timings.
//!
//! All times inside [`RequestOutcome`] are seconds; everything in [`Summary`] that ends in `_ms`
//! is milliseconds (like vLLM/SGLang `bench_serving`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What happened to one request, measured on the client.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestOutcome {
    /// Adapter name, or `None` for the base model.
    pub adapter: Option<String>,
    pub success: bool,
    /// Failure reason (`None` on success).
    pub error: Option<String>,
    /// Prompt tokens: the server's `usage.prompt_tokens` when reported, else the client's count.
    pub input_tokens: usize,
    /// Completion tokens: the server's `usage.completion_tokens` when reported, else the number of
    /// content chunks.
    pub output_tokens: usize,
    /// `max_tokens` we asked for.
    pub max_tokens: usize,
    /// Send time, seconds since the benchmark start.
    pub start: f64,
    /// send → first content chunk, seconds.
    pub ttft: f64,
    /// Gaps between consecutive content chunks, seconds.
    pub itl: Vec<f64>,
    /// send → end of response, seconds.
    pub e2e: f64,
    /// Number of content chunks received.
    pub chunks: usize,
}

impl RequestOutcome {
    /// `(E2E − TTFT)/(output_tokens − 1)`, only defined when more than one token came back.
    pub fn tpot(&self) -> Option<f64> {
        if self.success && self.output_tokens > 1 {
            Some((self.e2e - self.ttft) / (self.output_tokens as f64 - 1.0))
        } else {
            None
        }
    }

    /// Times (seconds since benchmark start) of each content chunk.
    pub fn chunk_times(&self) -> Vec<f64> {
        if self.chunks == 0 {
            return Vec::new();
        }
        let mut t = self.start + self.ttft;
        let mut v = vec![t];
        for g in &self.itl {
            t += g;
            v.push(t);
        }
        v
    }
}

/// Percentile with linear interpolation between closest ranks (numpy's default `linear` method).
/// `p` in [0, 100]. `None` for an empty slice.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(percentile_sorted(&v, p))
}

fn percentile_sorted(v: &[f64], p: f64) -> f64 {
    let n = v.len();
    if n == 1 {
        return v[0];
    }
    let idx = (p.clamp(0.0, 100.0) / 100.0) * (n as f64 - 1.0);
    let lo = idx.floor() as usize;
    let hi = idx.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (idx - lo as f64)
}

/// Distribution summary of one latency metric, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    /// Population standard deviation (numpy `std`).
    pub std: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    /// Summary of `seconds`, reported in milliseconds. All zeros when empty.
    pub fn from_seconds(seconds: &[f64]) -> Stats {
        if seconds.is_empty() {
            return Stats::default();
        }
        let mut v: Vec<f64> = seconds.iter().map(|s| s * 1000.0).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        Stats {
            count: v.len(),
            mean,
            median: percentile_sorted(&v, 50.0),
            std: var.sqrt(),
            p90: percentile_sorted(&v, 90.0),
            p99: percentile_sorted(&v, 99.0),
            min: v[0],
            max: v[v.len() - 1],
        }
    }
}

/// Per-adapter (or base) slice of a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdapterSummary {
    /// Adapter name, `"<base>"` for base-model requests.
    pub adapter: String,
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub output_throughput: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2el_ms: Stats,
}

/// The result table of one run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    /// Requests attempted in the measured run (warmup excluded).
    pub num_requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Failure reason (category) → count.
    pub errors: BTreeMap<String, usize>,
    /// Benchmark duration: start → last request finished, seconds.
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Completed requests / s.
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Max output tokens in any 1-second window (bucketed from chunk arrival times).
    pub peak_output_throughput: f64,
    /// Σ E2E of completed requests / duration (SGLang's `concurrency`).
    pub concurrency: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2el_ms: Stats,
    pub per_adapter: Vec<AdapterSummary>,
}

/// The short category of a failure reason, used as the key of [`Summary::errors`]: the text
/// before the first `:` (e.g. `"HTTP 500"`, `"malformed SSE"`, `"connection failed"`).
pub fn error_category(reason: &str) -> String {
    reason.split(':').next().unwrap_or(reason).trim().to_string()
}

struct Agg<'a> {
    ok: Vec<&'a RequestOutcome>,
}

impl<'a> Agg<'a> {
    fn ttft(&self) -> Vec<f64> {
        self.ok.iter().map(|r| r.ttft).collect()
    }
    fn e2e(&self) -> Vec<f64> {
        self.ok.iter().map(|r| r.e2e).collect()
    }
    fn tpot(&self) -> Vec<f64> {
        self.ok.iter().filter_map(|r| r.tpot()).collect()
    }
    fn itl(&self) -> Vec<f64> {
        self.ok.iter().flat_map(|r| r.itl.iter().copied()).collect()
    }
    fn input(&self) -> usize {
        self.ok.iter().map(|r| r.input_tokens).sum()
    }
    fn output(&self) -> usize {
        self.ok.iter().map(|r| r.output_tokens).sum()
    }
}

/// Peak output tokens per second: chunk arrival times bucketed into 1-second windows from the
/// benchmark start; a request whose server-reported token count differs from its chunk count has
/// each chunk weighted by `output_tokens / chunks`. A run shorter than a second reports its tokens
/// over its duration.
pub fn peak_output_throughput(outcomes: &[RequestOutcome], duration: f64) -> f64 {
    if duration <= 0.0 {
        return 0.0;
    }
    let nb = duration.ceil().max(1.0) as usize;
    let mut buckets = vec![0.0f64; nb + 1];
    for r in outcomes.iter().filter(|r| r.success && r.chunks > 0) {
        let w = r.output_tokens as f64 / r.chunks as f64;
        for t in r.chunk_times() {
            let b = (t.max(0.0).floor() as usize).min(nb);
            buckets[b] += w;
        }
    }
    if duration < 1.0 {
        return buckets.iter().sum::<f64>() / duration;
    }
    buckets.into_iter().fold(0.0, f64::max)
}

/// Summarize a run. `duration` (seconds) is benchmark start → last request finished.
pub fn summarize(outcomes: &[RequestOutcome], duration: f64) -> Summary {
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|r| r.success).collect();
    let all = Agg { ok };
    let mut errors = BTreeMap::new();
    for r in outcomes.iter().filter(|r| !r.success) {
        let reason = r.error.as_deref().unwrap_or("unknown");
        *errors.entry(error_category(reason)).or_insert(0) += 1;
    }
    // `+ 0.0` turns the -0.0 of an empty f64 sum into 0.0
    let per_sec = |x: f64| if duration > 0.0 { x / duration + 0.0 } else { 0.0 };
    let (inp, out) = (all.input(), all.output());

    // Per adapter: base first, then adapters by name.
    let mut names: Vec<Option<String>> = Vec::new();
    for r in outcomes {
        if !names.contains(&r.adapter) {
            names.push(r.adapter.clone());
        }
    }
    names.sort_by(|a, b| (a.is_some(), a).cmp(&(b.is_some(), b)));
    let per_adapter = if names.len() > 1 || names.first().is_some_and(|n| n.is_some()) {
        names
            .iter()
            .map(|name| {
                let mine: Vec<&RequestOutcome> = outcomes.iter().filter(|r| &r.adapter == name).collect();
                let a = Agg { ok: mine.iter().copied().filter(|r| r.success).collect() };
                AdapterSummary {
                    adapter: name.clone().unwrap_or_else(|| "<base>".into()),
                    completed: a.ok.len(),
                    failed: mine.len() - a.ok.len(),
                    total_input_tokens: a.input(),
                    total_output_tokens: a.output(),
                    output_throughput: per_sec(a.output() as f64),
                    ttft_ms: Stats::from_seconds(&a.ttft()),
                    tpot_ms: Stats::from_seconds(&a.tpot()),
                    itl_ms: Stats::from_seconds(&a.itl()),
                    e2el_ms: Stats::from_seconds(&a.e2e()),
                }
            })
            .collect()
    } else {
        Vec::new()
    };

    Summary {
        num_requests: outcomes.len(),
        completed: all.ok.len(),
        failed: outcomes.len() - all.ok.len(),
        errors,
        duration_s: duration,
        total_input_tokens: inp,
        total_output_tokens: out,
        request_throughput: per_sec(all.ok.len() as f64),
        input_throughput: per_sec(inp as f64),
        output_throughput: per_sec(out as f64),
        total_token_throughput: per_sec((inp + out) as f64),
        peak_output_throughput: peak_output_throughput(outcomes, duration),
        concurrency: per_sec(all.e2e().iter().sum()),
        ttft_ms: Stats::from_seconds(&all.ttft()),
        tpot_ms: Stats::from_seconds(&all.tpot()),
        itl_ms: Stats::from_seconds(&all.itl()),
        e2el_ms: Stats::from_seconds(&all.e2e()),
        per_adapter,
    }
}

/// The familiar `bench_serving` result table.
pub fn format_table(s: &Summary, title: &str) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let w = 50;
    let line = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{:<40}{:>10}", k, v);
    };
    let _ = writeln!(o, "{:=^w$}", format!(" {title} "));
    line(&mut o, "Successful requests:", s.completed.to_string());
    line(&mut o, "Failed requests:", s.failed.to_string());
    for (k, v) in &s.errors {
        line(&mut o, &format!("  {k}:"), v.to_string());
    }
    line(&mut o, "Benchmark duration (s):", format!("{:.2}", s.duration_s));
    line(&mut o, "Total input tokens:", s.total_input_tokens.to_string());
    line(&mut o, "Total generated tokens:", s.total_output_tokens.to_string());
    line(&mut o, "Request throughput (req/s):", format!("{:.2}", s.request_throughput));
    line(&mut o, "Input token throughput (tok/s):", format!("{:.2}", s.input_throughput));
    line(&mut o, "Output token throughput (tok/s):", format!("{:.2}", s.output_throughput));
    line(&mut o, "Peak output token throughput (tok/s):", format!("{:.2}", s.peak_output_throughput));
    line(&mut o, "Total token throughput (tok/s):", format!("{:.2}", s.total_token_throughput));
    line(&mut o, "Concurrency:", format!("{:.2}", s.concurrency));
    for (name, st) in [
        ("Time to First Token", &s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", &s.tpot_ms),
        ("Inter-token Latency", &s.itl_ms),
        ("End-to-end Latency", &s.e2el_ms),
    ] {
        let short = match name.chars().next() {
            Some('T') if name.starts_with("Time to") => "TTFT",
            Some('T') => "TPOT",
            Some('I') => "ITL",
            _ => "E2EL",
        };
        let _ = writeln!(o, "{:-^w$}", name);
        line(&mut o, &format!("Mean {short} (ms):"), format!("{:.2}", st.mean));
        line(&mut o, &format!("Median {short} (ms):"), format!("{:.2}", st.median));
        line(&mut o, &format!("P90 {short} (ms):"), format!("{:.2}", st.p90));
        line(&mut o, &format!("P99 {short} (ms):"), format!("{:.2}", st.p99));
    }
    if !s.per_adapter.is_empty() {
        let _ = writeln!(o, "{:-^w$}", "Per adapter");
        let _ = writeln!(
            o,
            "{:<20} {:>5} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "adapter", "ok", "fail", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "ITL p99", "E2E mean"
        );
        for a in &s.per_adapter {
            let mut name = a.adapter.clone();
            if name.chars().count() > 20 {
                name = name.chars().take(19).collect::<String>() + "…";
            }
            let _ = writeln!(
                o,
                "{:<20} {:>5} {:>5} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                name,
                a.completed,
                a.failed,
                a.output_throughput,
                a.ttft_ms.mean,
                a.ttft_ms.p99,
                a.tpot_ms.mean,
                a.tpot_ms.p99,
                a.itl_ms.p99,
                a.e2el_ms.mean
            );
        }
    }
    let _ = writeln!(o, "{:=^w$}", "");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * (1.0 + b.abs())
    }

    #[test]
    fn percentile_matches_numpy_linear() {
        // numpy.percentile([1,2,3,4], [50, 90, 99, 0, 100]) = [2.5, 3.7, 3.97, 1, 4]
        let v = [4.0, 1.0, 3.0, 2.0];
        assert!(close(percentile(&v, 50.0).unwrap(), 2.5));
        assert!(close(percentile(&v, 90.0).unwrap(), 3.7));
        assert!(close(percentile(&v, 99.0).unwrap(), 3.97));
        assert!(close(percentile(&v, 0.0).unwrap(), 1.0));
        assert!(close(percentile(&v, 100.0).unwrap(), 4.0));
        // numpy.percentile([10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 1000], 99) = 910.0
        let w: Vec<f64> = (1..=10).map(|i| i as f64 * 10.0).chain([1000.0]).collect();
        assert!(close(percentile(&w, 99.0).unwrap(), 910.0));
        assert!(close(percentile(&[7.0], 99.0).unwrap(), 7.0));
        assert!(percentile(&[], 50.0).is_none());
    }

    #[test]
    fn stats_in_ms() {
        let s = Stats::from_seconds(&[0.1, 0.2, 0.3, 0.4]);
        assert_eq!(s.count, 4);
        assert!(close(s.mean, 250.0));
        assert!(close(s.median, 250.0));
        assert!(close(s.p90, 370.0));
        assert!(close(s.p99, 397.0));
        // population std of 100,200,300,400 = sqrt(12500)
        assert!(close(s.std, 12500f64.sqrt()));
        assert!(close(s.min, 100.0) && close(s.max, 400.0));
        assert_eq!(Stats::from_seconds(&[]), Stats::default());
    }

    fn req(adapter: Option<&str>, start: f64, ttft: f64, itl: &[f64], out: usize, inp: usize) -> RequestOutcome {
        RequestOutcome {
            adapter: adapter.map(String::from),
            success: true,
            error: None,
            input_tokens: inp,
            output_tokens: out,
            max_tokens: out,
            start,
            ttft,
            itl: itl.to_vec(),
            e2e: ttft + itl.iter().sum::<f64>(),
            chunks: itl.len() + 1,
        }
    }

    #[test]
    fn tpot_definition() {
        // TTFT 0.2 s, then 4 more tokens 0.05 s apart: E2E 0.4, TPOT = 0.2/4 = 0.05
        let r = req(None, 0.0, 0.2, &[0.05; 4], 5, 10);
        assert!(close(r.e2e, 0.4));
        assert!(close(r.tpot().unwrap(), 0.05));
        // one output token: TPOT undefined
        let r1 = req(None, 0.0, 0.2, &[], 1, 10);
        assert!(r1.tpot().is_none());
        // server reports more tokens than chunks (multi-token chunks): TPOT uses usage count
        let mut r2 = req(None, 0.0, 0.1, &[0.1, 0.1], 5, 10);
        r2.output_tokens = 5;
        assert!(close(r2.tpot().unwrap(), 0.2 / 4.0));
    }

    #[test]
    fn summary_over_known_timeline() {
        // Two requests on a 2-second timeline.
        //  A: start 0.0, TTFT 0.5, chunks at 0.5, 1.0, 1.5 (ITL 0.5, 0.5), ends 1.5; in 100, out 3
        //  B: start 0.5, TTFT 0.25, chunks at 0.75, 1.25 (ITL 0.5), ends 1.25; in 50, out 2
        //  C: failed (HTTP 500)
        let a = req(Some("x"), 0.0, 0.5, &[0.5, 0.5], 3, 100);
        let b = req(None, 0.5, 0.25, &[0.5], 2, 50);
        let c = RequestOutcome {
            adapter: Some("x".into()),
            error: Some("HTTP 500: boom".into()),
            start: 1.0,
            ..Default::default()
        };
        let s = summarize(&[a, b, c], 2.0);
        assert_eq!((s.num_requests, s.completed, s.failed), (3, 2, 1));
        assert_eq!(s.errors.get("HTTP 500"), Some(&1));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (150, 5));
        assert!(close(s.request_throughput, 1.0));
        assert!(close(s.input_throughput, 75.0));
        assert!(close(s.output_throughput, 2.5));
        assert!(close(s.total_token_throughput, 77.5));
        // concurrency = (1.5 + 0.75) / 2
        assert!(close(s.concurrency, 1.125));
        // chunk times: 0.5, 1.0, 1.5, 0.75, 1.25 → bucket [0,1): 2, [1,2): 3
        assert!(close(s.peak_output_throughput, 3.0));
        // TTFT over requests: 500, 250 ms
        assert!(close(s.ttft_ms.mean, 375.0));
        assert!(close(s.ttft_ms.median, 375.0));
        // ITL pooled: 500, 500, 500 ms
        assert_eq!(s.itl_ms.count, 3);
        assert!(close(s.itl_ms.mean, 500.0));
        // TPOT: A (1.5-0.5)/2 = 0.5, B (0.75-0.25)/1 = 0.5
        assert!(close(s.tpot_ms.mean, 500.0));
        // E2E: 1500, 750
        assert!(close(s.e2el_ms.p90, 750.0 + 0.9 * 750.0));
        // per adapter: base first, then x (1 ok, 1 failed)
        assert_eq!(s.per_adapter.len(), 2);
        assert_eq!(s.per_adapter[0].adapter, "<base>");
        assert_eq!((s.per_adapter[1].completed, s.per_adapter[1].failed), (1, 1));
        assert!(close(s.per_adapter[1].output_throughput, 1.5));
        let t = format_table(&s, "Serving Benchmark Result");
        assert!(t.contains("Successful requests:") && t.contains("HTTP 500") && t.contains("Per adapter"));
    }

    #[test]
    fn empty_run_summarizes_to_zeros() {
        let s = summarize(&[], 0.0);
        assert_eq!(s.completed, 0);
        let f = RequestOutcome { error: Some("connection failed: x".into()), ..Default::default() };
        let s2 = summarize(&[f], 0.5);
        assert!(s2.concurrency.is_sign_positive() && s2.concurrency == 0.0);
        assert_eq!(s.request_throughput, 0.0);
        assert!(format_table(&s, "x").contains("Failed requests:"));
    }

    #[test]
    fn peak_weights_multi_token_chunks() {
        // one request, 2 chunks in second 0, usage says 6 tokens → 3 tokens per chunk → peak 6
        let mut r = req(None, 0.0, 0.1, &[0.1], 6, 1);
        r.output_tokens = 6;
        assert!(close(peak_output_throughput(&[r], 2.0), 6.0));
    }
}
