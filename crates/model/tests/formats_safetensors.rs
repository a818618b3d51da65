//! Safetensors loader tests on hand-built files: single file, directory, sharded index, and one
//! test per corruption class.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use quiver_model::formats::safetensors::SafetensorsWeights;
use quiver_model::formats::{FormatError, WeightSource};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

struct TempDir(PathBuf);
impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "quiver-st-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds a safetensors file from `(name, dtype, shape, raw bytes)`; offsets are computed.
fn build(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    raw(&serde_json::Value::Object(header).to_string(), &data)
}

fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn expect_err(
    r: Result<SafetensorsWeights, FormatError>,
    path: &Path,
    needles: &[&str],
) -> FormatError {
    let e = r.expect_err("corrupt input was accepted");
    let msg = e.to_string();
    assert!(
        msg.contains(path.to_str().unwrap()),
        "error does not name {}: {msg}",
        path.display()
    );
    for n in needles {
        assert!(msg.contains(n), "expected `{n}` in: {msg}");
    }
    e
}

#[test]
fn single_file_converts_f32_f16_bf16() {
    let d = TempDir::new();
    let vals = [1.0f32, -2.5, 0.333, 65504.0, 1e-3, -0.0];
    let f16b: Vec<u8> = vals
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    let bf16b: Vec<u8> = vals
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    let p = d.write(
        "w.safetensors",
        &build(&[
            ("a", "F32", &[2, 3], f32s(&vals)),
            ("b", "F16", &[6], f16b),
            ("c", "BF16", &[3, 2], bf16b),
            ("ids", "I64", &[2], vec![0; 16]),
        ]),
    );
    let w = SafetensorsWeights::open(&p).unwrap();
    assert_eq!(w.tensor_names(), vec!["a", "b", "c", "ids"]);
    assert_eq!(w.tensor_f32("a").unwrap(), (vals.to_vec(), vec![2, 3]));
    let (b, _) = w.tensor_f32("b").unwrap();
    assert_eq!(
        b,
        vals.iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect::<Vec<_>>()
    );
    let (c, shape) = w.tensor_f32("c").unwrap();
    assert_eq!(shape, vec![3, 2]);
    assert_eq!(
        c,
        vals.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect::<Vec<_>>()
    );
    assert_eq!(w.shape("ids").unwrap(), vec![2]);
    let e = w.tensor_f32("ids").unwrap_err();
    assert_eq!(e.tensor.as_deref(), Some("ids"));
    assert!(e.to_string().contains("expected F32, F16 or BF16"), "{e}");
    assert_eq!(w.metadata().get("format").map(String::as_str), Some("pt"));
}

#[test]
fn directory_with_model_safetensors() {
    let d = TempDir::new();
    d.write(
        "model.safetensors",
        &build(&[("x", "F32", &[1], f32s(&[7.0]))]),
    );
    d.write("config.json", b"{}");
    let w = SafetensorsWeights::open(&d.0).unwrap();
    assert_eq!(w.tensor_f32("x").unwrap().0, vec![7.0]);
    assert_eq!(w.path(), d.0.as_path());
}

fn sharded(d: &TempDir) {
    d.write(
        "model-00001-of-00002.safetensors",
        &build(&[("a", "F32", &[2], f32s(&[1.0, 2.0]))]),
    );
    d.write(
        "model-00002-of-00002.safetensors",
        &build(&[("b", "F32", &[1], f32s(&[3.0]))]),
    );
    d.write(
        "model.safetensors.index.json",
        br#"{"metadata": {"total_size": 12}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    );
}

#[test]
fn sharded_index() {
    let d = TempDir::new();
    sharded(&d);
    let w = SafetensorsWeights::open(&d.0).unwrap();
    assert_eq!(w.tensor_names(), vec!["a", "b"]);
    assert_eq!(w.tensor_f32("a").unwrap().0, vec![1.0, 2.0]);
    assert_eq!(w.tensor_f32("b").unwrap().0, vec![3.0]);
}

#[test]
fn missing_shard() {
    let d = TempDir::new();
    sharded(&d);
    let gone = d.0.join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&gone).unwrap();
    let e = expect_err(SafetensorsWeights::open(&d.0), &gone, &["missing shard"]);
    assert_eq!(e.tensor.as_deref(), Some("b"));
}

#[test]
fn tensor_listed_in_index_but_absent_from_shard() {
    let d = TempDir::new();
    sharded(&d);
    d.write(
        "model.safetensors.index.json",
        br#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "zzz": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors"}}"#,
    );
    let e = expect_err(
        SafetensorsWeights::open(&d.0),
        &d.0,
        &["missing from its shard"],
    );
    assert_eq!(e.tensor.as_deref(), Some("zzz"));
}

