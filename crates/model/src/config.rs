//! Model configuration from config.json or GGUF metadata.
