//! Adapter files as an attacker or a careless operator leaves them: rewritten while they load,
//! FIFOs and devices in place of files, symlinks out of the sandbox, configs that would echo
//! secrets, weights that turn every output to NaN. Each case must end in an error naming the
//! adapter and file (or module), never a crash, a hang or a leak of file content.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use quiver_lora::{LoraAdapter, LoraModule, ReadLimits};
use serde_json::json;

fn all_linear_config(r: usize) -> serde_json::Value {
    json!({"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": "all-linear"})
}

/// The probe's deterministic SIGBUS: a large adapter whose file is truncated to 4 KB while it
/// loads. Through a memory map the loader's next touch of a vanished page killed the process;
/// read into owned memory, the short read is an error naming the file.
#[test]
fn file_truncated_while_loading_is_an_error_not_a_crash() {
    let dir = temp_dir("truncate");
    std::fs::write(dir.join("adapter_config.json"), all_linear_config(32).to_string()).unwrap();
    let w = dir.join("adapter_model.safetensors");
    let total = write_sparse_weights(&w, &all_projection_tensors(&BIG_DIMS, 32));
    assert!(total > 300 << 20, "{total}");
    let started = Arc::new(AtomicBool::new(false));
    let (d2, s2) = (dir.clone(), started.clone());
    let t = std::thread::spawn(move || {
        s2.store(true, std::sync::atomic::Ordering::SeqCst);
        LoraAdapter::load("big", &d2, &BIG_DIMS)
    });
    while !started.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(30));
    std::fs::OpenOptions::new().write(true).open(&w).unwrap().set_len(4096).unwrap();
    let e = t.join().unwrap().expect_err("a file truncated mid-load must not load").to_string();
    assert!(e.contains("`big`") && e.contains("adapter_model.safetensors"), "{e}");
    assert!(e.contains("shrank") || e.contains("changed") || e.contains("describes"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
fn mkfifo(p: &std::path::Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// A FIFO named `adapter_config.json` blocked the reader's open until a writer came (forever);
/// now it is refused at once as not a regular file. Devices likewise (a symlink to /dev/zero
/// once read 2.3 GB as a config).
#[cfg(unix)]
#[test]
fn fifo_and_device_files_are_refused_at_once() {
    let dir = simple_adapter("fifo", 1, 4, &[LoraModule::QProj]);
    std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
    mkfifo(&dir.join("adapter_config.json"));
    let (tx, rx) = std::sync::mpsc::channel();
    let d2 = dir.clone();
    std::thread::spawn(move || {
        let _ = tx.send(LoraAdapter::load("f", &d2, &DIMS).map(|_| ()).map_err(|e| e.to_string()));
    });
    let e = rx.recv_timeout(Duration::from_secs(10)).expect("loading a FIFO config hung").unwrap_err();
    assert!(e.contains("adapter_config.json") && e.contains("not a regular file"), "{e}");

    std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("adapter_config.json")).unwrap();
    let e = LoraAdapter::load("z", &dir, &DIMS).unwrap_err().to_string();
    assert!(e.contains("adapter_config.json") && e.contains("not a regular file"), "{e}");
    // The weights file as a FIFO too.
    std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
    std::fs::write(dir.join("adapter_config.json"), json!({"r": 4, "target_modules": ["q_proj"]}).to_string()).unwrap();
    std::fs::remove_file(dir.join("adapter_model.safetensors")).unwrap();
    mkfifo(&dir.join("adapter_model.safetensors"));
    let e = LoraAdapter::load("w", &dir, &DIMS).unwrap_err().to_string();
    assert!(e.contains("adapter_model.safetensors") && e.contains("not a regular file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_over_the_size_cap_is_refused() {
    let dir = simple_adapter("bigcfg", 1, 4, &[LoraModule::QProj]);
    let pad = " ".repeat(2 << 20);
    std::fs::write(dir.join("adapter_config.json"), format!("{{\"r\": 4, \"target_modules\": [\"q_proj\"]{pad}}}")).unwrap();
    let e = LoraAdapter::load("c", &dir, &DIMS).unwrap_err().to_string();
    assert!(e.contains("adapter_config.json") && e.contains("bytes allowed"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Inside `--lora-dir`, a directory of symlinks to files outside loaded, and the outside
/// file's content came back in the error. Under a sandbox every file is opened without
/// following symlinks and must resolve inside the root; without one (operator-given startup
/// paths, e.g. a Hugging Face cache of symlinked blobs) symlinks still work.
#[cfg(unix)]
#[test]
fn symlinked_files_do_not_escape_the_sandbox() {
    let root = temp_dir("sandbox-root");
    let outside = simple_adapter("outside", 3, 4, &[LoraModule::QProj]);
    std::fs::write(outside.join("secret.json"), r#"{"r": "SECRET-TOKEN-123", "target_modules": ["q_proj"]}"#).unwrap();
    let inner = root.join("links");
    std::fs::create_dir_all(&inner).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.json"), inner.join("adapter_config.json")).unwrap();
    std::os::unix::fs::symlink(outside.join("adapter_model.safetensors"), inner.join("adapter_model.safetensors")).unwrap();
    let sandboxed = ReadLimits { sandbox: Some(root.canonicalize().unwrap()), ..Default::default() };
    let e = LoraAdapter::load_with("links", &inner, &DIMS, &sandboxed).unwrap_err().to_string();
    assert!(e.contains("adapter_config.json") && e.contains("symbolic link"), "{e}");
    assert!(!e.contains("SECRET") && !e.contains(&*outside.to_string_lossy()), "{e}");

    // Config fine, weights a symlink: refused as well.
    std::fs::remove_file(inner.join("adapter_config.json")).unwrap();
    std::fs::copy(outside.join("adapter_config.json"), inner.join("adapter_config.json")).unwrap();
    let e = LoraAdapter::load_with("links", &inner, &DIMS, &sandboxed).unwrap_err().to_string();
    assert!(e.contains("adapter_model.safetensors") && e.contains("symbolic link"), "{e}");
    // The same directory without a sandbox follows the symlink and loads.
    LoraAdapter::load("links", &inner, &DIMS).unwrap();
    // A directory outside the root is refused even when handed over directly.
    let e = LoraAdapter::load_with("o", &outside, &DIMS, &sandboxed).unwrap_err().to_string();
    assert!(e.contains("outside --lora-dir"), "{e}");

    // Without a sandbox the symlinked secret is read, but its content is never echoed.
    std::fs::remove_file(inner.join("adapter_config.json")).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.json"), inner.join("adapter_config.json")).unwrap();
    let e = LoraAdapter::load("links", &inner, &DIMS).unwrap_err().to_string();
    assert!(e.contains("`r`") && !e.contains("SECRET"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
    let _ = std::fs::remove_dir_all(&outside);
}

/// No config error quotes a value or key from the file; every one still names the field.
#[test]
fn config_errors_never_echo_file_content() {
    let secret = "SECRET-TOKEN-123";
    for (cfg, field) in [
        (json!({"r": secret}), "r"),
        (json!({"lora_alpha": secret}), "lora_alpha"),
        (json!({"peft_type": secret}), "peft_type"),
        (json!({"bias": secret}), "bias"),
        (json!({"rank_pattern": {secret: secret}}), "rank_pattern"),
        (json!({"rank_pattern": {format!("({secret}"): 4}}), "rank_pattern"),
        (json!({"alpha_pattern": {secret: secret}}), "alpha_pattern"),
        (json!({"target_modules": format!("({secret}")}), "target_modules"),
        (json!({"target_modules": [secret, 5]}), "target_modules"),
        (json!({"exclude_modules": {secret: 1}}), "exclude_modules"),
        (json!({"layers_to_transform": [secret]}), "layers_to_transform"),
        (json!({"layers_to_transform": secret}), "layers_to_transform"),
        (json!({"layers_pattern": format!("({secret}")}), "layers_pattern"),
    ] {
        let e = quiver_lora::AdapterConfig::parse("ad", &cfg.to_string()).unwrap_err().to_string();
        assert!(e.contains(field) && !e.contains(secret) && !e.contains("SECRET"), "{cfg}: {e}");
    }
    let e = quiver_lora::AdapterConfig::parse("ad", &format!("{{\"r\": 4, {secret}}}")).unwrap_err().to_string();
    assert!(!e.contains("SECRET") && e.contains("line 1"), "{e}");
}

/// `lora_alpha: 1e39` and huge weights loaded, and the adapter's every output was
/// `<|endoftext|>` with null logprobs. Now the load is refused, naming the module.
#[test]
fn adapters_that_would_produce_nan_are_refused() {
    let h = DIMS.hidden;
    let q = DIMS.q_out;
    let write = |alpha: f64, fill: f32| {
        let dir = temp_dir("nan");
        let (an, bn) = tensor_names(LoraModule::QProj, 1);
        let cfg = json!({"r": 4, "lora_alpha": alpha, "target_modules": ["q_proj"], "layers_to_transform": [1]});
        write_adapter(&dir, &cfg, &[T { name: an, shape: vec![4, h], data: vec![fill; 4 * h] }, T { name: bn, shape: vec![q, 4], data: vec![fill; 4 * q] }]);
        dir
    };
    // Alpha beyond f32: the scaling itself is infinite.
    let e = LoraAdapter::load("inf", &write(1e39, 0.1), &DIMS).unwrap_err().to_string();
    assert!(e.contains("`inf`") && e.contains("lora_alpha"), "{e}");
    // A finite but enormous alpha, and finite but enormous weights: scale·B·A overflows.
    for (alpha, fill) in [(1e30, 0.1), (8.0, 1e18)] {
        let e = LoraAdapter::load("huge", &write(alpha, fill), &DIMS).unwrap_err().to_string();
        assert!(e.contains("`huge`") && e.contains("model.layers.1.self_attn.q_proj") && e.contains("effective weights"), "{alpha} {fill}: {e}");
    }
    // Large but sane values still load (bound is far above real adapters).
    LoraAdapter::load("ok", &write(64.0, 50.0), &DIMS).unwrap();
}

/// Loads are time-bounded and cancellable: a deadline in the past or a set cancel flag stops
/// a load at its next read with an error, before the weights are read.
#[test]
fn loads_stop_at_the_deadline_or_when_cancelled() {
    let dir = simple_adapter("deadline", 1, 4, &[LoraModule::QProj, LoraModule::VProj]);
    let late = ReadLimits { deadline: Some(Instant::now() - Duration::from_secs(1)), ..Default::default() };
    let e = LoraAdapter::load_with("d", &dir, &DIMS, &late).unwrap_err().to_string();
    assert!(e.contains("timed out"), "{e}");
    let cancelled = ReadLimits { cancel: Some(Arc::new(AtomicBool::new(true))), ..Default::default() };
    let e = LoraAdapter::load_with("d", &dir, &DIMS, &cancelled).unwrap_err().to_string();
    assert!(e.contains("cancelled"), "{e}");
    LoraAdapter::load_with("d", &dir, &DIMS, &ReadLimits { deadline: Some(Instant::now() + Duration::from_secs(60)), ..Default::default() }).unwrap();
}

/// Found by the `adapter_config` fuzz target: a `layers_pattern` with an alternation made the
/// layer-index group optional, and reading it panicked (on the engine's loader thread, which
/// then served no more loads). It is now a pattern that matches no layer.
#[test]
fn layers_pattern_with_an_alternation_does_not_panic() {
    let c = quiver_lora::AdapterConfig::parse("ad", r#"{"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layer|"}"#).unwrap();
    for l in 0..3 {
        let _ = c.targets(l, LoraModule::QProj);
    }
    let c = quiver_lora::AdapterConfig::parse("ad", r#"{"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layers|h"}"#).unwrap();
    assert!(c.targets(1, LoraModule::QProj) && !c.targets(0, LoraModule::QProj));
}
