//! Hugging Face safetensors (single file or sharded index), memory-mapped.
