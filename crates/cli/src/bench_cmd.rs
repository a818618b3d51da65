use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Forward-pass throughput: prefill (ppN), single-stream and batched decode.
    Generate(crate::bench_generate::BenchGenerateArgs),
    /// Cost of LoRA in a batched decode step of the real model, per backend and rank.
    Lora(crate::bench_lora::BenchLoraArgs),
    /// Engine throughput: concurrent streams, base vs one adapter vs several distinct adapters.
    Engine(crate::bench_engine::BenchEngineArgs),
    /// Embedding throughput (`--task embed` engine): sequences/s for inputs of a given length.
    Embed(crate::bench_embed::BenchEmbedArgs),
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
        BenchCommand::Lora(a) => crate::bench_lora::run(a),
        BenchCommand::Engine(a) => crate::bench_engine::run(a),
        BenchCommand::Embed(a) => crate::bench_embed::run(a),
        BenchCommand::Serve(a) => quiver_bench::run_serve(a),
        BenchCommand::Sweep(a) => quiver_bench::run_sweep(a),
    }
}
