//! Where the model comes from: `--model`, else the default SmolLM2 GGUF in the cache that
//! `scripts/fetch-model.sh` fills.

use anyhow::{bail, Result};
use std::path::PathBuf;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Cache directories to look in, most specific first: `$QUIVER_CACHE`, then `.cache` in the
/// current directory or any parent, then `.cache` above the executable (a `target/` build).
fn cache_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(c) = std::env::var_os("QUIVER_CACHE") {
        dirs.push(PathBuf::from(c));
    }
    let mut starts = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        starts.push(cwd);
    }
    if let Ok(exe) = std::env::current_exe() {
        starts.push(exe);
    }
    for s in starts {
        for a in s.ancestors() {
            dirs.push(a.join(".cache"));
        }
    }
    dirs
}

pub fn resolve(model: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(m) = model {
        if !m.exists() {
            bail!("model path {} does not exist", m.display());
        }
        return Ok(m);
    }
    for d in cache_dirs() {
        let p = d.join("models").join(DEFAULT_MODEL_FILE);
        if p.is_file() {
            eprintln!("using default model {}", p.display());
            return Ok(p);
        }
    }
    bail!("no --model given and the default model {DEFAULT_MODEL_FILE} is not in the cache; run scripts/fetch-model.sh (or `make demo`) first, or set QUIVER_CACHE")
}
