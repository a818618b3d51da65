//! Broken mixture-of-experts checkpoints are refused with an error naming the file and the
//! tensor: a missing expert, more experts than the config says, a router of the wrong shape
//! (HF directory), and an expert count that disagrees with the stacked tensors (GGUF). Each case
//! starts from a tiny model the reference script wrote (`make test-data`) and breaks one thing.

use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::load_model;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

fn cache_dir() -> PathBuf {
    std::env::var_os("QUIVER_CACHE").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache")))
}

fn require(rel: &str) -> PathBuf {
    let p = cache_dir().join(rel);
    assert!(p.exists(), "{} is missing: run `make test` (or scripts/make-refs.sh) to build the reference data", p.display());
    p
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-moe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The load error of `path`, as the user sees it.
fn load_err(path: &Path) -> String {
    match load_model(path, open_device(DeviceKind::Cpu).unwrap(), DType::F32) {
        Ok(_) => panic!("{} loaded although it is broken", path.display()),
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("{msg}");
            msg
        }
    }
}

/// A tensor as written: name, shape, little-endian f32 bytes.
type Raw = (String, Vec<usize>, Vec<u8>);
/// What to write for each tensor read.
type Edit<'a> = dyn Fn(&str, Vec<usize>, Vec<u8>) -> Vec<Raw> + 'a;

/// A copy of the HF model `src` whose safetensors went through `edit(name, shape, data)`,
/// which returns the tensors to write instead (none to drop it, several to add some).
fn broken_copy(src: &Path, tag: &str, edit: &Edit<'_>) -> PathBuf {
    let dir = temp_dir(tag);
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        if f.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        out.extend(edit(&name, view.shape().to_vec(), view.data().to_vec()));
    }
    let views: Vec<(String, TensorView<'_>)> = out.iter().map(|(n, s, d)| (n.clone(), TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())).collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    dir
}

fn assert_names(err: &str, file: &Path, tensor: &str, what: &str) {
    assert!(err.contains(&file.display().to_string()) && err.contains(tensor), "{what}: the error should name {} and `{tensor}`: {err}", file.display());
}

#[test]
fn missing_expert_is_refused_naming_file_and_tensor() {
    let src = require("ref/models/tiny-qwen3moe");
    let gone = "model.layers.1.mlp.experts.5.up_proj.weight";
    let dir = broken_copy(&src, "missing", &|n, s, d| if n == gone { vec![] } else { vec![(n.into(), s, d)] });
    let err = load_err(&dir);
    assert_names(&err, &dir, gone, "missing expert");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn more_experts_than_the_config_says_is_refused() {
    let src = require("ref/models/tiny-qwen3moe");
    let dir = broken_copy(&src, "extra", &|n, s, d| {
        let mut v = vec![(n.to_string(), s.clone(), d.clone())];
        if let Some(rest) = n.strip_prefix("model.layers.0.mlp.experts.15.") {
            v.push((format!("model.layers.0.mlp.experts.16.{rest}"), s, d));
        }
        v
    });
    let err = load_err(&dir);
    assert_names(&err, &dir, "model.layers.0.mlp.experts.16.gate_proj.weight", "extra expert");
    assert!(err.contains("16 experts"), "the error should say how many experts the config gives: {err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn router_of_the_wrong_shape_is_refused() {
    let src = require("ref/models/tiny-qwen3moe");
    let router = "model.layers.1.mlp.gate.weight";
    // 15 experts' rows instead of 16.
    let dir = broken_copy(&src, "router", &|n, s, d| if n == router { vec![(n.into(), vec![s[0] - 1, s[1]], d[..(s[0] - 1) * s[1] * 4].to_vec())] } else { vec![(n.into(), s, d)] });
    let err = load_err(&dir);
    assert_names(&err, &dir, router, "router shape");
    assert!(err.contains("[15, 64]") && err.contains("[16, 64]"), "the error should give both shapes: {err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn gguf_expert_count_disagreeing_with_the_stacked_tensors_is_refused() {
    let src = require("ref/models/tiny-qwen3moe.gguf");
    let mut bytes = std::fs::read(&src).unwrap();
    // The metadata entry is the key string, its u32 type (4 = uint32), then the value.
    let key = b"qwen3moe.expert_count";
    let at = bytes.windows(key.len()).position(|w| w == key).expect("expert_count key in the GGUF") + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "uint32 value type");
    assert_eq!(u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()), 16);
    bytes[at + 4..at + 8].copy_from_slice(&12u32.to_le_bytes());
    let dir = temp_dir("gguf-count");
    let path = dir.join("tiny-qwen3moe-12.gguf");
    std::fs::write(&path, bytes).unwrap();
    let err = load_err(&path);
    assert_names(&err, &path, "blk.0.ffn_gate_inp.weight", "GGUF expert count");
    std::fs::remove_dir_all(dir).unwrap();
}
