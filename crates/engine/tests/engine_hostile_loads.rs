//! Adapter loads that must never reach the engine thread: a FIFO named `adapter_config.json`
//! (readable once by a writer, then blocking) hung every generation and SIGTERM, because the
//! engine re-read the files to install them; and host-cache reloads of rewritten files.

mod common;

use common::*;
use quiver_engine::testing::write_random_adapter;
use quiver_engine::{Engine, EngineConfig, FinishReason, GenerateRequest};
use quiver_lora::LoraModule;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn greedy(prompt: Vec<u32>, adapter: Option<&str>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { prompt, adapter: adapter.map(str::to_string), max_tokens, ignore_eos: true, ..Default::default() }
}

/// Feeds `text` once to the FIFO at `p` if a reader opens it within `wait` (non-blocking
/// writer, so the thread never hangs when nobody reads).
#[cfg(unix)]
fn feed_fifo_once(p: std::path::PathBuf, text: String, wait: Duration) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < wait {
            match std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&p) {
                Ok(mut f) => {
                    let _ = f.write_all(text.as_bytes());
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
}

#[cfg(unix)]
#[test]
fn fifo_config_hangs_neither_generation_nor_shutdown() {
    let lm = tiny(3);
    let vocab = lm.model.config.vocab_size;
    let dims = lm.model.lora_dims();
    let dir = quiver_engine::testing::temp_dir("fifo").join("a");
    write_random_adapter(&dir, &dims, &[LoraModule::QProj], 4, 8.0, 0.5, 9).unwrap();
    let cfg_text = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
    std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
    let c = std::ffi::CString::new(dir.join("adapter_config.json").as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);

    let h = Engine::start(lm, EngineConfig { max_lora_rank: 8, ..Default::default() }).unwrap();
    let base = h.submit(greedy(prompt(7, 12, vocab), None, 60)).unwrap();
    // A writer answers the first open only: a loader that opened it twice would block there.
    feed_fifo_once(dir.join("adapter_config.json"), cfg_text, Duration::from_secs(3));
    let (tx, rx) = mpsc::channel();
    let (h2, d2) = (h.clone(), dir.clone());
    std::thread::spawn(move || {
        let _ = tx.send(h2.load_adapter_blocking("fifo", &d2, false, false, None));
    });
    let r = rx.recv_timeout(Duration::from_secs(30)).expect("the load of a FIFO config never answered");
    let e = r.expect_err("a FIFO config must be refused").to_string();
    assert!(e.contains("adapter_config.json") && e.contains("not a regular file"), "{e}");

    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(base.collect_blocking());
    });
    let c = rx.recv_timeout(Duration::from_secs(60)).expect("a base-model request hung behind the FIFO load");
    assert_eq!(c.finish[0], Some(FinishReason::Length), "{:?}", c.error);

    let (tx, rx) = mpsc::channel();
    let h2 = h.clone();
    std::thread::spawn(move || {
        h2.shutdown_and_join();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("shutdown hung");
}

/// With `max_loaded_loras` = 1 every switch drops the other adapter's host weights; they are
/// read again on the loader thread (outputs equal running alone), and a weights file rewritten
/// in between fails only the requests on that version, with an error naming the file.
#[test]
fn host_cache_reloads_keep_outputs_and_refuse_rewritten_files() {
    let lm = tiny(4);
    let oracle_lm = tiny(4);
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("reload", &lm.model.lora_dims(), 2, 8, 0.5, 21);
    let (mut oracle, keys) = oracle_manager(&oracle_lm.model, &paths);
    let cfg = EngineConfig { max_loras_per_batch: 1, max_loaded_loras: 1, max_lora_rank: 8, ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    h.load_adapter_blocking("a0", &paths[0], false, false, None).unwrap();
    h.load_adapter_blocking("a1", &paths[1], false, false, None).unwrap();
    let p = prompt(5, 10, vocab);
    for round in 0..3 {
        for (i, name) in ["a0", "a1"].iter().enumerate() {
            let c = h.submit(greedy(p.clone(), Some(name), 6)).unwrap().collect_blocking();
            assert_eq!(c.tokens[0], alone(&oracle_lm.model, Some((&mut oracle, keys[i])), &p, 6, &[]), "round {round} {name}: {:?}", c.error);
        }
    }
    // a1 was used last, so a0's host weights are gone; rewrite its file and ask for it.
    std::fs::write(paths[0].join("adapter_model.safetensors"), b"rewritten").unwrap();
    let c = h.submit(greedy(p.clone(), Some("a0"), 6)).unwrap().collect_blocking();
    let e = c.error.expect("a rewritten file must not be served as the old version");
    assert!(e.contains("changed on disk") && e.contains("adapter_model.safetensors"), "{e}");
    let c = h.submit(greedy(p.clone(), Some("a1"), 6)).unwrap().collect_blocking();
    assert_eq!(c.finish[0], Some(FinishReason::Length), "{:?}", c.error);
    let d = h.debug_state().unwrap();
    assert_eq!((d.requests, d.kv_in_use, d.queued), (0, 0, 0));
}
