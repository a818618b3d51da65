//! Reading an adapter directory's files as untrusted input: only regular files are opened
//! (never a FIFO, device or socket, so no open or read can block forever), every read is
//! bounded by a size cap and copied into owned memory (a file truncated or rewritten while it
//! is read yields an error, never a SIGBUS as a shrinking memory map would), reads check a
//! deadline and a cancel flag between chunks, and under a sandbox root every file is opened
//! without following symlinks and its resolved path must lie inside the root.
//!
//! Errors name the file by its name inside the adapter directory, never an absolute path and
//! never any of the file's content.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use crate::error::{LoraError, Result};

/// `adapter_config.json` and `added_tokens.json` are a few KB; anything near this is not one.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The weights a default load accepts at most; the engine passes a tighter bound derived from
/// the model and the pool's rank.
pub const DEFAULT_MAX_WEIGHTS_BYTES: u64 = 4 << 30;
/// Reads are done in chunks of this size so that cancellation and the deadline are noticed.
const CHUNK: usize = 8 << 20;

/// What a load may read and how long it may take.
#[derive(Clone, Debug)]
pub struct ReadLimits {
    pub max_config_bytes: u64,
    /// The whole weights file (header included).
    pub max_weights_bytes: u64,
    /// Refuse any tensor whose rank exceeds this before reading its data (the pool's rank).
    pub max_rank: Option<usize>,
    pub deadline: Option<Instant>,
    /// Set to abandon the load (engine shutdown).
    pub cancel: Option<Arc<AtomicBool>>,
    /// Canonical `--lora-dir`: the directory and every file must resolve inside it, and files
    /// must not be symlinks.
    pub sandbox: Option<PathBuf>,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits { max_config_bytes: MAX_CONFIG_BYTES, max_weights_bytes: DEFAULT_MAX_WEIGHTS_BYTES, max_rank: None, deadline: None, cancel: None, sandbox: None }
    }
}

/// Size and modification time of the weights file as it was read, to detect files rewritten on
/// disk between a host-cache eviction and the reload (which would silently change a version's
/// weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    pub len: u64,
    pub modified: Option<SystemTime>,
}

impl FileStamp {
    fn of(md: &std::fs::Metadata) -> FileStamp {
        FileStamp { len: md.len(), modified: md.modified().ok() }
    }

    /// The stamp of the file at `path` now (following symlinks; `None` if it is gone).
    pub fn of_path(path: &Path) -> Option<FileStamp> {
        std::fs::metadata(path).ok().map(|m| FileStamp::of(&m))
    }
}

/// One adapter file, opened and checked.
pub(crate) struct OpenFile {
    file: File,
    pub name: &'static str,
    pub len: u64,
    pub stamp: FileStamp,
}

pub(crate) struct AdapterDir<'a> {
    pub adapter: &'a str,
    pub dir: PathBuf,
    pub limits: &'a ReadLimits,
}

impl<'a> AdapterDir<'a> {
    /// Checks that `dir` is a directory (inside the sandbox, if any).
    pub fn new(adapter: &'a str, dir: &Path, limits: &'a ReadLimits) -> Result<Self> {
        let err = |reason: &str| LoraError::File { adapter: adapter.into(), file: "adapter directory".into(), reason: reason.into() };
        let md = std::fs::metadata(dir).map_err(|_| err("not found"))?;
        if !md.is_dir() {
            return Err(err("not a directory (expected a PEFT adapter directory)"));
        }
        let dir = match &limits.sandbox {
            Some(root) => {
                let canon = dir.canonicalize().map_err(|_| err("cannot be resolved"))?;
                if !canon.starts_with(root) {
                    return Err(err("resolves outside --lora-dir"));
                }
                canon
            }
            None => dir.to_path_buf(),
        };
        Ok(AdapterDir { adapter, dir, limits })
    }

    pub fn err(&self, file: &str, reason: impl Into<String>) -> LoraError {
        LoraError::File { adapter: self.adapter.into(), file: file.into(), reason: reason.into() }
    }

