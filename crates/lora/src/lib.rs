//! Multi-LoRA: PEFT adapters, the LoRA memory pool, batch metadata and pluggable backends.
