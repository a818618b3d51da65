//! The tokenizer and chat templates against transformers 4.57.3 (scripts/ref_tokenizer.py).
//!
//! The reference JSON is generated on first use into `<cache>/ref/tokenizer/` and regenerated
//! when the script is newer. Missing venv or model is a failure, not a skip: a silently
//! skipped reference test is how tokenizer drift ships.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use quiver_model::chat::{ChatMessage, ChatTemplate};
use quiver_model::tokenizer::Tokenizer;
use serde::Deserialize;

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn cache_dir() -> PathBuf {
    std::env::var_os("QUIVER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache")))
}

fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn gguf_path() -> PathBuf {
    cache_dir().join("models").join(GGUF_NAME)
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_with_special: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
}

#[derive(Deserialize)]
struct Chat {
    name: String,
    template: Option<String>,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
}

#[derive(Deserialize)]
struct Reference {
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<String>,
    cases: Vec<Case>,
    chats: Vec<Chat>,
}

fn modified(p: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Path of the reference directory, generating it if missing or older than the script.
fn ref_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let cache = cache_dir();
        let dir = cache.join("ref").join("tokenizer");
        let json = dir.join("tokenizer_ref.json");
        let script = repo_root().join("scripts").join("ref_tokenizer.py");
        let fresh = match (modified(&json), modified(&script)) {
            (Some(j), Some(s)) => j >= s,
            (Some(_), None) => true,
            _ => false,
        };
        if fresh {
            return dir;
        }
        let python = cache.join("venv").join("bin").join("python");
        let gguf = gguf_path();
        assert!(
            python.is_file(),
            "reference venv missing at {}: run `make test` (it runs scripts/setup-venv.sh) before cargo test",
            python.display()
        );
        assert!(
            gguf.is_file(),
            "model missing at {}: run `make test` (it runs scripts/fetch-model.sh) before cargo test",
            gguf.display()
        );
        let out = Command::new(&python)
            .arg(&script)
            .arg(&gguf)
            .arg(&dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed ({}):\n{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

fn reference() -> &'static Reference {
    static REF: OnceLock<Reference> = OnceLock::new();
    REF.get_or_init(|| {
        let path = ref_dir().join("tokenizer_ref.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

fn gguf_tokenizer() -> Tokenizer {
    let path = gguf_path();
    assert!(path.is_file(), "model missing at {}: run `make test`", path.display());
    Tokenizer::from_gguf_path(&path).expect("GGUF tokenizer")
}

fn check_against_reference(tok: &Tokenizer, what: &str) {
    let r = reference();
    assert!(r.cases.len() >= 300, "reference has only {} cases", r.cases.len());
    assert_eq!(tok.vocab_size(), r.vocab_size, "{what}: vocab size");
    assert_eq!(tok.bos_token_id(), r.bos_id, "{what}: bos id");
    assert!(r.eos_id.is_some_and(|e| tok.eos_token_ids().contains(&e)), "{what}: eos ids {:?}", tok.eos_token_ids());
    let mut failures = Vec::new();
    for c in &r.cases {
        let plain = tok.encode(&c.text, false).unwrap();
        if plain != c.ids {
            failures.push(format!("encode {:?}:\n  got  {plain:?}\n  want {:?}", c.text, c.ids));
            continue;
        }
        let special = tok.encode(&c.text, true).unwrap();
        if special != c.ids_with_special {
            failures.push(format!("encode+special {:?}: got {special:?} want {:?}", c.text, c.ids_with_special));
        }
        let dec = tok.decode(&c.ids, false).unwrap();
        if dec != c.decoded || dec != c.text {
            failures.push(format!("decode {:?}: got {dec:?} want {:?}", c.text, c.decoded));
        }
        let dec_skip = tok.decode(&c.ids, true).unwrap();
        if dec_skip != c.decoded_skip_special {
            failures.push(format!("decode skip {:?}: got {dec_skip:?} want {:?}", c.text, c.decoded_skip_special));
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {} cases differ from transformers:\n{}",
        failures.len(),
        r.cases.len(),
        failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn tokenizer_from_gguf_matches_transformers() {
    check_against_reference(&gguf_tokenizer(), "GGUF");
}

#[test]
fn tokenizer_from_hf_dir_matches_transformers() {
    let tok = Tokenizer::from_hf_dir(&ref_dir().join("hf")).expect("HF dir tokenizer");
    check_against_reference(&tok, "HF dir");
    let r = reference();
    assert_eq!(tok.chat_template().map(|t| t.source()), r.chat_template.as_deref());
}

fn check_chats(model_template: &ChatTemplate, what: &str) {
    let r = reference();
    let mut failures = Vec::new();
    for c in &r.chats {
        let owned;
        let tmpl = match &c.template {
            None => model_template,
            Some(src) => {
                owned = ChatTemplate::new(src, r.bos_token.clone(), r.eos_token.clone()).unwrap();
                &owned
            }
        };
        match tmpl.render(&c.messages, c.add_generation_prompt) {
            Ok(got) if got == c.rendered => {}
            Ok(got) => failures.push(format!(
                "{} (add_generation_prompt={}):\n  got  {got:?}\n  want {:?}",
                c.name, c.add_generation_prompt, c.rendered
            )),
            Err(e) => failures.push(format!("{}: render error: {e:#}", c.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {} chat renders differ from transformers:\n{}",
        failures.len(),
        r.chats.len(),
        failures.join("\n")
    );
}

#[test]
fn tokenizer_chat_template_from_gguf_matches_transformers() {
    let tok = gguf_tokenizer();
    let tmpl = tok.chat_template().expect("SmolLM2 GGUF has a chat template");
    assert_eq!(Some(tmpl.source()), reference().chat_template.as_deref());
    check_chats(tmpl, "GGUF template");
}

#[test]
fn tokenizer_chat_template_from_hf_dir_matches_transformers() {
    let tok = Tokenizer::from_hf_dir(&ref_dir().join("hf")).unwrap();
    check_chats(tok.chat_template().expect("saved HF dir has a chat template"), "HF dir template");
}

/// Every chunk is whole text, and the chunks add up to the full decode.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let mut stream = tok.decode_stream(skip);
    let mut chunks = Vec::new();
    for &id in ids {
        if let Some(c) = stream.step(id) {
            assert!(!c.contains('\u{FFFD}'), "chunk with a broken character: {c:?}");
            chunks.push(c);
        }
    }
    if let Some(c) = stream.flush() {
        chunks.push(c);
    }
    assert_eq!(chunks.concat(), tok.decode(ids, skip).unwrap(), "ids {ids:?}");
    chunks
}

#[test]
fn tokenizer_decode_stream_never_splits_characters() {
    let tok = gguf_tokenizer();
    let text = "héllo 😀😁 日本語のテキスト مرحبا 👨\u{200d}👩\u{200d}👧 z\u{335}\u{321}algo<|im_end|> end";
    let ids = tok.encode(text, false).unwrap();
    // The test only means something if some token holds a partial character.
    let partial = ids.iter().filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}')).count();
    assert!(partial > 0, "no token splits a character; pick another text");
    let chunks = check_stream(&tok, &ids, false);
    assert!(chunks.len() > 5);
    check_stream(&tok, &ids, true);
    for c in &reference().cases {
        check_stream(&tok, &c.ids, false);
    }
}

#[test]
fn tokenizer_decode_stream_holds_back_incomplete_character() {
    let tok = gguf_tokenizer();
    let ids = tok.encode("😀", false).unwrap();
    assert!(ids.len() > 1, "emoji is one token: {ids:?}");
    let mut s = tok.decode_stream(false);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(s.step(id), None, "emitted part of a character");
    }
    assert_eq!(s.step(*ids.last().unwrap()).as_deref(), Some("😀"));
    // A stream cut mid-character flushes the replacement character, like a full decode.
    let mut s = tok.decode_stream(false);
    assert_eq!(s.step(ids[0]), None);
    assert_eq!(s.flush(), Some(tok.decode(&ids[..1], false).unwrap()));
    // Out-of-vocabulary ids produce nothing and don't poison the stream.
    let mut s = tok.decode_stream(false);
    assert_eq!(s.step(u32::MAX), None);
    assert_eq!(s.step(tok.encode("a", false).unwrap()[0]).as_deref(), Some("a"));
}

#[test]
fn tokenizer_special_tokens_and_lookup() {
    let tok = gguf_tokenizer();
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert_eq!(tok.bos_token_id(), Some(1));
    // add_bos_token is false for SmolLM2: add_special_tokens must not add a BOS.
    assert_eq!(tok.encode("hi", true).unwrap(), tok.encode("hi", false).unwrap());
    assert!(tok.decode(&[tok.vocab_size() as u32], false).is_err());
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("quiver-tok-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn tokenizer_generation_config_eos_list_and_int() {
    let src = ref_dir().join("hf");
    let d = TempDir::new("gencfg");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), d.0.join(f)).unwrap();
    }
    std::fs::write(d.0.join("generation_config.json"), r#"{"eos_token_id": [2, 0], "bos_token_id": 1}"#).unwrap();
    let tok = Tokenizer::from_hf_dir(&d.0).unwrap();
    assert_eq!(tok.eos_token_ids(), &[2, 0]);
    assert!(tok.chat_template().is_none(), "no chat_template.jinja copied");
    std::fs::write(d.0.join("generation_config.json"), r#"{"eos_token_id": 0}"#).unwrap();
    assert_eq!(Tokenizer::from_hf_dir(&d.0).unwrap().eos_token_ids(), &[2, 0]);
    // Templates embedded in tokenizer_config.json (older transformers) are found too.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.0.join("tokenizer_config.json")).unwrap()).unwrap();
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into();
    std::fs::write(d.0.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = Tokenizer::from_hf_dir(&d.0).unwrap();
    let out = tok.chat_template().unwrap().render(&[ChatMessage::new("user", "x")], false).unwrap();
    assert_eq!(out, "<|im_start|>x");
}

fn err_of(r: anyhow::Result<Tokenizer>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

#[test]
fn tokenizer_bad_hf_dir_errors_name_the_file() {
    let d = TempDir::new("bad");
    let e = err_of(Tokenizer::from_hf_dir(&d.0));
    assert!(e.contains("tokenizer.json") && e.contains("missing"), "{e}");
    std::fs::write(d.0.join("tokenizer.json"), b"{\"version\": \"1.0\", \"model\": ").unwrap();
    let e = err_of(Tokenizer::from_hf_dir(&d.0));
    assert!(e.contains(&d.0.join("tokenizer.json").display().to_string()), "{e}");
    std::fs::copy(ref_dir().join("hf").join("tokenizer.json"), d.0.join("tokenizer.json")).unwrap();
    std::fs::write(d.0.join("tokenizer_config.json"), b"not json").unwrap();
    let e = err_of(Tokenizer::from_hf_dir(&d.0));
    assert!(e.contains("tokenizer_config.json") && e.contains("invalid JSON"), "{e}");
    std::fs::remove_file(d.0.join("tokenizer_config.json")).unwrap();
    std::fs::write(d.0.join("generation_config.json"), br#"{"eos_token_id": "x"}"#).unwrap();
    let e = err_of(Tokenizer::from_hf_dir(&d.0));
    assert!(e.contains("generation_config.json"), "{e}");
    std::fs::remove_file(d.0.join("generation_config.json")).unwrap();
    std::fs::write(d.0.join("chat_template.jinja"), b"{% for %}").unwrap();
    let e = err_of(Tokenizer::from_hf_dir(&d.0));
    assert!(e.contains("chat template"), "{e}");
}

/// A minimal GGUF v3 file: header and the given string metadata, no tensors.
fn write_gguf(path: &Path, kv: &[(&str, &str)]) {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        b.extend_from_slice(v.as_bytes());
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn tokenizer_gguf_without_tokenizer_metadata_errors() {
    let d = TempDir::new("gguf");
    let p = d.0.join("no-tokenizer.gguf");
    write_gguf(&p, &[("general.architecture", "llama")]);
    let e = err_of(Tokenizer::from_gguf_path(&p));
    assert!(e.contains("no-tokenizer.gguf") && e.contains("tokenizer.ggml.model"), "{e}");
    let p = d.0.join("spm.gguf");
    write_gguf(&p, &[("general.architecture", "llama"), ("tokenizer.ggml.model", "llama")]);
    let e = err_of(Tokenizer::from_gguf_path(&p));
    assert!(e.contains("spm.gguf") && e.contains("`llama` is not supported"), "{e}");
    let e = err_of(Tokenizer::from_gguf_path(&d.0.join("absent.gguf")));
    assert!(e.contains("absent.gguf"), "{e}");
}

#[test]
fn tokenizer_gguf_data_validation() {
    use quiver_model::tokenizer::GgufTokenizerData;
    let base = GgufTokenizerData {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens: ["a", "b", "ab", "<s>"].map(String::from).to_vec(),
        token_types: vec![1, 1, 1, 3],
        merges: vec!["a b".into()],
        bos_id: Some(3),
        eos_id: Some(3),
        add_bos: true,
        ..Default::default()
    };
    let tok = Tokenizer::from_gguf_data(base.clone()).unwrap();
    assert_eq!(tok.encode("ab<s>b", true).unwrap(), vec![3, 2, 3, 1]);
    assert_eq!(tok.decode(&[3, 2, 3, 1], true).unwrap(), "abb");
    let err = |d: GgufTokenizerData| format!("{:#}", Tokenizer::from_gguf_data(d).unwrap_err());
    assert!(err(GgufTokenizerData { pre: Some("falcon".into()), ..base.clone() }).contains("`falcon` is not supported"));
    assert!(err(GgufTokenizerData { merges: vec!["ab".into()], ..base.clone() }).contains("merges"));
    assert!(err(GgufTokenizerData { bos_id: Some(9), ..base.clone() }).contains("bos_token_id"));
    assert!(err(GgufTokenizerData { token_types: vec![1], ..base.clone() }).contains("token_type"));
    for pre in ["llama-bpe", "llama3", "qwen2", "smollm", "default"] {
        Tokenizer::from_gguf_data(GgufTokenizerData { pre: Some(pre.into()), ..base.clone() }).unwrap();
    }
}