#[test]
fn shard_name_escaping_directory_is_rejected() {
    let d = TempDir::new();
    d.write(
        "model.safetensors.index.json",
        br#"{"weight_map": {"a": "../evil.safetensors"}}"#,
    );
    expect_err(
        SafetensorsWeights::open(&d.0),
        &d.0,
        &["not a plain file name"],
    );
}

#[test]
fn empty_directory() {
    let d = TempDir::new();
    expect_err(
        SafetensorsWeights::open(&d.0),
        &d.0,
        &["expected model.safetensors"],
    );
}

#[test]
fn truncated_file() {
    let d = TempDir::new();
    let p = d.write("m.safetensors", &[1, 2, 3]);
    expect_err(SafetensorsWeights::open(&p), &p, &["truncated"]);
}

#[test]
fn bad_header_length() {
    let d = TempDir::new();
    let mut b = build(&[("x", "F32", &[1], f32s(&[1.0]))]);
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = d.write("m.safetensors", &b);
    expect_err(
        SafetensorsWeights::open(&p),
        &p,
        &["bad header", "header length"],
    );
}

#[test]
fn bad_header_json() {
    let d = TempDir::new();
    let p = d.write("m.safetensors", &raw("{not json", &[]));
    expect_err(SafetensorsWeights::open(&p), &p, &["bad header", "JSON"]);
    let p = d.write("n.safetensors", &raw("[1, 2]", &[]));
    expect_err(SafetensorsWeights::open(&p), &p, &["bad header", "object"]);
    let p = d.write(
        "o.safetensors",
        &raw(r#"{"x": {"dtype": "F32", "shape": [1]}}"#, &[0; 4]),
    );
    let e = expect_err(SafetensorsWeights::open(&p), &p, &["data_offsets"]);
    assert_eq!(e.tensor.as_deref(), Some("x"));
    let p = d.write(
        "q.safetensors",
        &raw(
            r#"{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}"#,
            &[0; 4],
        ),
    );
    expect_err(SafetensorsWeights::open(&p), &p, &["shape"]);
}

#[test]
fn unknown_dtype() {
    let d = TempDir::new();
    let p = d.write("m.safetensors", &build(&[("x", "F17", &[1], vec![0; 4])]));
    let e = expect_err(SafetensorsWeights::open(&p), &p, &["unknown dtype `F17`"]);
    assert_eq!(e.tensor.as_deref(), Some("x"));
}

#[test]
fn data_out_of_bounds() {
    let d = TempDir::new();
    let p = d.write(
        "m.safetensors",
        &raw(
            r#"{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#,
            &[0; 8],
        ),
    );
    let e = expect_err(SafetensorsWeights::open(&p), &p, &["out of bounds"]);
    assert_eq!(e.tensor.as_deref(), Some("x"));
    let p = d.write(
        "n.safetensors",
        &raw(
            r#"{"x": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}"#,
            &[0; 8],
        ),
    );
    expect_err(SafetensorsWeights::open(&p), &p, &["out of bounds"]);
}

#[test]
fn data_size_mismatch_and_shape_overflow() {
    let d = TempDir::new();
    let p = d.write(
        "m.safetensors",
        &raw(
            r#"{"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#,
            &[0; 8],
        ),
    );
    expect_err(SafetensorsWeights::open(&p), &p, &["size mismatch"]);
    let p = d.write(
        "n.safetensors",
        &raw(
            r#"{"x": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}}"#,
            &[0; 8],
        ),
    );
    expect_err(SafetensorsWeights::open(&p), &p, &["overflow"]);
}

#[test]
fn missing_tensor_is_named() {
    let d = TempDir::new();
    let p = d.write("m.safetensors", &build(&[("x", "F32", &[1], f32s(&[1.0]))]));
    let w = SafetensorsWeights::open(&p).unwrap();
    let e = w.tensor_f32("model.norm.weight").unwrap_err();
    assert_eq!(e.tensor.as_deref(), Some("model.norm.weight"));
    assert!(w.shape("nope").is_err());
    assert!(!w.contains("nope"));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let d = TempDir::new();
    let full = build(&[
        ("x", "F32", &[2], f32s(&[1.0, 2.0])),
        ("y", "BF16", &[2], vec![0; 4]),
    ]);
    for len in 0..full.len() {
        let p = d.write("t.safetensors", &full[..len]);
        assert!(
            SafetensorsWeights::open(&p).is_err(),
            "truncated to {len} bytes was accepted"
        );
    }
}
