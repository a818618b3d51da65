use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Forward-pass throughput: prefill (ppN), single-stream and batched decode.
    Generate(crate::bench_generate::BenchGenerateArgs),
    /// Load-test an OpenAI-compatible server (Quiver, llama-server, vLLM, SGLang) with streaming
    /// requests; prints TTFT/TPOT/ITL/E2E and throughput, per adapter.
    Serve(quiver_bench::ServeBenchArgs),
    /// Run a TOML file of scenarios × adapter configurations; writes a markdown report (with the
    /// cost of LoRA vs base) and SVG plots.
    Sweep(quiver_bench::SweepArgs),
}

pub fn run(b: BenchCommand) -> Result<()> {
    match b {
        BenchCommand::Generate(a) => crate::bench_generate::run(a),
        BenchCommand::Serve(a) => quiver_bench::run_serve(a),
        BenchCommand::Sweep(a) => quiver_bench::run_sweep(a),
    }
}
