//! Adapter paths and startup specs: the `--lora-dir` sandbox and the vLLM/SGLang flag forms.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

/// Why a path was refused; the HTTP layer maps `Outside` to 400 and `Missing` to 404.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    Outside(String),
    Missing(String),
}

impl std::fmt::Display for PathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathError::Outside(m) | PathError::Missing(m) => f.write_str(m),
        }
    }
}

/// Resolves an adapter path given over HTTP. With a sandbox root (`--lora-dir`), relative
/// paths are taken under it, `..` components are refused before anything is touched, and the
/// canonical path (symlinks resolved) must lie inside the canonical root. Only metadata is
/// consulted here; no adapter file is read unless this returns `Ok`.
pub fn resolve_adapter_path(root: Option<&Path>, requested: &str) -> Result<PathBuf, PathError> {
    let p = Path::new(requested.trim());
    // Echoed in errors: the client's own text, but not an unbounded amount of it.
    let req = if requested.trim().len() <= 256 { requested.trim() } else { "(a path longer than 256 bytes)" };
    if req.is_empty() {
        return Err(PathError::Outside("`lora_path` is empty".into()));
    }
    let Some(root) = root else {
        return p.canonicalize().map_err(|_| PathError::Missing(format!("No adapter found at {req}")));
    };
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(PathError::Outside(format!("`lora_path` {req} must not contain `..`; adapters are loaded only from inside --lora-dir")));
    }
    let root = root.canonicalize().map_err(|e| PathError::Missing(format!("--lora-dir is not usable: {}", e.kind())))?;
    let joined = if p.is_absolute() { p.to_path_buf() } else { root.join(p) };
    // Refuse absolute paths outside the root before touching them.
    if p.is_absolute() && !joined.starts_with(&root) && !lexically_inside_after_canon(&joined, &root) {
        return Err(PathError::Outside(format!("`lora_path` {req} is outside --lora-dir")));
    }
    let canon = joined.canonicalize().map_err(|_| PathError::Missing(format!("No adapter found at {req} under --lora-dir")))?;
    if !canon.starts_with(&root) {
        return Err(PathError::Outside(format!("`lora_path` {req} resolves outside --lora-dir")));
    }
    Ok(canon)
}

/// An absolute path written through a symlinked spelling of the root (e.g. `/tmp` vs
/// `/private/tmp`) is still inside if its parent canonicalizes under the root.
fn lexically_inside_after_canon(p: &Path, root: &Path) -> bool {
    p.parent().and_then(|d| d.canonicalize().ok()).is_some_and(|d| d.starts_with(root))
}

/// The directory `--lora-dir/<name>` for on-demand loading, if `name` is a plain single path
/// component naming a directory there.
pub fn on_demand_dir(root: &Path, name: &str) -> Option<PathBuf> {
    let p = Path::new(name);
    let mut comps = p.components();
    if !matches!((comps.next(), comps.next()), (Some(Component::Normal(_)), None)) {
        return None;
    }
    let root = root.canonicalize().ok()?;
    let canon = root.join(p).canonicalize().ok()?;
    (canon.starts_with(&root) && canon.is_dir()).then_some(canon)
}

/// One adapter to load at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupAdapter {
    pub name: String,
    pub path: PathBuf,
    pub pinned: bool,
}

/// vLLM `--lora-modules`: `name=path` or JSON `{"name", "path", "base_model_name"}`.
pub fn parse_lora_module(s: &str) -> Result<StartupAdapter, String> {
    let s = s.trim();
    if s.starts_with('{') {
        let v: Value = serde_json::from_str(s).map_err(|e| format!("--lora-modules {s}: bad JSON: {e}"))?;
        let name = v.get("name").and_then(Value::as_str).ok_or_else(|| format!("--lora-modules {s}: JSON needs a string `name`"))?;
        let path = v.get("path").and_then(Value::as_str).ok_or_else(|| format!("--lora-modules {s}: JSON needs a string `path`"))?;
        return Ok(StartupAdapter { name: name.into(), path: path.into(), pinned: false });
    }
    match s.split_once('=') {
        Some((n, p)) if !n.trim().is_empty() && !p.trim().is_empty() => Ok(StartupAdapter { name: n.trim().into(), path: p.trim().into(), pinned: false }),
        _ => Err(format!("--lora-modules {s}: expected name=path or a JSON object")),
    }
}

