//! Any byte string as an adapter's `adapter_model.safetensors` must load or be refused with a
//! `LoraError`: never a panic, never an allocation the header talked it into (the loader checks
//! header, shapes and rank before reading tensor data, and reads are bounded by the file).
#![no_main]

use libfuzzer_sys::fuzz_target;
use quiver_lora::{LoraAdapter, LoraModelDims, ReadLimits};

const DIMS: LoraModelDims = LoraModelDims { num_layers: 2, hidden: 8, q_out: 8, kv_out: 4, intermediate: 12, vocab: 16 };

fuzz_target!(|data: &[u8]| {
    // The loader reads a directory, so the input goes through a real file; one directory per
    // fuzzing process is enough since runs are sequential. In memory where there is a tmpfs:
    // ext4 flushes a truncated-and-rewritten file at close, which costs most of a run.
    let shm = std::path::Path::new("/dev/shm");
    let tmp = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    let dir = tmp.join(format!("quiver-fuzz-st-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let cfg = dir.join("adapter_config.json");
    if !cfg.exists() {
        let text = r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"]}"#;
        if std::fs::write(&cfg, text).is_err() {
            return;
        }
    }
    if std::fs::write(dir.join("adapter_model.safetensors"), data).is_err() {
        return;
    }
    let limits = ReadLimits { max_rank: Some(4), max_weights_bytes: 1 << 20, ..Default::default() };
    if let Ok(a) = LoraAdapter::load_with("fuzz", &dir, &DIMS, &limits) {
        let _ = a.check_compatible(4, &quiver_lora::LoraModule::PROJECTIONS);
        let _ = a.size_bytes();
    }
});
