//! Tokenizer (HF tokenizer.json or GGUF metadata).
