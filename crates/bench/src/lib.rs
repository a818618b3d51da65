//! Quiver benchmarks.
//!
//! * [`serve`]: `quiver bench serve`, an OpenAI-API streaming load generator that measures any
//!   OpenAI-compatible server (Quiver, llama.cpp `llama-server`, vLLM, SGLang).
//! * [`sweep`]: `quiver bench sweep`, scenarios × adapter configurations → markdown + SVG.
//! * [`metrics`]: TTFT/TPOT/ITL/E2E and throughput definitions (REFERENCE.md §6.3).
//!
//! Output convention for every `quiver bench` command (microbenchmarks included): `--output-json
//! FILE` writes one pretty JSON object with `"bench"` (the command), `"date"` (RFC 3339 UTC),
//! `"config"` (the flags) and the metrics at top level; see [`report::bench_json`] and
//! [`serve::write_json`].

pub mod dataset;
pub mod metrics;
pub mod report;
pub mod serve;
pub mod svg;
pub mod sweep;

pub use serve::{run_serve, ServeBenchArgs};
pub use sweep::{run_sweep, SweepArgs};
