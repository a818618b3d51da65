//! GGUF parser tests: hand-built corrupt files (one per failure class), and bit-exact
//! dequantization against the `gguf` Python package (the oracle llama.cpp's own tools use).

// `%` rather than `is_multiple_of`: the workspace declares rust-version 1.85, older than that API.
#![allow(clippy::manual_is_multiple_of)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use quiver_model::formats::gguf::{dequantize, GgmlType, GgufFile, GgufValue};
use quiver_model::formats::{FormatError, WeightSource};

// ---------------------------------------------------------------------------------------------
// Environment: the Python oracle lives in the project's cache venv.

fn cache_dir() -> PathBuf {
    std::env::var_os("QUIVER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache")))
}

fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn python() -> PathBuf {
    let py = cache_dir().join("venv/bin/python");
    assert!(
        py.exists(),
        "Python venv not found at {}: run `make test` or scripts/setup-venv.sh to create it \
         (the GGUF oracle tests need the `gguf` package)",
        py.display()
    );
    py
}

/// Runs the fixture script into a private directory and renames it into place, so concurrent
/// test processes never see a half-written fixture.
fn ensure_fixture(dir_name: &str, marker: &str, args: &[&str]) -> PathBuf {
    // Tests in one process run on several threads; generate each fixture once.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = cache_dir().join("fixtures").join(dir_name);
    if dir.join(marker).exists() {
        return dir;
    }
    let tmp = cache_dir().join("fixtures").join(format!(
        "{dir_name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("create fixture dir");
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("scripts/gguf_fixtures.py"))
        .args(args)
        .arg(&tmp);
    let out = cmd.output().expect("run scripts/gguf_fixtures.py");
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    assert!(
        out.status.success(),
        "scripts/gguf_fixtures.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process won the race; its copy is equivalent.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    assert!(
        dir.join(marker).exists(),
        "fixture {} missing after generation",
        dir.join(marker).display()
    );
    dir
}

fn quant_fixture() -> PathBuf {
    ensure_fixture("gguf-quants-v1", "quants.gguf", &["quants"])
}

fn smollm2_path() -> PathBuf {
    let p = cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "model {} not found: run scripts/fetch-model.sh (or `make test`) to download it",
        p.display()
    );
    p
}

// ---------------------------------------------------------------------------------------------
// Oracle tests.

