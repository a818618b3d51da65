//! Any byte string must parse to a `GgufFile` or a `FormatError`, and every tensor of a file
//! that parses must dequantize or error: never a panic, never a read outside the mapping.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quiver_model::formats::gguf::GgufFile;
use quiver_model::formats::WeightSource;

fuzz_target!(|data: &[u8]| {
    // The parser works on a memory-mapped file, so the input goes through a real file; one per
    // fuzzing process is enough since runs are sequential.
    let path = std::env::temp_dir().join(format!("quiver-fuzz-gguf-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(f) = GgufFile::open(&path) {
        for name in f.tensor_names() {
            let _ = f.tensor_f32(&name);
        }
        let _ = f.metadata_keys().count();
    }
});
