//! Chat templates rendered with minijinja, byte-identical to transformers.
