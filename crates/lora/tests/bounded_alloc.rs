//! A 2 GB sparse adapter file cost 4 GB of memory before its shapes were rejected. Loading now
//! checks the safetensors header against the config, the model and the rank bound before it
//! allocates anything for tensor data. Measured with a counting allocator, so this file holds
//! one test (its own process: nothing else allocates meanwhile).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use quiver_lora::{LoraAdapter, LoraError, LoraModelDims, LoraModule, ReadLimits};
use serde_json::json;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::SeqCst) + l.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak bytes allocated above the current level while `f` runs.
fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let r = f();
    (r, PEAK.load(Ordering::SeqCst) - base)
}

const MB: usize = 1 << 20;

#[test]
fn huge_sparse_files_are_refused_before_allocating() {
    let dims = LoraModelDims { num_layers: 1, hidden: 1024, q_out: 1024, kv_out: 256, intermediate: 2048, vocab: 1000 };
    let dir = temp_dir("sparse");
    let w = dir.join("adapter_model.safetensors");
    let (an, bn) = tensor_names(LoraModule::QProj, 0);

    // 2 GB: lora_A claims rank 2^19 where the config says 8.
    std::fs::write(dir.join("adapter_config.json"), json!({"r": 8, "target_modules": ["q_proj"]}).to_string()).unwrap();
    let total = write_sparse_weights(&w, &[(an.clone(), "F32", vec![1 << 19, 1024]), (bn.clone(), "F32", vec![1024, 8])]);
    assert!(total >= 2 << 30);
    let (r, peak) = peak_during(|| LoraAdapter::load("sparse", &dir, &dims));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("lora_A") && e.contains("r=8"), "{e}");
    assert!(peak < 16 * MB, "refusing a mis-shaped 2 GB file allocated {} MB", peak / MB);

    // Shapes consistent with a huge config rank: refused by the pool's rank before reading.
    std::fs::write(dir.join("adapter_config.json"), json!({"r": 1 << 18, "target_modules": ["q_proj"]}).to_string()).unwrap();
    write_sparse_weights(&w, &[(an.clone(), "F32", vec![1 << 18, 1024]), (bn.clone(), "F32", vec![1024, 1 << 18])]);
    let limits = ReadLimits { max_rank: Some(64), ..Default::default() };
    let (r, peak) = peak_during(|| LoraAdapter::load_with("sparse", &dir, &dims, &limits));
    assert!(matches!(r, Err(LoraError::Incompatible { .. })), "{r:?}");
    assert!(peak < 16 * MB, "refusing a rank-2^18 file allocated {} MB", peak / MB);

    // Larger than the weights cap: refused at open.
    let limits = ReadLimits { max_weights_bytes: 1 << 30, ..Default::default() };
    let (r, peak) = peak_during(|| LoraAdapter::load_with("sparse", &dir, &dims, &limits));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("bytes allowed"), "{e}");
    assert!(peak < 16 * MB, "{} MB", peak / MB);

    // A header that describes more data than the file holds.
    write_sparse_weights(&w, &[(an.clone(), "F32", vec![8, 1024]), (bn, "F32", vec![1024, 8])]);
    std::fs::write(dir.join("adapter_config.json"), json!({"r": 8, "target_modules": ["q_proj"]}).to_string()).unwrap();
    LoraAdapter::load("ok", &dir, &dims).unwrap();
    let len = std::fs::metadata(&w).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&w).unwrap().set_len(len - 4).unwrap();
    let e = LoraAdapter::load("short", &dir, &dims).unwrap_err().to_string();
    assert!(e.contains("describes") && e.contains("adapter_model.safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
