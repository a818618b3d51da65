//! Prometheus text exposition, rendered by hand: per-adapter request counters and latency
//! histograms recorded by the HTTP layer, plus engine gauges read at scrape time. Names follow
//! vLLM's (`vllm:` prefix) where a LoRA-aware router or dashboard expects them.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::{FinishReason, Stats};

const TTFT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0];
const E2E_BUCKETS: &[f64] = &[0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0];

#[derive(Clone, Debug)]
struct Histogram {
    buckets: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Histogram { buckets, counts: vec![0; buckets.len()], sum: 0.0, count: 0 }
    }
    fn observe(&mut self, v: f64) {
        for (i, &b) in self.buckets.iter().enumerate() {
            if v <= b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

#[derive(Clone, Debug)]
struct PerModel {
    /// finished requests by finish reason (stop/length/abort/error)
    finished: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

impl Default for PerModel {
    fn default() -> Self {
        PerModel { finished: BTreeMap::new(), prompt_tokens: 0, generation_tokens: 0, ttft: Histogram::new(TTFT_BUCKETS), itl: Histogram::new(ITL_BUCKETS), e2e: Histogram::new(E2E_BUCKETS) }
    }
}

#[derive(Default)]
struct Inner {
    /// Keyed by adapter name ("" = base).
    per: BTreeMap<String, PerModel>,
    /// HTTP responses by (route, status).
    http: BTreeMap<(String, u16), u64>,
    rejected: BTreeMap<(String, &'static str), u64>,
}

/// What the HTTP layer records. One mutex: a few updates per token are cheap next to a step.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn fmt_f(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf".into() } else { "-Inf".into() }
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

impl Metrics {
    pub fn first_token(&self, adapter: &str, ttft: Duration) {
        self.inner.lock().unwrap().per.entry(adapter.to_string()).or_default().ttft.observe(ttft.as_secs_f64());
    }
    pub fn inter_token(&self, adapter: &str, d: Duration) {
        self.inner.lock().unwrap().per.entry(adapter.to_string()).or_default().itl.observe(d.as_secs_f64());
    }
    /// One finished sequence (`reason` None = error).
    pub fn finished(&self, adapter: &str, reason: Option<FinishReason>, prompt_tokens: usize, completion_tokens: usize, e2e: Duration) {
        let mut g = self.inner.lock().unwrap();
        let p = g.per.entry(adapter.to_string()).or_default();
        *p.finished.entry(reason.map_or("error", FinishReason::as_str)).or_default() += 1;
        p.prompt_tokens += prompt_tokens as u64;
        p.generation_tokens += completion_tokens as u64;
        p.e2e.observe(e2e.as_secs_f64());
    }
    pub fn http(&self, route: &str, status: u16) {
        *self.inner.lock().unwrap().http.entry((route.to_string(), status)).or_default() += 1;
    }
    /// A request refused before it ran (queue full, too long, unknown adapter...).
    pub fn rejected(&self, adapter: &str, why: &'static str) {
        *self.inner.lock().unwrap().rejected.entry((adapter.to_string(), why)).or_default() += 1;
    }

    /// Drops every series of `adapter` (it was unloaded): names come and go, series must too.
    pub fn forget_adapter(&self, adapter: &str) {
        self.retain_adapters(|a| a != adapter);
    }

    /// Keeps the per-adapter series of base and of adapters for which `keep` holds.
    pub fn retain_adapters(&self, keep: impl Fn(&str) -> bool) {
        let mut g = self.inner.lock().unwrap();
        g.per.retain(|a, _| a.is_empty() || keep(a));
        g.rejected.retain(|(a, _), _| a.is_empty() || keep(a));
    }

    /// Prometheus text format 0.0.4.
    pub fn render(&self, served: &str, stats: &Stats) -> String {
        let g = self.inner.lock().unwrap();
        let mut o = String::new();
        let model = esc(served);
        let lbl = |adapter: &str| format!("model_name=\"{}\",adapter=\"{}\"", if adapter.is_empty() { model.clone() } else { esc(adapter) }, esc(adapter));

        let _ = writeln!(o, "# HELP vllm:num_requests_running Requests in the running batch.\n# TYPE vllm:num_requests_running gauge");
        let _ = writeln!(o, "vllm:num_requests_running{{model_name=\"{model}\"}} {}", stats.running);
        let _ = writeln!(o, "# HELP vllm:num_requests_waiting Requests waiting to be scheduled.\n# TYPE vllm:num_requests_waiting gauge");
        let _ = writeln!(o, "vllm:num_requests_waiting{{model_name=\"{model}\"}} {}", stats.waiting);
        let _ = writeln!(o, "# HELP vllm:kv_cache_usage_perc KV-cache usage, 1 = full.\n# TYPE vllm:kv_cache_usage_perc gauge");
        let _ = writeln!(o, "vllm:kv_cache_usage_perc{{model_name=\"{model}\"}} {}", fmt_f(stats.kv_usage));
        let _ = writeln!(o, "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.\n# TYPE vllm:prefix_cache_queries_total counter");
        let _ = writeln!(o, "vllm:prefix_cache_queries_total{{model_name=\"{model}\"}} {}", stats.prefix_cache_queries);
        let _ = writeln!(o, "# HELP vllm:prefix_cache_hits_total Prompt tokens served from the prefix cache.\n# TYPE vllm:prefix_cache_hits_total counter");
        let _ = writeln!(o, "vllm:prefix_cache_hits_total{{model_name=\"{model}\"}} {}", stats.prefix_cache_hits);

        // The LoRA-affinity gauge routers read (value: time of this report).
        let mut running: Vec<&str> = stats.adapters.iter().filter(|a| a.running > 0).map(|a| a.name.as_str()).collect();
        let mut waiting: Vec<&str> = stats.adapters.iter().filter(|a| a.waiting > 0).map(|a| a.name.as_str()).collect();
        running.sort_unstable();
        waiting.sort_unstable();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let _ = writeln!(o, "# HELP vllm:lora_requests_info Running stats on LoRA requests.\n# TYPE vllm:lora_requests_info gauge");
        let _ = writeln!(
            o,
            "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
            stats.max_loras,
            esc(&running.join(",")),
            esc(&waiting.join(",")),
            fmt_f(now)
        );
        let _ = writeln!(o, "# HELP quiver:adapter_requests_running Running requests per adapter.\n# TYPE quiver:adapter_requests_running gauge");
        for a in &stats.adapters {
            let _ = writeln!(o, "quiver:adapter_requests_running{{{}}} {}", lbl(&a.name), a.running);
        }
        let _ = writeln!(o, "# HELP quiver:adapter_requests_waiting Waiting requests per adapter.\n# TYPE quiver:adapter_requests_waiting gauge");
        for a in &stats.adapters {
            let _ = writeln!(o, "quiver:adapter_requests_waiting{{{}}} {}", lbl(&a.name), a.waiting);
        }
        let _ = writeln!(o, "# HELP quiver:adapter_loads_total Adapter loads from disk (replaces included).\n# TYPE quiver:adapter_loads_total counter");
        let _ = writeln!(o, "quiver:adapter_loads_total {}", stats.adapter_loads);
        let _ = writeln!(o, "# HELP quiver:adapter_load_failures_total Failed adapter loads.\n# TYPE quiver:adapter_load_failures_total counter");
        let _ = writeln!(o, "quiver:adapter_load_failures_total {}", stats.adapter_load_failures);
        let _ = writeln!(o, "# HELP quiver:lora_slot_loads_total Adapter loads into the LoRA slot pool.\n# TYPE quiver:lora_slot_loads_total counter");
        let _ = writeln!(o, "quiver:lora_slot_loads_total {}", stats.slot_loads);
        let _ = writeln!(o, "# HELP quiver:preemptions_total Sequences preempted for KV space.\n# TYPE quiver:preemptions_total counter");
        let _ = writeln!(o, "quiver:preemptions_total {}", stats.preemptions);
        let _ = writeln!(o, "# HELP quiver:adapter_evictions_total Adapter evictions from the slot pool.\n# TYPE quiver:adapter_evictions_total counter");
        let _ = writeln!(o, "quiver:adapter_evictions_total {}", stats.adapter_evictions);

        let _ = writeln!(o, "# HELP vllm:request_success_total Finished requests by finish reason.\n# TYPE vllm:request_success_total counter");
        for (a, p) in &g.per {
            for (r, c) in &p.finished {
                let _ = writeln!(o, "vllm:request_success_total{{{},finished_reason=\"{r}\"}} {c}", lbl(a));
            }
        }
        let _ = writeln!(o, "# HELP quiver:requests_rejected_total Requests refused before running.\n# TYPE quiver:requests_rejected_total counter");
        for ((a, why), c) in &g.rejected {
            let _ = writeln!(o, "quiver:requests_rejected_total{{{},reason=\"{why}\"}} {c}", lbl(a));
        }
        let _ = writeln!(o, "# HELP vllm:prompt_tokens_total Prefill tokens processed.\n# TYPE vllm:prompt_tokens_total counter");
        for (a, p) in &g.per {
            let _ = writeln!(o, "vllm:prompt_tokens_total{{{}}} {}", lbl(a), p.prompt_tokens);
        }
        let _ = writeln!(o, "# HELP vllm:generation_tokens_total Generated tokens.\n# TYPE vllm:generation_tokens_total counter");
        for (a, p) in &g.per {
            let _ = writeln!(o, "vllm:generation_tokens_total{{{}}} {}", lbl(a), p.generation_tokens);
        }
        for (name, help, pick) in [
            ("vllm:time_to_first_token_seconds", "Time to first token.", 0),
            ("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", 1),
            ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", 2),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (a, p) in &g.per {
                let h = [&p.ttft, &p.itl, &p.e2e][pick];
                let l = lbl(a);
                for (b, c) in h.buckets.iter().zip(&h.counts) {
                    let _ = writeln!(o, "{name}_bucket{{{l},le=\"{}\"}} {c}", fmt_f(*b));
                }
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"+Inf\"}} {}", h.count);
                let _ = writeln!(o, "{name}_sum{{{l}}} {}", fmt_f(h.sum));
                let _ = writeln!(o, "{name}_count{{{l}}} {}", h.count);
            }
        }
        let _ = writeln!(o, "# HELP quiver:http_responses_total HTTP responses by route and status.\n# TYPE quiver:http_responses_total counter");
        for ((route, status), c) in &g.http {
            let _ = writeln!(o, "quiver:http_responses_total{{route=\"{}\",status=\"{status}\"}} {c}", esc(route));
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AdapterStats;

    #[test]
    fn renders_histograms_and_lora_gauge() {
        let m = Metrics::default();
        m.first_token("", Duration::from_millis(30));
        m.first_token("a", Duration::from_millis(3));
        m.inter_token("a", Duration::from_millis(12));
        m.finished("a", Some(FinishReason::Length), 5, 7, Duration::from_millis(200));
        m.http("/v1/completions", 200);
        let stats = Stats {
            running: 2,
            waiting: 1,
            adapters: vec![AdapterStats { name: "a".into(), running: 1, waiting: 0 }, AdapterStats { name: "b\"q".into(), running: 0, waiting: 1 }],
            max_loras: 4,
            ..Default::default()
        };
        let t = m.render("base", &stats);
        assert!(t.contains("vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a\",waiting_lora_adapters=\"b\\\"q\"}"));
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"a\",adapter=\"a\",le=\"0.005\"} 1"));
        assert!(t.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"base\",adapter=\"\",le=\"0.02\"} 0"));
        assert!(t.contains("vllm:generation_tokens_total{model_name=\"a\",adapter=\"a\"} 7"));
        assert!(t.contains("vllm:request_success_total{model_name=\"a\",adapter=\"a\",finished_reason=\"length\"} 1"));
        // Every non-comment line is `name{labels} value` or `name value`.
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok() || v == "+Inf", "{line}");
        }
    }
}
