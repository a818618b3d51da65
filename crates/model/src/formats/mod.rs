//! Weight and metadata file formats: GGUF (own parser) and Hugging Face safetensors directories.
//!
//! Every error names the file, and the tensor where one is involved, so a user with a corrupt
//! download knows what to re-fetch. Parsers never panic on bad input and never read outside the
//! mapped file.

pub mod gguf;
pub mod memory;
pub mod safetensors;

use std::path::{Path, PathBuf};

/// A problem with a model or adapter file. `tensor` is set when one tensor is at fault.
#[derive(Debug, thiserror::Error)]
#[error("{}{}: {message}", path.display(), tensor.as_ref().map(|t| format!(" (tensor `{t}`)")).unwrap_or_default())]
pub struct FormatError {
    pub path: PathBuf,
    pub tensor: Option<String>,
    pub message: String,
}

impl FormatError {
    pub fn new(path: impl AsRef<Path>, message: impl Into<String>) -> Self {
        FormatError { path: path.as_ref().to_path_buf(), tensor: None, message: message.into() }
    }
    pub fn tensor(path: impl AsRef<Path>, tensor: impl Into<String>, message: impl Into<String>) -> Self {
        FormatError { path: path.as_ref().to_path_buf(), tensor: Some(tensor.into()), message: message.into() }
    }
}

/// Read access to named tensors, whatever the container. Shapes are in PyTorch order
/// (outermost first), so a linear weight is `[out, in]`.
pub trait WeightSource: Send + Sync {
    /// The file (or directory) the weights come from, for error messages.
    fn path(&self) -> &Path;
    fn contains(&self, name: &str) -> bool;
    /// PyTorch-order shape of a tensor, or an error naming the missing tensor.
    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError>;
    /// The tensor converted (dequantized if needed) to f32.
    fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError>;
    fn tensor_names(&self) -> Vec<String>;
}