const ALL_TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn dequantize_matches_python_gguf_for_every_type() {
    let dir = quant_fixture();
    let f = GgufFile::open(dir.join("quants.gguf")).unwrap();
    for ty in ALL_TYPES {
        let name = format!("{ty:?}");
        let info = f
            .tensor_info(&name)
            .unwrap_or_else(|| panic!("fixture lacks tensor {name}"));
        assert_eq!(info.ggml_type, ty);
        assert_eq!(info.dims, vec![512, 3]);
        let (got, shape) = f.tensor_f32(&name).unwrap();
        assert_eq!(shape, vec![3, 512]);
        let raw = std::fs::read(dir.join(format!("{name}.f32"))).unwrap();
        let want: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{name}: element {i}: rust {g:e} ({:#010x}) vs python {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
        // The free function agrees with the trait path.
        let bytes = f.tensor_bytes(&name).unwrap();
        let mut out = vec![0f32; got.len()];
        dequantize(ty, bytes, got.len(), &mut out).unwrap();
        assert!(out
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn metadata_of_every_value_type_matches_python_writer() {
    let f = GgufFile::open(quant_fixture().join("quants.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    let m = |k: &str| f.metadata(k).unwrap_or_else(|| panic!("missing key {k}"));
    assert_eq!(m("general.architecture").as_str(), Some("llama"));
    assert_eq!(m("test.u8"), &GgufValue::U8(200));
    assert_eq!(m("test.i8"), &GgufValue::I8(-100));
    assert_eq!(m("test.u16"), &GgufValue::U16(60000));
    assert_eq!(m("test.i16"), &GgufValue::I16(-30000));
    assert_eq!(m("test.u32"), &GgufValue::U32(4_000_000_000));
    assert_eq!(m("test.i32"), &GgufValue::I32(-2_000_000_000));
    assert_eq!(m("test.f32"), &GgufValue::F32(1.5));
    assert_eq!(m("test.bool").as_bool(), Some(true));
    assert_eq!(m("test.string").as_str(), Some("héllo"));
    assert_eq!(m("test.u64").as_u64(), Some((1u64 << 63) + 5));
    assert_eq!(m("test.i64").as_i64(), Some(-(1i64 << 62)));
    assert_eq!(m("test.f64").as_f64(), Some(2.25));
    let arr = m("test.array").as_array().unwrap();
    assert_eq!(
        arr.iter().map(|v| v.as_i64().unwrap()).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    let strs = m("test.strings").as_array().unwrap();
    assert_eq!(
        strs.iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>(),
        vec!["a", "bc"]
    );
    let nested = m("test.nested").as_array().unwrap();
    assert_eq!(nested.len(), 2);
    assert_eq!(nested[0].as_array().unwrap().len(), 2);
    assert_eq!(nested[1].as_array().unwrap()[0].as_i64(), Some(3));
    // Keys come back in file order.
    let keys: Vec<&str> = f.metadata_keys().collect();
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert!(pos("test.u8") < pos("test.i8") && pos("test.i8") < pos("test.nested"));
}

#[derive(serde::Deserialize)]
struct Sample {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    shape: Vec<u64>,
    n_elements: usize,
    indices: Vec<usize>,
    bits: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct ModelFacts {
    architecture: String,
    block_count: u64,
    embedding_length: u64,
    n_tensors: usize,
    samples: Vec<Sample>,
}

#[test]
fn smollm2_q4_1_metadata_and_values_match_python_gguf() {
    let model = smollm2_path();
    let model_s = model.to_str().unwrap().to_owned();
    let dir = ensure_fixture("gguf-smollm2-v1", "model.json", &["model", &model_s]);
    let facts: ModelFacts =
        serde_json::from_slice(&std::fs::read(dir.join("model.json")).unwrap()).unwrap();

    let f = GgufFile::open(&model).unwrap();
    assert_eq!(
        f.metadata("general.architecture")
            .and_then(GgufValue::as_str),
        Some("llama")
    );
    assert_eq!(
        f.metadata("llama.block_count").and_then(GgufValue::as_u64),
        Some(30)
    );
    assert_eq!(
        f.metadata("llama.embedding_length")
            .and_then(GgufValue::as_u64),
        Some(576)
    );
    assert_eq!(facts.architecture, "llama");
    assert_eq!(facts.block_count, 30);
    assert_eq!(facts.embedding_length, 576);
    assert_eq!(f.tensors().len(), facts.n_tensors);
    assert!(f
        .metadata("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .is_some_and(|t| t.len() == 49152));

    assert_eq!(facts.samples[0].ty, "Q4_1");
    for s in &facts.samples {
        let info = f.tensor_info(&s.name).unwrap();
        assert_eq!(format!("{:?}", info.ggml_type), s.ty);
        assert_eq!(info.dims, s.shape);
        let t0 = std::time::Instant::now();
        let (vals, shape) = f.tensor_f32(&s.name).unwrap();
        eprintln!(
            "{} ({}, {:?}) dequantized in {:?}",
            s.name,
            s.ty,
            shape,
            t0.elapsed()
        );
        assert_eq!(vals.len(), s.n_elements);
        assert_eq!(
            shape,
            s.shape
                .iter()
                .rev()
                .map(|&d| d as usize)
                .collect::<Vec<_>>()
        );
        for (&i, &b) in s.indices.iter().zip(&s.bits) {
            assert_eq!(
                vals[i].to_bits(),
                b,
                "{} element {i}: rust {} vs python {}",
                s.name,
                vals[i],
                f32::from_bits(b)
            );
        }
    }
    let embd = f.shape("token_embd.weight").unwrap();
    assert_eq!(embd, vec![49152, 576]);
}

// ---------------------------------------------------------------------------------------------
// Hand-built files.

/// A GGUF byte builder. Fields are written exactly as given, so tests can lie about counts.
#[derive(Default)]
struct G(Vec<u8>);

impl G {
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        G::default()
            .bytes(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut g = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            g = g.u64(d);
        }
        g.u32(ty).u64(offset)
    }
    fn pad(mut self, align: usize) -> Self {
        while self.0.len() % align != 0 {
            self.0.push(0);
        }
        self
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp(bytes: &[u8]) -> TempFile {
    let p = std::env::temp_dir().join(format!(
        "quiver-gguf-test-{}-{}.gguf",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&p, bytes).unwrap();
    TempFile(p)
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, FormatError> {
    let t = temp(bytes);
    GgufFile::open(&t.0)
}

/// Opening must fail with an error naming the file and containing every `needles` fragment.
fn expect_err(bytes: &[u8], needles: &[&str]) -> FormatError {
    let t = temp(bytes);
    let e = GgufFile::open(&t.0).expect_err("corrupt file was accepted");
    assert_eq!(e.path, t.0);
    let msg = e.to_string();
    assert!(
        msg.contains(t.0.to_str().unwrap()),
        "message does not name the file: {msg}"
    );
    for n in needles {
        assert!(msg.contains(n), "expected `{n}` in error: {msg}");
    }
    e
}

/// Two tensors: `w` F32 [2 rows x 4 cols] and `q` Q8_0 [32], with one string key.
fn valid(version: u32, alignment: Option<u32>) -> Vec<u8> {
    let align = alignment.unwrap_or(32) as usize;
    let mut g = G::header(version, 2, if alignment.is_some() { 2 } else { 1 })
        .str("general.architecture")
        .u32(8)
        .str("llama");
    if let Some(a) = alignment {
        g = g.str("general.alignment").u32(4).u32(a);
    }
    let q_off = (32usize).div_ceil(align) * align;
    g = g
        .tensor("w", &[4, 2], 0, 0)
        .tensor("q", &[32], 8, q_off as u64)
        .pad(align);
    for i in 0..8 {
        g = g.bytes(&(i as f32).to_le_bytes());
    }
    let mut data = g.pad(align);
    // Q8_0 block: f16 d = 0.5, then qs = 0..32 as i8 offset by -16.
    data = data.bytes(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    for i in 0..32i32 {
        data.0.push((i - 16) as i8 as u8);
    }
    data.0
}

#[test]
fn valid_v3_and_v2_files_parse_and_dequantize() {
    for (version, align) in [(3, None), (2, None), (3, Some(64)), (3, Some(8))] {
        let f = open_bytes(&valid(version, align)).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.shape("w").unwrap(), vec![2, 4]);
        assert_eq!(
            f.tensor_f32("w").unwrap().0,
            (0..8).map(|i| i as f32).collect::<Vec<_>>()
        );
        let (q, shape) = f.tensor_f32("q").unwrap();
        assert_eq!(shape, vec![32]);
        assert_eq!(q[0], -8.0);
        assert_eq!(q[31], 7.5);
        assert_eq!(f.tensor_names(), vec!["w".to_string(), "q".to_string()]);
        assert!(f.contains("q") && !f.contains("nope"));
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = valid(3, None);
    for len in 0..full.len() {
        assert!(
            open_bytes(&full[..len]).is_err(),
            "truncated to {len} bytes was accepted"
        );
    }
}

#[test]
fn random_corruption_never_panics() {
    let full = valid(3, None);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..3000 {
        let mut b = full.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % b.len() as u64) as usize;
            b[i] = next() as u8;
        }
        if let Ok(f) = open_bytes(&b) {
            for name in f.tensor_names() {
                let _ = f.tensor_f32(&name);
            }
        }
    }
}

#[test]
fn empty_file() {
    expect_err(&[], &["truncated"]);
}

#[test]
fn truncated_header() {
    expect_err(&G::header(3, 0, 0).0[..20], &["truncated"]);
}

#[test]
fn wrong_magic() {
    let mut b = valid(3, None);
    b[..4].copy_from_slice(b"GGML");
    expect_err(&b, &["not a GGUF file", "expected \"GGUF\""]);
}

#[test]
fn unsupported_version() {
    expect_err(&G::header(1, 0, 0).0, &["version 1", "expected 2 or 3"]);
    expect_err(&G::header(4, 0, 0).0, &["version 4", "expected 2 or 3"]);
    expect_err(&G::header(3u32.swap_bytes(), 0, 0).0, &["big-endian"]);
}

#[test]
fn absurd_tensor_count() {
    expect_err(&G::header(3, u64::MAX, 0).0, &["tensor count", "remaining"]);
}

#[test]
fn absurd_metadata_count() {
    expect_err(&G::header(3, 0, 1 << 40).0, &["metadata key/value count"]);
}

#[test]
fn absurd_string_length() {
    let b = G::header(3, 0, 1)
        .u64(u64::MAX - 3)
        .bytes(b"key")
        .u32(4)
        .u32(1);
    expect_err(&b.0, &["length of metadata key #0"]);
    let b = G::header(3, 0, 1).str("k").u32(8).u64(1 << 50).bytes(b"xx");
    expect_err(&b.0, &["length of k"]);
}

#[test]
fn absurd_array_length() {
    let b = G::header(3, 0, 1)
        .str("arr")
        .u32(9)
        .u32(4)
        .u64(1 << 40)
        .u32(1)
        .u32(2);
    expect_err(&b.0, &["element count of metadata array `arr`"]);
}

#[test]
fn unknown_metadata_value_type() {
    let b = G::header(3, 0, 1).str("k").u32(13).u64(0);
    expect_err(&b.0, &["unknown value type 13"]);
    let b = G::header(3, 0, 1).str("k").u32(9).u32(99).u64(1).u64(0);
    expect_err(&b.0, &["unknown array element type 99"]);
}

#[test]
fn invalid_bool_and_utf8_key() {
    let b = G::header(3, 0, 1).str("k").u32(7).bytes(&[2]);
    expect_err(&b.0, &["bool must be 0 or 1"]);
    let b = G::header(3, 0, 1)
        .u64(2)
        .bytes(&[0xff, 0xfe])
        .u32(0)
        .bytes(&[0]);
    expect_err(&b.0, &["not valid UTF-8"]);
}

#[test]
fn deeply_nested_arrays() {
    let mut g = G::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..100 {
        g = g.u32(9).u64(1);
    }
    g = g.u32(0).u64(0);
    expect_err(&g.0, &["nested deeper"]);
}

#[test]
fn duplicate_metadata_key() {
    let b = G::header(3, 0, 2)
        .str("k")
        .u32(0)
        .bytes(&[1])
        .str("k")
        .u32(0)
        .bytes(&[2]);
    expect_err(&b.0, &["duplicate metadata key `k`"]);
}

#[test]
fn bad_alignment() {
    let b = G::header(3, 0, 1).str("general.alignment").u32(4).u32(24);
    expect_err(&b.0, &["general.alignment", "power of two"]);
    let b = G::header(3, 0, 1).str("general.alignment").u32(8).str("32");
    expect_err(&b.0, &["general.alignment", "power of two"]);
}

fn one_tensor(dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut g = G::header(3, 1, 0).tensor("t", dims, ty, offset).pad(32);
    g.0.resize(g.0.len() + data_len, 0);
    g.0
}

fn expect_tensor_err(bytes: &[u8], needles: &[&str]) {
    let e = expect_err(bytes, needles);
    assert_eq!(
        e.tensor.as_deref(),
        Some("t"),
        "error should name the tensor: {e}"
    );
}

#[test]
fn unknown_ggml_type() {
    expect_tensor_err(&one_tensor(&[4], 5, 0, 64), &["unknown ggml type id 5"]);
    expect_tensor_err(
        &one_tensor(&[4], 1000, 0, 64),
        &["unknown ggml type id 1000"],
    );
}

#[test]
fn dims_overflow() {
    expect_tensor_err(&one_tensor(&[1 << 40, 1 << 40], 0, 0, 64), &["overflow"]);
    expect_tensor_err(&one_tensor(&[1 << 62], 0, 0, 64), &["overflow"]);
}

#[test]
fn too_many_dims() {
    let b = G::header(3, 1, 0)
        .str("t")
        .u32(1_000_000)
        .u64(1)
        .u64(1)
        .u64(1);
    expect_tensor_err(&b.0, &["dimensions"]);
}

#[test]
fn row_not_multiple_of_block() {
    expect_tensor_err(
        &one_tensor(&[33], 8, 0, 64),
        &["not a multiple of the Q8_0 block size 32"],
    );
}

#[test]
fn misaligned_offset() {
    expect_tensor_err(
        &one_tensor(&[4], 0, 4, 64),
        &["not a multiple of the alignment 32"],
    );
}

#[test]
fn tensor_data_out_of_bounds() {
    expect_tensor_err(&one_tensor(&[64], 0, 0, 100), &["out of bounds"]);
    expect_tensor_err(&one_tensor(&[4], 0, 1 << 40, 64), &["out of bounds"]);
    expect_tensor_err(&one_tensor(&[4], 0, u64::MAX - 31, 64), &["out of bounds"]);
}

#[test]
fn duplicate_tensor_name() {
    let mut g = G::header(3, 2, 0)
        .tensor("t", &[4], 0, 0)
        .tensor("t", &[4], 0, 32)
        .pad(32);
    g.0.resize(g.0.len() + 64, 0);
    expect_tensor_err(&g.0, &["duplicate tensor name"]);
}

#[test]
fn missing_tensor_is_named() {
    let f = open_bytes(&valid(3, None)).unwrap();
    let e = f.tensor_f32("blk.0.attn_q.weight").unwrap_err();
    assert_eq!(e.tensor.as_deref(), Some("blk.0.attn_q.weight"));
    let e = f.shape("nope").unwrap_err();
    assert!(e.to_string().contains("nope"));
}

#[test]
fn unsupported_quant_type_errors_on_read() {
    // IQ2_XXS (16) parses (so the rest of a file stays usable) but cannot be dequantized.
    let f = open_bytes(&one_tensor(&[256], 16, 0, 66)).unwrap();
    let e = f.tensor_f32("t").unwrap_err();
    assert_eq!(e.tensor.as_deref(), Some("t"));
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
}

#[test]
fn missing_file() {
    let e = GgufFile::open(Path::new("/nonexistent/quiver/model.gguf")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/quiver/model.gguf"));
}
