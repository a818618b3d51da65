//! ≥32 concurrent greedy requests over 4 adapters plus base rows, mixed prompt lengths,
//! chunked prefill interleaved with decode: every output is token-identical to the request run
//! alone through `Generator` with the same adapter.

mod common;

use common::*;
use quiver_kernels::DType;

#[test]
fn concurrent_mixed_adapters_match_generate_alone() {
    engine_matches_alone(load(&smollm2_gguf(), DType::F32), load(&smollm2_gguf(), DType::F32), 36, 6);
}

/// A mixture-of-experts model through the engine: concurrent requests of mixed lengths, chunked
/// prefill interleaved with decode (so each expert sees different row groups than alone), every
/// output token-identical to the request run alone.
#[test]
fn moe_concurrent_requests_match_generate_alone() {
    let path = require("ref/models/tiny-qwen2moe");
    concurrent_requests_match_alone(load(&path, DType::F32), load(&path, DType::F32));
}
