//! Any text as `adapter_config.json` must parse to an `AdapterConfig` or a `LoraError` (never a
//! panic, never a regex that blows up), and a parsed config must answer every targeting and
//! scaling question for every module path.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quiver_lora::{AdapterConfig, LoraModule};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = AdapterConfig::parse("fuzz", text) {
        for m in LoraModule::ALL {
            for layer in [0, 1, 31] {
                let p = m.path(layer);
                let _ = c.targets_path(&p);
                let (r, s) = c.rank_scaling(&p);
                assert!(r > 0, "rank 0 for {p}");
                let _ = s;
            }
        }
    }
});
