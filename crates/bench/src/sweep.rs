//! `quiver bench sweep`: scenarios × adapter configurations from a TOML file, run one after the
//! other with `bench serve`; writes per-run JSON, a markdown report (results + "cost of LoRA vs
//! base") and SVG plots of throughput/latency vs concurrency.
//!
//! Scenario file (see `bench/scenarios/smollm2.toml`):
//! ```toml
//! base_url = "http://127.0.0.1:8000"   # defaults for every run; CLI flags override
//! endpoint = "completions"              # completions | chat
//! adapter_style = "model"               # model | sglang | llamacpp
//! num_prompts = 64
//! min_prompts_per_concurrency = 4       # num_prompts ≥ 4 × concurrency
//! warmup_requests = 2
//! ignore_eos = true
//! extra_body = { top_k = 1 }
//!
//! [[scenario]]
//! name = "decode"                       # concurrency list → decode_1, decode_4, … (group "decode")
//! input_len = 16
//! output_len = 96
//! concurrency = [1, 4, 16, 64]
//!
//! [[config]]
//! name = "base"                         # no lora_names = the base-only control
//! [[config]]
//! name = "4-distinct"
//! lora_names = ["a0", "a1", "a2", "a3"]
//! distribution = "distinct"             # uniform | distinct | skewed (+ zipf_alpha, base_share)
//! ```

use crate::metrics::{Stats, Summary};
use crate::serve::{self, AdapterStyle, DatasetName, Endpoint, LoraDistribution, ServeBenchArgs, ServeReport};
use crate::svg;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Flags of `quiver bench sweep`.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// Scenario file (TOML).
    #[arg(long)]
    pub scenarios: PathBuf,
    /// Output directory: results/*.json, report.md, plots/*.svg.
    #[arg(long)]
    pub out_dir: PathBuf,
    /// Override the file's base_url.
    #[arg(long)]
    pub base_url: Option<String>,
    /// Override the file's model.
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum)]
    pub endpoint: Option<Endpoint>,
    #[arg(long, value_enum)]
    pub adapter_style: Option<AdapterStyle>,
    /// JSON object merged into every request body (replaces the file's extra_body).
    #[arg(long)]
    pub extra_body: Option<String>,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Run only these scenarios (expanded names like decode_4, or a group like decode).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Run only these configurations.
    #[arg(long, value_delimiter = ',')]
    pub configs: Vec<String>,
    /// Do not run anything: rebuild report.md and the plots from out-dir/results/*.json.
    #[arg(long)]
    pub render_only: bool,
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(usize),
    Many(Vec<usize>),
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Rate {
    Num(f64),
    Str(String),
}

