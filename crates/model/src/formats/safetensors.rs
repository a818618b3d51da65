//! Hugging Face safetensors (single file or sharded index), memory-mapped.
//!
//! The header is parsed by hand (it is a length-prefixed JSON object) rather than through the
//! `safetensors` crate so that every error can name the shard and tensor at fault. All offsets
//! are validated at open, so later reads only slice proven-in-bounds ranges.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;

use super::{FormatError, WeightSource};

/// Headers beyond this are corruption; the reference implementation uses the same bound.
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// On-disk element types with their sizes. Types we can only bounds-check (not convert) are
/// still accepted at open so that `contains`/`shape` work for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SafetensorsDtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl SafetensorsDtype {
    fn parse(s: &str) -> Option<Self> {
        use SafetensorsDtype::*;
        Some(match s {
            "BOOL" => Bool,
            "U8" => U8,
            "I8" => I8,
            "F8_E5M2" => F8E5M2,
            "F8_E4M3" => F8E4M3,
            "I16" => I16,
            "U16" => U16,
            "F16" => F16,
            "BF16" => BF16,
            "I32" => I32,
            "U32" => U32,
            "F32" => F32,
            "F64" => F64,
            "I64" => I64,
            "U64" => U64,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        use SafetensorsDtype::*;
        match self {
            Bool | U8 | I8 | F8E5M2 | F8E4M3 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            F64 | I64 | U64 => 8,
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: SafetensorsDtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// Memory-mapped safetensors weights: a single file, a directory with `model.safetensors`, or a
/// directory with a sharded `model.safetensors.index.json`.
pub struct SafetensorsWeights {
    path: PathBuf,
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    names: Vec<String>,
    metadata: HashMap<String, String>,
}

impl std::fmt::Debug for SafetensorsWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsWeights")
            .field("path", &self.path)
            .field("shards", &self.shards.len())
            .field("tensors", &self.names.len())
            .finish()
    }
}

impl SafetensorsWeights {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, FormatError> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            let single = path.join("model.safetensors");
            if index.is_file() {
                Self::open_index(path, &index)
            } else if single.is_file() {
                Self::open_files(path, &[single])
            } else {
                // A directory holding exactly one safetensors file (e.g. a PEFT adapter's
                // `adapter_model.safetensors`) is unambiguous, so accept it.
                let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(|e| FormatError::new(path, format!("cannot list directory: {e}")))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
                    .collect();
                found.sort();
                match found.len() {
                    1 => Self::open_files(path, &found),
                    0 => Err(FormatError::new(
                        path,
                        "no safetensors weights: expected model.safetensors or model.safetensors.index.json",
                    )),
                    n => Err(FormatError::new(
                        path,
                        format!(
                            "{n} .safetensors files but no model.safetensors.index.json saying how they \
                             are sharded"
                        ),
                    )),
                }
            }
        } else if path.extension().is_some_and(|x| x == "json") {
            let dir = path.parent().unwrap_or(Path::new("."));
            Self::open_index(dir, path)
        } else {
            Self::open_files(path, &[path.to_path_buf()])
        }
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self, FormatError> {
        let text = std::fs::read_to_string(index)
            .map_err(|e| FormatError::new(index, format!("cannot read shard index: {e}")))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| FormatError::new(index, format!("shard index is not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| FormatError::new(index, "shard index has no `weight_map` object"))?;
        let mut shard_files: Vec<String> = Vec::new();
        let mut wanted: Vec<(String, String)> = Vec::with_capacity(map.len());
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                FormatError::tensor(index, name, "weight_map entry is not a file name string")
            })?;
            // Shard names come from a downloaded file; refuse anything that escapes the directory.
            if Path::new(file)
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(FormatError::tensor(
                    index,
                    name,
                    format!("shard name `{file}` is not a plain file name"),
                ));
            }
            if !shard_files.iter().any(|f| f == file) {
                shard_files.push(file.to_owned());
            }
            wanted.push((name.clone(), file.to_owned()));
        }
        let shard_paths: Vec<PathBuf> = shard_files.iter().map(|f| dir.join(f)).collect();
        for (name, file) in &wanted {
            let p = dir.join(file);
            if !p.is_file() {
                return Err(FormatError::tensor(
                    &p,
                    name,
                    format!("missing shard listed in {}", index.display()),
                ));
            }
        }
        let mut w = Self::open_files(dir, &shard_paths)?;
        // The index is authoritative for which tensors exist; a tensor it promises but its shard
        // lacks means a broken or mismatched download.
        for (name, file) in &wanted {
            let ok = w
                .entries
                .get(name)
                .is_some_and(|e| w.shards[e.shard].path == dir.join(file));
            if !ok {
                return Err(FormatError::tensor(
                    dir.join(file),
                    name,
                    format!(
                        "tensor listed in {} is missing from its shard",
                        index.display()
                    ),
                ));
            }
        }
        w.names = wanted.into_iter().map(|(n, _)| n).collect();
        Ok(w)
    }

    fn open_files(root: &Path, files: &[PathBuf]) -> Result<Self, FormatError> {
        let mut w = SafetensorsWeights {
            path: root.to_path_buf(),
            shards: Vec::with_capacity(files.len()),
            entries: HashMap::new(),
            names: Vec::new(),
            metadata: HashMap::new(),
        };
        for (i, f) in files.iter().enumerate() {
            let (mmap, tensors, meta) = parse_file(f)?;
            for (name, mut e) in tensors {
                e.shard = i;
                if w.entries.contains_key(&name) {
                    return Err(FormatError::tensor(
                        f,
                        &name,
                        "tensor appears in more than one shard",
                    ));
                }
                w.names.push(name.clone());
                w.entries.insert(name, e);
            }
            w.metadata.extend(meta);
            w.shards.push(Shard {
                path: f.clone(),
                mmap,
            });
        }
        Ok(w)
    }

    /// The free-form `__metadata__` string map (merged over shards).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The on-disk dtype of a tensor.
    pub fn dtype(&self, name: &str) -> Result<SafetensorsDtype, FormatError> {
        self.entry(name).map(|e| e.dtype)
    }

    fn entry(&self, name: &str) -> Result<&Entry, FormatError> {
        self.entries.get(name).ok_or_else(|| {
            FormatError::tensor(
                &self.path,
                name,
                "no such tensor in these safetensors weights",
            )
        })
    }

    /// The raw little-endian bytes of a tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], FormatError> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        shard
            .mmap
            .get(e.start..e.end)
            .ok_or_else(|| FormatError::tensor(&shard.path, name, "tensor data out of bounds"))
    }
}

