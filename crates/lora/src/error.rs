//! The one error type of the crate. Every variant names the adapter and what is wrong with it,
//! because these messages reach API users loading adapters at runtime.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoraError {
    /// `adapter_config.json` (or the directory layout) is unsupported or malformed.
    #[error("LoRA adapter `{adapter}`: `{field}`: {reason}")]
    Config { adapter: String, field: String, reason: String },
    /// A weight tensor is missing, unexpected, mis-shaped or non-finite.
    #[error("LoRA adapter `{adapter}`: {file}: tensor `{tensor}`: {reason}")]
    Tensor { adapter: String, file: String, tensor: String, reason: String },
    /// A file could not be read or parsed.
    #[error("LoRA adapter `{adapter}`: {file}: {reason}")]
    File { adapter: String, file: String, reason: String },
    /// Valid PEFT, but outside what the memory pool was sized for (rank, modules).
    #[error("LoRA adapter `{adapter}` is incompatible with the current LoRA memory pool configuration: module `{module}`: {reason}")]
    Incompatible { adapter: String, module: String, reason: String },
    /// Every slot is held by an adapter of this batch or a pinned one.
    #[error("no LoRA slot available: {0}")]
    NoSlot(String),
    #[error("LoRA adapter `{0}` is not loaded")]
    UnknownAdapter(String),
    #[error("LoRA adapter `{0}` is already loaded")]
    AlreadyLoaded(String),
    /// A request that the manager's configuration or state cannot satisfy.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = LoraError> = std::result::Result<T, E>;
