//! Cheap checks that run before any expensive or unbounded work on a request: adapter names
//! (they become metric labels, log fields and registry keys), the prompt-length bound that
//! refuses a huge prompt without tokenizing it, and how adapter paths are shown to clients.

use std::path::Path;

use crate::error::ApiError;

/// Longest adapter name accepted anywhere (a 1 MB name once made `/metrics` 134 MB).
pub const MAX_ADAPTER_NAME: usize = 128;

/// Why `name` cannot be an adapter name, if it cannot: non-empty, at most
/// [`MAX_ADAPTER_NAME`] bytes, ASCII letters, digits and `. _ - / + @` (no ':' — it splits
/// `base:adapter` —, no ',' — `vllm:lora_requests_info` joins names with it —, no quotes,
/// spaces or control characters).
pub fn adapter_name_error(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("adapter names must not be empty".into());
    }
    if name.len() > MAX_ADAPTER_NAME {
        return Some(format!("adapter names are at most {MAX_ADAPTER_NAME} bytes, this one has {}", name.len()));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/+@".contains(&b)) {
        return Some("adapter names may contain only ASCII letters, digits and . _ - / + @".into());
    }
    None
}

/// [`adapter_name_error`] as a 400 about `param`.
pub fn check_adapter_name(param: &str, name: &str) -> Result<(), ApiError> {
    match adapter_name_error(name) {
        None => Ok(()),
        Some(why) => Err(ApiError::field(param, format!("`{param}`: {why}"))),
    }
}

/// Refuses text that cannot fit the context window whatever it tokenizes to: every token
/// stands for at most `max_token_bytes` bytes of text, so more than `max_token_bytes ·
/// max_model_len` bytes are more than `max_model_len` tokens. Checked before tokenizing.
pub fn check_prompt_bytes(param: &str, bytes: usize, max_token_bytes: usize, max_model_len: usize) -> Result<(), ApiError> {
    let limit = max_token_bytes.saturating_mul(max_model_len);
    if bytes > limit {
        return Err(ApiError::field(
            param,
            format!(
                "This model's maximum context length is {max_model_len} tokens; the {param} is {bytes} bytes, which is more than {max_model_len} tokens of at most {max_token_bytes} bytes each. Please reduce the length of the {param}."
            ),
        ));
    }
    Ok(())
}

/// How an adapter's path is shown over HTTP: relative to `--lora-dir` when inside it, else
/// only its last component (the server's directory layout is not the client's business).
pub fn shown_path(lora_dir: Option<&Path>, path: &Path) -> String {
    if let Some(root) = lora_dir.and_then(|r| r.canonicalize().ok()) {
        let p = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        if let Ok(rel) = p.strip_prefix(&root) {
            return rel.display().to_string();
        }
    }
    path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_names() {
        for ok in ["a", "my-adapter_v2.1", "org/name", "x+y@3"] {
            assert!(adapter_name_error(ok).is_none(), "{ok}");
        }
        for bad in ["", "a:b", "a,b", "a b", "a\"b", "a\nb", "é"] {
            assert!(adapter_name_error(bad).is_some(), "{bad:?}");
        }
        assert!(adapter_name_error(&"x".repeat(MAX_ADAPTER_NAME)).is_none());
        let e = adapter_name_error(&"x".repeat(1 << 20)).unwrap();
        assert!(e.contains("at most 128 bytes") && e.len() < 200, "{e}");
    }

    #[test]
    fn prompt_bytes_bound() {
        assert!(check_prompt_bytes("prompt", 100, 10, 10).is_ok());
        let e = check_prompt_bytes("prompt", 101, 10, 10).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("prompt")));
        assert!(e.message.contains("maximum context length is 10 tokens"), "{}", e.message);
    }

    #[test]
    fn paths_are_shown_relative_to_the_lora_dir() {
        let root = std::env::temp_dir().join(format!("quiver-shown-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        assert_eq!(shown_path(Some(&root), &root.join("a/b")), "a/b");
        assert_eq!(shown_path(Some(&root), Path::new("/somewhere/else/x")), "x");
        assert_eq!(shown_path(None, &root.join("a")), "a");
        let _ = std::fs::remove_dir_all(&root);
    }
}