type Parsed = (Mmap, Vec<(String, Entry)>, HashMap<String, String>);

fn parse_file(path: &Path) -> Result<Parsed, FormatError> {
    let file = File::open(path)
        .map_err(|e| FormatError::new(path, format!("cannot open safetensors file: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| FormatError::new(path, format!("cannot stat safetensors file: {e}")))?
        .len();
    if len < 8 {
        return Err(FormatError::new(
            path,
            format!("truncated file: {len} bytes, expected at least an 8-byte header length"),
        ));
    }
    // SAFETY: read-only mapping; all accesses are bounds-checked against the length at map time,
    // so a concurrent writer can corrupt values but not memory safety beyond what every mmap
    // loader accepts.
    let mmap = unsafe { Mmap::map(&file) }
        .map_err(|e| FormatError::new(path, format!("cannot memory-map safetensors file: {e}")))?;
    let mut lenb = [0u8; 8];
    lenb.copy_from_slice(&mmap[..8]);
    let header_len = u64::from_le_bytes(lenb);
    let avail = mmap.len() as u64 - 8;
    if header_len > avail || header_len > MAX_HEADER {
        return Err(FormatError::new(
            path,
            format!("bad header: header length {header_len} exceeds the {avail} bytes after it (limit {MAX_HEADER})"),
        ));
    }
    let data_start = 8 + header_len as usize;
    let header: serde_json::Value = serde_json::from_slice(&mmap[8..data_start])
        .map_err(|e| FormatError::new(path, format!("bad header: not valid JSON: {e}")))?;
    let obj = header
        .as_object()
        .ok_or_else(|| FormatError::new(path, "bad header: expected a JSON object of tensors"))?;
    let data_len = mmap.len() - data_start;
    let mut tensors = Vec::with_capacity(obj.len());
    let mut meta = HashMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            if let Some(m) = v.as_object() {
                for (k, v) in m {
                    if let Some(s) = v.as_str() {
                        meta.insert(k.clone(), s.to_owned());
                    }
                }
            }
            continue;
        }
        let terr = |msg: String| FormatError::tensor(path, name, msg);
        let dtype_s = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| terr("bad header: missing string field `dtype`".into()))?;
        let dtype = SafetensorsDtype::parse(dtype_s).ok_or_else(|| {
            terr(format!("unknown dtype `{dtype_s}` (expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64)"))
        })?;
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .ok_or_else(|| {
                terr("bad header: `shape` must be an array of non-negative integers".into())
            })?;
        let offs: Vec<usize> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .filter(|o: &Vec<usize>| o.len() == 2)
            .ok_or_else(|| terr("bad header: `data_offsets` must be [begin, end]".into()))?;
        let (begin, end) = (offs[0], offs[1]);
        let need = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| terr(format!("shape {shape:?} overflows the byte size")))?;
        if begin > end || end > data_len {
            return Err(terr(format!(
                "data out of bounds: offsets [{begin}, {end}] but the data section has {data_len} bytes"
            )));
        }
        if end - begin != need {
            return Err(terr(format!(
                "data size mismatch: offsets [{begin}, {end}] hold {} bytes, shape {shape:?} of {dtype_s} needs {need}",
                end - begin
            )));
        }
        tensors.push((
            name.clone(),
            Entry {
                shard: 0,
                dtype,
                shape,
                start: data_start + begin,
                end: data_start + end,
            },
        ));
    }
    Ok((mmap, tensors, meta))
}