/// SGLang `--lora-paths`: `PATH`, `NAME=PATH` or JSON `{"lora_name", "lora_path", "pinned"}`.
/// A bare path is registered under its own text, as SGLang does.
pub fn parse_lora_path(s: &str) -> Result<StartupAdapter, String> {
    let s = s.trim();
    if s.starts_with('{') {
        let v: Value = serde_json::from_str(s).map_err(|e| format!("--lora-paths {s}: bad JSON: {e}"))?;
        let name = v.get("lora_name").and_then(Value::as_str).ok_or_else(|| format!("--lora-paths {s}: JSON needs a string `lora_name`"))?;
        let path = v.get("lora_path").and_then(Value::as_str).ok_or_else(|| format!("--lora-paths {s}: JSON needs a string `lora_path`"))?;
        let pinned = v.get("pinned").and_then(Value::as_bool).unwrap_or(false);
        return Ok(StartupAdapter { name: name.into(), path: path.into(), pinned });
    }
    match s.split_once('=') {
        Some((n, p)) if !n.trim().is_empty() && !p.trim().is_empty() => Ok(StartupAdapter { name: n.trim().into(), path: p.trim().into(), pinned: false }),
        Some(_) => Err(format!("--lora-paths {s}: expected PATH, NAME=PATH or a JSON object")),
        None if s.is_empty() => Err("--lora-paths: empty entry".into()),
        None => Ok(StartupAdapter { name: s.into(), path: s.into(), pinned: false }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("quiver-sandbox-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn sandbox() {
        let base = tmp("sb");
        let root = base.join("loras");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(base.join("secret")).unwrap();
        let canon_root = root.canonicalize().unwrap();
        // Inside: relative and absolute.
        assert_eq!(resolve_adapter_path(Some(&root), "a").unwrap(), canon_root.join("a"));
        assert_eq!(resolve_adapter_path(Some(&root), root.join("a").to_str().unwrap()).unwrap(), canon_root.join("a"));
        // `..`, absolute outside, symlink escape.
        assert!(matches!(resolve_adapter_path(Some(&root), "../secret"), Err(PathError::Outside(_))));
        assert!(matches!(resolve_adapter_path(Some(&root), "a/../../secret"), Err(PathError::Outside(_))));
        assert!(matches!(resolve_adapter_path(Some(&root), base.join("secret").to_str().unwrap()), Err(PathError::Outside(_))));
        assert!(matches!(resolve_adapter_path(Some(&root), "/etc"), Err(PathError::Outside(_))));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(base.join("secret"), root.join("link")).unwrap();
            assert!(matches!(resolve_adapter_path(Some(&root), "link"), Err(PathError::Outside(_))));
            assert!(on_demand_dir(&root, "link").is_none());
        }
        // Missing inside.
        assert!(matches!(resolve_adapter_path(Some(&root), "nope"), Err(PathError::Missing(_))));
        assert!(matches!(resolve_adapter_path(Some(&root), ""), Err(PathError::Outside(_))));
        // No sandbox: any existing path.
        assert!(resolve_adapter_path(None, base.join("secret").to_str().unwrap()).is_ok());
        // On-demand names: single components only.
        assert_eq!(on_demand_dir(&root, "a"), Some(canon_root.join("a")));
        assert!(on_demand_dir(&root, "../secret").is_none());
        assert!(on_demand_dir(&root, "a/b").is_none());
        assert!(on_demand_dir(&root, "missing").is_none());
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn specs() {
        assert_eq!(parse_lora_module("x=/p").unwrap(), StartupAdapter { name: "x".into(), path: "/p".into(), pinned: false });
        assert_eq!(parse_lora_module(r#"{"name":"x","path":"/p","base_model_name":"b"}"#).unwrap().name, "x");
        assert!(parse_lora_module("/p").is_err());
        assert_eq!(parse_lora_path("/p/q").unwrap(), StartupAdapter { name: "/p/q".into(), path: "/p/q".into(), pinned: false });
        assert_eq!(parse_lora_path("n=/p").unwrap().name, "n");
        let a = parse_lora_path(r#"{"lora_name":"n","lora_path":"/p","pinned":true}"#).unwrap();
        assert!(a.pinned && a.name == "n");
        assert!(parse_lora_path(r#"{"lora_name":"n"}"#).is_err());
    }
}
