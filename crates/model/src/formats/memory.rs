//! Named f32 tensors held in memory, read like a checkpoint: models built in-process (random
//! weights for tests and benchmarks) go through the same loader, tensor-parallel sharding
//! included, as files do.

use super::{FormatError, WeightSource};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub struct MemoryWeights {
    label: PathBuf,
    tensors: HashMap<String, (Vec<f32>, Vec<usize>)>,
}

impl MemoryWeights {
    /// An empty set; `label` stands for the file in error messages.
    pub fn new(label: &str) -> Self {
        MemoryWeights { label: PathBuf::from(label), tensors: HashMap::new() }
    }

    pub fn insert(&mut self, name: impl Into<String>, shape: &[usize], data: Vec<f32>) {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor data does not match its shape");
        self.tensors.insert(name.into(), (data, shape.to_vec()));
    }
}

impl WeightSource for MemoryWeights {
    fn path(&self) -> &Path {
        &self.label
    }
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.tensors.get(name).map(|t| t.1.clone()).ok_or_else(|| FormatError::tensor(&self.label, name, "missing"))
    }
    fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError> {
        self.tensors.get(name).cloned().ok_or_else(|| FormatError::tensor(&self.label, name, "missing"))
    }
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
}