impl WeightSource for SafetensorsWeights {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.entry(name).map(|e| e.shape.clone())
    }

    fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError> {
        let e = self.entry(name)?;
        let bytes = self.tensor_bytes(name)?;
        let n = bytes.len() / e.dtype.size();
        let mut out = vec![0f32; n];
        const CHUNK: usize = 1 << 14;
        match e.dtype {
            SafetensorsDtype::F32 => out
                .par_chunks_mut(CHUNK)
                .zip(bytes.par_chunks(CHUNK * 4))
                .for_each(|(o, b)| {
                    for (y, x) in o.iter_mut().zip(b.chunks_exact(4)) {
                        *y = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                    }
                }),
            SafetensorsDtype::F16 => out
                .par_chunks_mut(CHUNK)
                .zip(bytes.par_chunks(CHUNK * 2))
                .for_each(|(o, b)| {
                    for (y, x) in o.iter_mut().zip(b.chunks_exact(2)) {
                        *y = f16::from_le_bytes([x[0], x[1]]).to_f32();
                    }
                }),
            SafetensorsDtype::BF16 => out
                .par_chunks_mut(CHUNK)
                .zip(bytes.par_chunks(CHUNK * 2))
                .for_each(|(o, b)| {
                    for (y, x) in o.iter_mut().zip(b.chunks_exact(2)) {
                        *y = bf16::from_le_bytes([x[0], x[1]]).to_f32();
                    }
                }),
            other => {
                return Err(FormatError::tensor(
                    &self.shards[e.shard].path,
                    name,
                    format!(
                        "dtype {other:?} cannot be converted to f32 (expected F32, F16 or BF16)"
                    ),
                ))
            }
        }
        Ok((out, e.shape.clone()))
    }

    fn tensor_names(&self) -> Vec<String> {
        self.names.clone()
    }
}
