//! The model layer: file formats, tokenizer, chat templates, and the decoder forward pass
//! (dense and mixture-of-experts).
//!
//! The forward pass is written once against `quiver_kernels::Device`; it never names a device
//! and never names a LoRA backend: LoRA deltas enter through the `quiver_lora::LoraHook` seam.

pub mod batch;
pub mod chat;
pub mod compat;
pub mod config;
pub mod embedding;
pub mod formats;
pub mod llama;
pub mod loader;
pub mod moe;
pub mod tokenizer;
pub mod tp;

pub use batch::{ForwardBatch, LogitsFor};
pub use compat::check_adapter;
pub use config::{Arch, ModelConfig, MoeConfig, QkNormKind};
pub use embedding::{EmbeddingSpec, PoolState, Pooling};
pub use llama::{KvCache, LlamaModel, Workspace};
pub use loader::{load_model, LoadedModel};