impl Rate {
    fn value(&self) -> Result<f64> {
        match self {
            Rate::Num(x) => Ok(*x),
            Rate::Str(s) => s.trim().parse::<f64>().with_context(|| format!("request_rate {s:?}")),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSpec {
    pub name: String,
    pub input_len: usize,
    pub output_len: usize,
    /// Max concurrency; a list expands into `<name>_<C>` scenarios of group `<name>`.
    #[serde(default)]
    pub concurrency: Option<OneOrMany>,
    #[serde(default)]
    pub num_prompts: Option<usize>,
    #[serde(default)]
    pub request_rate: Option<Rate>,
    /// Length spread (SGLang semantics); default 1.0 = exact lengths.
    #[serde(default)]
    pub range_ratio: Option<f64>,
    /// Plot group (default: the name without a trailing `_<number>`).
    #[serde(default)]
    pub group: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigSpec {
    pub name: String,
    #[serde(default)]
    pub lora_names: Vec<String>,
    #[serde(default)]
    pub distribution: Option<LoraDistribution>,
    #[serde(default)]
    pub zipf_alpha: Option<f64>,
    #[serde(default)]
    pub base_share: Option<f64>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SweepFile {
    #[serde(default)]
    pub base_url: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub endpoint: Option<Endpoint>,
    #[serde(default)]
    pub adapter_style: Option<AdapterStyle>,
    #[serde(default)]
    pub num_prompts: Option<usize>,
    #[serde(default)]
    pub min_prompts_per_concurrency: Option<usize>,
    #[serde(default)]
    pub warmup_requests: Option<usize>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub request_rate: Option<Rate>,
    #[serde(default)]
    pub random_vocab_size: Option<usize>,
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    #[serde(default)]
    pub timeout: Option<f64>,
    #[serde(default)]
    pub extra_body: Option<toml::Table>,
    #[serde(default, rename = "scenario")]
    pub scenarios: Vec<ScenarioSpec>,
    #[serde(default, rename = "config")]
    pub configs: Vec<ConfigSpec>,
}

/// One expanded scenario (a single concurrency).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub group: String,
    pub input_len: usize,
    pub output_len: usize,
    pub concurrency: Option<usize>,
    pub num_prompts: usize,
    /// Requests/s; infinity is written as `"inf"` (JSON has no infinity).
    #[serde(with = "inf_f64")]
    pub request_rate: f64,
    pub range_ratio: f64,
}

mod inf_f64 {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_str("inf")
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Option::<super::Rate>::deserialize(d)? {
            None => Ok(f64::INFINITY),
            Some(r) => r.value().map_err(serde::de::Error::custom),
        }
    }
}

fn default_group(name: &str) -> String {
    match name.rsplit_once('_') {
        Some((g, n)) if !g.is_empty() && !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => g.to_string(),
        _ => name.to_string(),
    }
}

impl SweepFile {
    pub fn parse(text: &str) -> Result<SweepFile> {
        let f: SweepFile = toml::from_str(text)?;
        if f.scenarios.is_empty() {
            bail!("no [[scenario]] entries");
        }
        if f.configs.is_empty() {
            bail!("no [[config]] entries");
        }
        Ok(f)
    }

    pub fn expand(&self) -> Result<Vec<Scenario>> {
        let global_rate = self.request_rate.as_ref().map(|r| r.value()).transpose()?.unwrap_or(f64::INFINITY);
        let mut out = Vec::new();
        for s in &self.scenarios {
            let (concs, expand): (Vec<Option<usize>>, bool) = match &s.concurrency {
                None => (vec![None], false),
                Some(OneOrMany::One(c)) => (vec![Some(*c)], false),
                Some(OneOrMany::Many(v)) => (v.iter().map(|c| Some(*c)).collect(), true),
            };
            for c in concs {
                let name = match (expand, c) {
                    (true, Some(c)) => format!("{}_{c}", s.name),
                    _ => s.name.clone(),
                };
                let group = s.group.clone().unwrap_or_else(|| if expand { s.name.clone() } else { default_group(&s.name) });
                let base_n = s.num_prompts.or(self.num_prompts).unwrap_or(64);
                let min_n = self.min_prompts_per_concurrency.unwrap_or(0) * c.unwrap_or(1);
                let num_prompts = if s.num_prompts.is_some() { base_n } else { base_n.max(min_n) };
                out.push(Scenario {
                    name,
                    group,
                    input_len: s.input_len,
                    output_len: s.output_len,
                    concurrency: c,
                    num_prompts,
                    request_rate: s.request_rate.as_ref().map(|r| r.value()).transpose()?.unwrap_or(global_rate),
                    range_ratio: s.range_ratio.unwrap_or(1.0),
                });
            }
        }
        let mut seen = std::collections::HashSet::new();
        for s in &out {
            if !seen.insert(&s.name) {
                bail!("duplicate scenario name {}", s.name);
            }
        }
        Ok(out)
    }
}

/// The `bench serve` settings of one scenario × configuration.
pub fn serve_args(f: &SweepFile, a: &SweepArgs, s: &Scenario, c: &ConfigSpec) -> Result<ServeBenchArgs> {
    let d = ServeBenchArgs::default();
    let extra_body = match (&a.extra_body, &f.extra_body) {
        (Some(e), _) => Some(e.clone()),
        (None, Some(t)) => Some(serde_json::to_string(t)?),
        _ => None,
    };
    Ok(ServeBenchArgs {
        base_url: a.base_url.clone().or(f.base_url.clone()).unwrap_or(d.base_url),
        endpoint: a.endpoint.or(f.endpoint).unwrap_or(d.endpoint),
        model: a.model.clone().or(f.model.clone()),
        lora_names: c.lora_names.clone(),
        lora_distribution: c.distribution.unwrap_or(LoraDistribution::Distinct),
        zipf_alpha: c.zipf_alpha.unwrap_or(d.zipf_alpha),
        base_share: c.base_share.unwrap_or(0.0),
        adapter_style: a.adapter_style.or(f.adapter_style).unwrap_or(d.adapter_style),
        dataset: DatasetName::Random,
        random_input_len: s.input_len,
        random_output_len: s.output_len,
        random_range_ratio: s.range_ratio,
        random_vocab_size: f.random_vocab_size.unwrap_or(d.random_vocab_size),
        tokenizer: f.tokenizer.clone(),
        num_prompts: s.num_prompts,
        request_rate: s.request_rate,
        max_concurrency: s.concurrency,
        warmup_requests: f.warmup_requests.unwrap_or(0),
        ignore_eos: f.ignore_eos.unwrap_or(true),
        seed: f.seed.unwrap_or(0),
        temperature: f.temperature.unwrap_or(0.0),
        extra_body,
        api_key: a.api_key.clone(),
        timeout: f.timeout.unwrap_or(d.timeout),
        output_json: None,
        save_detailed: false,
        no_progress: a.no_progress,
        ..d
    })
}

/// One finished run, as stored in `results/<scenario>__<config>.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepEntry {
    pub scenario: Scenario,
    pub config: ConfigSpec,
    pub report: ServeReport,
}

fn result_path(dir: &Path, s: &str, c: &str) -> PathBuf {
    let clean = |x: &str| x.chars().map(|ch| if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' || ch == '.' { ch } else { '_' }).collect::<String>();
    dir.join("results").join(format!("{}__{}.json", clean(s), clean(c)))
}

fn is_base(c: &ConfigSpec) -> bool {
    c.lora_names.is_empty()
}

fn pct(v: f64, base: f64) -> String {
    if base == 0.0 || !base.is_finite() || !v.is_finite() {
        "n/a".into()
    } else {
        format!("{:+.1}%", (v - base) / base * 100.0)
    }
}

fn ms(v: f64) -> String {
    format!("{v:.2}")
}

/// The markdown report: one results table and one "cost of LoRA vs base" table.
pub fn render_markdown(entries: &[SweepEntry], title: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# {title}\n");
    if let Some(e) = entries.first() {
        let _ = writeln!(
            o,
            "Server `{}`, model `{}`, endpoint `{}`, run {}. Times in ms; throughput in tokens/s (output) unless noted.\n",
            e.report.config.get("base_url").and_then(|v| v.as_str()).unwrap_or("?"),
            e.report.model,
            e.report.config.get("endpoint").and_then(|v| v.as_str()).unwrap_or("?"),
            e.report.date
        );
    }
    let _ = writeln!(o, "## Results\n");
    let _ = writeln!(
        o,
        "| scenario | config | in/out | conc | ok/fail | req/s | out tok/s | total tok/s | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | ITL mean | ITL p99 | E2E mean | E2E p99 |"
    );
    let _ = writeln!(o, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for e in entries {
        let s = &e.report.summary;
        let _ = writeln!(
            o,
            "| {} | {} | {}/{} | {} | {}/{} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |",
            e.scenario.name,
            e.config.name,
            e.scenario.input_len,
            e.scenario.output_len,
            e.scenario.concurrency.map(|c| c.to_string()).unwrap_or("∞".into()),
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            s.total_token_throughput,
            ms(s.ttft_ms.mean),
            ms(s.ttft_ms.p99),
            ms(s.tpot_ms.mean),
            ms(s.tpot_ms.p99),
            ms(s.itl_ms.mean),
            ms(s.itl_ms.p99),
            ms(s.e2el_ms.mean),
            ms(s.e2el_ms.p99),
        );
    }
    let failures: BTreeMap<String, usize> = entries.iter().flat_map(|e| e.report.summary.errors.iter()).fold(BTreeMap::new(), |mut m, (k, v)| {
        *m.entry(k.clone()).or_insert(0) += v;
        m
    });
    if !failures.is_empty() {
        let _ = writeln!(o, "\nFailed requests by reason: {}", failures.iter().map(|(k, v)| format!("{k} ×{v}")).collect::<Vec<_>>().join(", "));
    }
    let _ = writeln!(o, "\n## Cost of LoRA vs base\n");
    let _ = writeln!(
        o,
        "Δ% of each configuration against the base-only configuration of the same scenario (throughput: negative = slower; latency: positive = slower).\n"
    );
    let _ = writeln!(
        o,
        "| scenario | config | out tok/s | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | ITL mean | ITL p99 | E2E mean | E2E p99 |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut any = false;
    for e in entries.iter().filter(|e| !is_base(&e.config)) {
        let Some(b) = entries.iter().find(|b| b.scenario.name == e.scenario.name && is_base(&b.config)) else { continue };
        any = true;
        let (s, bs) = (&e.report.summary, &b.report.summary);
        let d = |f: fn(&Summary) -> &Stats, p99: bool| {
            let (x, y) = (f(s), f(bs));
            if p99 {
                pct(x.p99, y.p99)
            } else {
                pct(x.mean, y.mean)
            }
        };
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            e.scenario.name,
            e.config.name,
            pct(s.output_throughput, bs.output_throughput),
            d(|s| &s.ttft_ms, false),
            d(|s| &s.ttft_ms, true),
            d(|s| &s.tpot_ms, false),
            d(|s| &s.tpot_ms, true),
            d(|s| &s.itl_ms, false),
            d(|s| &s.itl_ms, true),
            d(|s| &s.e2el_ms, false),
            d(|s| &s.e2el_ms, true),
        );
    }
    if !any {
        let _ = writeln!(o, "| (no base-only configuration to compare against) | | | | | | | | | | |");
    }
    o
}

/// SVG plots (throughput, TTFT, TPOT, p99 ITL, E2E vs concurrency; one line per configuration)
/// per scenario group run at two or more concurrencies: (file name, svg).
pub fn render_plots(entries: &[SweepEntry]) -> Vec<(String, String)> {
    // groups with at least two concurrency levels
    let mut groups: Vec<String> = Vec::new();
    for e in entries {
        if e.scenario.concurrency.is_some() && !groups.contains(&e.scenario.group) {
            groups.push(e.scenario.group.clone());
        }
    }
    groups.retain(|g| {
        let mut c: Vec<usize> = entries.iter().filter(|e| &e.scenario.group == g).filter_map(|e| e.scenario.concurrency).collect();
        c.sort();
        c.dedup();
        c.len() >= 2
    });
    type Metric = (&'static str, &'static str, fn(&Summary) -> f64);
    let metrics: [Metric; 5] = [
        ("throughput", "output tokens/s", |s| s.output_throughput),
        ("ttft", "mean TTFT (ms)", |s| s.ttft_ms.mean),
        ("tpot", "mean TPOT (ms)", |s| s.tpot_ms.mean),
        ("itl_p99", "p99 ITL (ms)", |s| s.itl_ms.p99),
        ("e2e", "mean E2E latency (ms)", |s| s.e2el_ms.mean),
    ];
    let mut out = Vec::new();
    for g in groups {
        let mine: Vec<&SweepEntry> = entries.iter().filter(|e| e.scenario.group == g && e.scenario.concurrency.is_some()).collect();
        let mut cfgs: Vec<String> = Vec::new();
        for e in &mine {
            if !cfgs.contains(&e.config.name) {
                cfgs.push(e.config.name.clone());
            }
        }
        for (key, label, f) in metrics {
            let series: Vec<svg::Series> = cfgs
                .iter()
                .map(|c| svg::Series {
                    name: c.clone(),
                    points: mine
                        .iter()
                        .filter(|e| &e.config.name == c && e.report.summary.completed > 0)
                        .map(|e| (e.scenario.concurrency.unwrap() as f64, f(&e.report.summary)))
                        .collect(),
                })
                .collect();
            let title = format!("{g}: {label} vs concurrency");
            out.push((format!("{g}_{key}.svg"), svg::line_chart(&title, "max concurrency", label, &series, true)));
        }
    }
    out
}

fn write_reports(dir: &Path, entries: &[SweepEntry], title: &str) -> Result<()> {
    std::fs::create_dir_all(dir.join("plots"))?;
    let md = render_markdown(entries, title);
    std::fs::write(dir.join("report.md"), &md)?;
    let mut names = Vec::new();
    for (name, svg) in render_plots(entries) {
        std::fs::write(dir.join("plots").join(&name), svg)?;
        names.push(name);
    }
    serve::write_json(&dir.join("sweep.json"), &serde_json::json!({
        "bench": "sweep",
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "runs": entries.iter().map(|e| serde_json::json!({
            "scenario": e.scenario, "config": e.config, "summary": e.report.summary,
        })).collect::<Vec<_>>(),
    }))?;
    eprintln!("wrote {} , {} plot(s) under {}", dir.join("report.md").display(), names.len(), dir.join("plots").display());
    Ok(())
}

/// Run (or, with `render_only`, reload) the sweep and write the reports. Returns the entries.
pub async fn sweep(a: &SweepArgs) -> Result<Vec<SweepEntry>> {
    let text = std::fs::read_to_string(&a.scenarios).with_context(|| format!("reading {}", a.scenarios.display()))?;
    let f = SweepFile::parse(&text).with_context(|| format!("parsing {}", a.scenarios.display()))?;
    let scenarios: Vec<Scenario> = f
        .expand()?
        .into_iter()
        .filter(|s| a.only.is_empty() || a.only.iter().any(|o| o == &s.name || o == &s.group))
        .collect();
    let configs: Vec<&ConfigSpec> = f.configs.iter().filter(|c| a.configs.is_empty() || a.configs.contains(&c.name)).collect();
    if scenarios.is_empty() || configs.is_empty() {
        bail!("--only/--configs selected nothing");
    }
    let title = format!("Quiver sweep: {}", a.scenarios.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default());
    let mut entries = Vec::new();
    let total = scenarios.len() * configs.len();
    for s in &scenarios {
        for c in &configs {
            let path = result_path(&a.out_dir, &s.name, &c.name);
            if a.render_only {
                if let Ok(t) = std::fs::read_to_string(&path) {
                    entries.push(serde_json::from_str::<SweepEntry>(&t).with_context(|| format!("parsing {}", path.display()))?);
                }
                continue;
            }
            let args = serve_args(&f, a, s, c)?;
            eprintln!(
                "[{}/{total}] {} × {}: {} prompts, {}→{} tokens, concurrency {}",
                entries.len() + 1,
                s.name,
                c.name,
                s.num_prompts,
                s.input_len,
                s.output_len,
                s.concurrency.map(|c| c.to_string()).unwrap_or("∞".into())
            );
            let report = serve::bench_serve(&args).await.with_context(|| format!("scenario {} × {}", s.name, c.name))?;
            let sm = &report.summary;
            eprintln!(
                "    ok {}/{}  out {:.1} tok/s  TTFT {:.1} ms  TPOT {:.2} ms  E2E {:.1} ms{}",
                sm.completed,
                sm.num_requests,
                sm.output_throughput,
                sm.ttft_ms.mean,
                sm.tpot_ms.mean,
                sm.e2el_ms.mean,
                if sm.errors.is_empty() { String::new() } else { format!("  errors {:?}", sm.errors) }
            );
            let e = SweepEntry { scenario: s.clone(), config: (*c).clone(), report };
            serve::write_json(&path, &e)?;
            entries.push(e);
        }
    }
    if entries.is_empty() {
        bail!("no results under {}", a.out_dir.join("results").display());
    }
    write_reports(&a.out_dir, &entries, &title)?;
    Ok(entries)
}

/// `quiver bench sweep`.
pub fn run_sweep(a: SweepArgs) -> Result<()> {
    let rt = serve::runtime()?;
    let entries = rt.block_on(sweep(&a))?;
    let md = render_markdown(&entries, "Sweep");
    println!("{md}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
base_url = "http://x:1"
num_prompts = 8
min_prompts_per_concurrency = 4
request_rate = "inf"
extra_body = { top_k = 1 }

[[scenario]]
name = "prefill_512"
input_len = 512
output_len = 8
concurrency = 1

[[scenario]]
name = "decode"
input_len = 16
output_len = 96
concurrency = [1, 4]

[[scenario]]
name = "mixed_poisson"
input_len = 256
output_len = 64
request_rate = 2.5
range_ratio = 0.5
num_prompts = 3

[[config]]
name = "base"

[[config]]
name = "4-distinct"
lora_names = ["a", "b", "c", "d"]
distribution = "distinct"
"#;

    #[test]
    fn parse_and_expand() {
        let f = SweepFile::parse(FILE).unwrap();
        let s = f.expand().unwrap();
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["prefill_512", "decode_1", "decode_4", "mixed_poisson"]);
        assert_eq!(s[0].group, "prefill");
        assert_eq!(s[2].group, "decode");
        assert_eq!(s[2].num_prompts, 16); // 4 per concurrency × 4
        assert_eq!(s[1].num_prompts, 8);
        assert_eq!(s[3].num_prompts, 3);
        assert_eq!(s[3].request_rate, 2.5);
        assert!(s[0].request_rate.is_infinite());
        let a = SweepArgs {
            scenarios: "x".into(),
            out_dir: "y".into(),
            base_url: None,
            model: Some("m".into()),
            endpoint: None,
            adapter_style: Some(AdapterStyle::Sglang),
            extra_body: None,
            api_key: None,
            only: vec![],
            configs: vec![],
            render_only: false,
            no_progress: true,
        };
        let sa = serve_args(&f, &a, &s[2], &f.configs[1]).unwrap();
        assert_eq!(sa.base_url, "http://x:1");
        assert_eq!(sa.model.as_deref(), Some("m"));
        assert_eq!(sa.max_concurrency, Some(4));
        assert_eq!((sa.random_input_len, sa.random_output_len, sa.random_range_ratio), (16, 96, 1.0));
        assert_eq!(sa.lora_names.len(), 4);
        assert_eq!(sa.adapter_style, AdapterStyle::Sglang);
        assert!(sa.ignore_eos);
        assert_eq!(sa.extra_body.as_deref(), Some(r#"{"top_k":1}"#));
        assert!(SweepFile::parse("[[scenario]]\nname='a'\ninput_len=1\noutput_len=1\n").is_err());
        assert!(SweepFile::parse("bogus_key = 1").is_err());
    }

    #[test]
    fn shipped_example_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/scenarios/smollm2.toml");
        let f = SweepFile::parse(&std::fs::read_to_string(p).unwrap()).unwrap();
        let s = f.expand().unwrap();
        for c in [1, 4, 16, 64] {
            assert!(s.iter().any(|s| s.name == format!("decode_{c}")));
        }
        let names: Vec<&str> = f.configs.iter().map(|c| c.name.as_str()).collect();
        assert!(names.len() >= 4 && f.configs.iter().any(|c| c.lora_names.is_empty()));
        assert!(f.configs.iter().any(|c| c.lora_names.len() == 8));
    }

    fn entry(scn: &str, conc: usize, cfg: &str, loras: usize, tput: f64, ttft: f64) -> SweepEntry {
        let mut sm = Summary { completed: 4, output_throughput: tput, ..Default::default() };
        sm.ttft_ms.mean = ttft;
        sm.ttft_ms.p99 = ttft * 2.0;
        sm.tpot_ms.mean = 10.0;
        SweepEntry {
            scenario: Scenario {
                name: format!("decode_{conc}"),
                group: scn.into(),
                input_len: 16,
                output_len: 96,
                concurrency: Some(conc),
                num_prompts: 4,
                request_rate: f64::INFINITY,
                range_ratio: 1.0,
            },
            config: ConfigSpec { name: cfg.into(), lora_names: (0..loras).map(|i| format!("a{i}")).collect(), distribution: None, zipf_alpha: None, base_share: None },
            report: ServeReport { bench: "serve".into(), date: "d".into(), model: "m".into(), config: serde_json::json!({}), warmup_failed: 0, summary: sm, requests: None },
        }
    }

    #[test]
    fn markdown_and_cost_table() {
        let e = vec![entry("decode", 1, "base", 0, 100.0, 20.0), entry("decode", 1, "4-distinct", 4, 90.0, 25.0), entry("decode", 4, "base", 0, 300.0, 30.0), entry("decode", 4, "4-distinct", 4, 240.0, 30.0)];
        let md = render_markdown(&e, "T");
        assert!(md.contains("## Results") && md.contains("## Cost of LoRA vs base"));
        // decode_1: throughput 90 vs 100 → -10.0%, TTFT 25 vs 20 → +25.0%
        assert!(md.contains("| decode_1 | 4-distinct | -10.0% | +25.0% | +25.0% | +0.0% |"), "{md}");
        assert!(md.contains("| decode_4 | 4-distinct | -20.0% | +0.0% |"), "{md}");
        let plots = render_plots(&e);
        assert_eq!(plots.len(), 5);
        assert_eq!(plots[0].0, "decode_throughput.svg");
        assert_eq!(plots[0].1.matches("<polyline").count(), 2);
        // JSON round trip of an entry (render-only path)
        let t = serde_json::to_string(&e[0]).unwrap();
        let back: SweepEntry = serde_json::from_str(&t).unwrap();
        assert_eq!(back.report.summary.output_throughput, 100.0);
        assert!(back.scenario.request_rate.is_infinite());
        assert!(t.contains(r#""request_rate":"inf""#));
    }
}
