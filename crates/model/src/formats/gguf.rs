//! GGUF v3 parser and dequantization.
