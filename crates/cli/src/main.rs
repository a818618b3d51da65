//! `quiver`: one binary, clap subcommands.

mod bench_cmd;
mod bench_embed;
mod bench_engine;
mod bench_generate;
mod bench_lora;
#[cfg(feature = "cuda")]
mod bench_lora_gpu;
mod bench_lora_kernels;
mod bench_shapes;
mod embed_cmd;
mod generate_cmd;
mod model_path;
mod serve_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "quiver", version, about = "Multi-LoRA LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate(generate_cmd::GenerateArgs),
    /// Serve the OpenAI-compatible (and SGLang-native) HTTP API with per-request LoRA adapters.
    Serve(serve_cmd::ServeArgs),
    /// Embed texts with a decoder embedding model (one JSON object per input on stdout).
    Embed(embed_cmd::EmbedArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into())).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Generate(a) => generate_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Embed(a) => embed_cmd::run(a),
        Command::Bench(b) => bench_cmd::run(b),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
