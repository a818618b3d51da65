//! Quiver's HTTP front end: OpenAI-compatible and SGLang-native routes, per-request adapters,
//! adapter management, Prometheus metrics and graceful shutdown, over a [`Backend`] (the
//! engine, see [`engine_backend`]).

mod adapter_routes;
pub mod adapters;
pub mod backend;
mod chat;
mod completions;
pub mod embeddings;
pub mod engine_backend;
pub mod error;
mod logprobs;
pub mod limits;
pub mod metrics;
pub mod options;
pub mod request;
pub mod server;
mod sglang;
pub mod structured;
pub mod shutdown;
pub mod tokenize;
pub mod tools;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_hardening;
#[cfg(test)]
mod tests_tools;

pub use adapters::{parse_lora_module, parse_lora_path, StartupAdapter};
pub use backend::Backend;
pub use error::ApiError;
pub use server::{router, serve_with_shutdown, shutdown_signal, AppState, ServerConfig};