    /// Whether `name` exists in the directory (a symlink counts, and is refused on open).
    pub fn exists(&self, name: &str) -> bool {
        std::fs::symlink_metadata(self.dir.join(name)).is_ok()
    }

    /// Opens `name` read-only: non-blocking (a FIFO cannot stall the open), regular files only,
    /// and under a sandbox without following a final symlink and only if it resolves inside.
    pub fn open(&self, name: &'static str, max_len: u64) -> Result<OpenFile> {
        let path = self.dir.join(name);
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            let nofollow = if self.limits.sandbox.is_some() { libc::O_NOFOLLOW } else { 0 };
            opts.custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | nofollow);
        }
        let file = opts.open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => self.err(name, "missing"),
            _ if e.raw_os_error() == Some(libc::ELOOP) => self.err(name, "is a symbolic link; files under --lora-dir must be regular files"),
            _ => self.err(name, format!("cannot open: {}", e.kind())),
        })?;
        let md = file.metadata().map_err(|e| self.err(name, format!("cannot stat: {}", e.kind())))?;
        if !md.is_file() {
            return Err(self.err(name, "is not a regular file"));
        }
        if let Some(root) = &self.limits.sandbox {
            if !resolved_path(&file, &path).is_some_and(|p| p.starts_with(root)) {
                return Err(self.err(name, "resolves outside --lora-dir"));
            }
        }
        if md.len() > max_len {
            return Err(self.err(name, format!("is {} bytes, more than the {max_len} bytes allowed", md.len())));
        }
        Ok(OpenFile { file, name, len: md.len(), stamp: FileStamp::of(&md) })
    }

    /// Reads the whole of a small text file (config) under the config cap.
    pub fn read_text(&self, name: &'static str) -> Result<String> {
        let mut f = self.open(name, self.limits.max_config_bytes)?;
        let len = f.len as usize;
        let mut buf = Vec::new();
        f.read_into(&mut buf, len, self)?;
        // Bounded even if the file grew after the stat.
        String::from_utf8(buf).map_err(|_| self.err(name, "is not UTF-8 text"))
    }
}

impl OpenFile {
    /// Appends exactly `n` bytes of the file (from the current position) to `out`, in chunks,
    /// checking the cancel flag and the deadline between them. A file that ends early (it was
    /// truncated while being read) is an error.
    pub fn read_into(&mut self, out: &mut Vec<u8>, n: usize, d: &AdapterDir) -> Result<()> {
        let start = out.len();
        out.try_reserve_exact(n).map_err(|_| d.err(self.name, format!("cannot allocate {n} bytes")))?;
        let mut done = 0;
        let fail = |out: &mut Vec<u8>, why: String| {
            out.truncate(start);
            Err(d.err(self.name, why))
        };
        while done < n {
            if d.limits.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) {
                return fail(out, "load cancelled (the engine is shutting down)".into());
            }
            if d.limits.deadline.is_some_and(|t| Instant::now() > t) {
                return fail(out, "load timed out while reading".into());
            }
            // `take` + `read_to_end` fills the reserved capacity without zeroing it first, so
            // memory is touched only as the file delivers bytes.
            let want = CHUNK.min(n - done) as u64;
            match (&mut self.file).take(want).read_to_end(out) {
                Ok(0) => return fail(out, "ended early: the file shrank while it was being read (rewritten during the load?)".into()),
                Ok(k) => done += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return fail(out, format!("read failed: {}", e.kind())),
            }
        }
        Ok(())
    }

    /// True if the file on disk still has the size and time it had when opened.
    pub fn unchanged(&self) -> bool {
        self.file.metadata().is_ok_and(|m| FileStamp::of(&m) == self.stamp)
    }
}

/// Where an open file really is: the kernel's view of the descriptor on Linux, else the
/// canonical form of the path it was opened by.
fn resolved_path(file: &File, path: &Path) -> Option<PathBuf> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if let Ok(p) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
            return Some(p);
        }
    }
    let _ = file;
    path.canonicalize().ok()
}
