//! The `--output-json` convention shared by every `quiver bench` command (serve, sweep and the
//! microbenchmarks such as `bench generate` / LoRA kernels): one pretty-printed JSON object with
//! `"bench"` (the subcommand), `"date"` (RFC 3339 UTC), `"host"` (where it ran), `"config"` (the
//! settings) and the results at top level.

use serde::Serialize;
use serde_json::{json, Map, Value};

/// This machine: OS, architecture, logical CPUs, CPU model (from /proc/cpuinfo when available).
pub fn host_info() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()));
    json!({
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "cpu_model": cpu,
    })
}

/// Build a microbenchmark result object: `{"bench", "date", "host", "config", ...results}`.
/// `results` must serialize to a JSON object; its keys go to the top level.
pub fn bench_json<C: Serialize, R: Serialize>(bench: &str, config: &C, results: &R) -> anyhow::Result<Value> {
    let mut m = Map::new();
    m.insert("bench".into(), json!(bench));
    m.insert("date".into(), json!(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)));
    m.insert("host".into(), host_info());
    m.insert("config".into(), serde_json::to_value(config)?);
    match serde_json::to_value(results)? {
        Value::Object(r) => m.extend(r),
        other => {
            m.insert("results".into(), other);
        }
    }
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    #[test]
    fn convention() {
        let v = super::bench_json("generate", &serde_json::json!({"batch_sizes": [1, 4]}), &serde_json::json!({"prefill_tok_s": 10.0})).unwrap();
        for k in ["bench", "date", "host", "config", "prefill_tok_s"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert!(v["host"]["cpus"].as_u64().unwrap() >= 1);
        let v = super::bench_json("x", &1, &[1, 2]).unwrap();
        assert_eq!(v["results"], serde_json::json!([1, 2]));
    }
}
