//! GGUF v3 parser (element types in `ggml_type`, block dequantization in `dequant`).
//!
//! The whole header is parsed and validated in [`GgufFile::open`], so a corrupt or truncated
//! download is reported once, up front, naming the file (and tensor) at fault; later tensor reads
//! only slice ranges already proven to lie inside the mapping. Every count read from the file is
//! checked against the bytes that remain before anything is allocated for it, so a few flipped
//! bits cannot make us reserve terabytes.

// `%` rather than `is_multiple_of`: the workspace declares rust-version 1.85, older than that API.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{FormatError, WeightSource};

mod dequant;
mod ggml_type;

pub use dequant::dequantize;
pub use ggml_type::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml itself supports 4 dimensions; a little headroom, but a huge count is corruption.
const MAX_DIMS: u32 = 8;
/// Nested arrays are legal but real files nest at most once; the cap keeps a malicious file from
/// exhausting the stack through recursion.
const MAX_ARRAY_DEPTH: usize = 16;

/// A metadata value. Variant order follows the on-disk type ids (0..=12).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// Any non-negative integer, whatever its stored width: writers disagree on widths for
    /// the same key (e.g. `block_count` as u32 or u64).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v as i64),
            GgufValue::U16(v) => Some(v as i64),
            GgufValue::U32(v) => Some(v as i64),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Floats and integers alike, since e.g. `rope.freq_base` is sometimes stored as an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self
                .as_i64()
                .map(|v| v as f64)
                .or_else(|| self.as_u64().map(|v| v as f64)),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }
}

/// One tensor's header entry. `dims` are in ggml order (`dims[0]` is contiguous); `offset` is
/// relative to the start of the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Product of the dims; validated not to overflow when the file was opened.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Size of the tensor's data in bytes; validated when the file was opened.
    pub fn n_bytes(&self) -> u64 {
        self.ggml_type.bytes_for(self.n_elements()).unwrap_or(0)
    }
    /// PyTorch-order shape (ggml dims reversed).
    pub fn shape(&self) -> Vec<usize> {
        // Every tensor's bytes fit in the mapping, so each dim fits in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Bounds-checked little-endian reader over the mapping.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn err(&self, msg: impl std::fmt::Display) -> FormatError {
        FormatError::new(self.path, format!("{msg} (at byte offset {})", self.pos))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], FormatError> {
        if n > self.remaining() {
            return Err(self.err(format_args!(
                "truncated file: expected {n} bytes for {what}, only {} left",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], FormatError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, FormatError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that is followed by at least `min_each` bytes per item: anything larger than the
    /// rest of the file could hold is corruption, and rejecting it here bounds allocations.
    fn count(&mut self, what: &str, min_each: usize) -> Result<usize, FormatError> {
        let n = self.u64(what)?;
        let cap = (self.remaining() / min_each.max(1)) as u64;
        if n > cap {
            return Err(self.err(format_args!(
                "{what} is {n}, but the {} remaining bytes can hold at most {cap}",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn raw_string(&mut self, what: &str) -> Result<&'a [u8], FormatError> {
        let len = self.count(&format!("length of {what}"), 1)?;
        self.take(len, what)
    }

    /// Keys and tensor names must be exact, so invalid UTF-8 is an error there.
    fn strict_string(&mut self, what: &str) -> Result<String, FormatError> {
        let start = self.pos;
        let bytes = self.raw_string(what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(FormatError::new(
                self.path,
                format!("{what} at byte offset {start} is not valid UTF-8: {e}"),
            )),
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, FormatError> {
        Ok(match ty {
            0 => GgufValue::U8(self.u8(key)?),
            1 => GgufValue::I8(self.u8(key)? as i8),
            2 => GgufValue::U16(self.u16(key)?),
            3 => GgufValue::I16(self.u16(key)? as i16),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(self.u32(key)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.u8(key)? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(self.err(format_args!(
                        "metadata `{key}`: bool must be 0 or 1, found {b}"
                    )))
                }
            },
            // Tokenizer vocabularies in the wild contain stray invalid UTF-8 (partial byte
            // tokens); llama.cpp loads them, so we replace rather than reject.
            8 => GgufValue::String(String::from_utf8_lossy(self.raw_string(key)?).into_owned()),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format_args!(
                        "metadata `{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let min = value_min_size(elem_ty).ok_or_else(|| {
                    self.err(format_args!(
                        "metadata `{key}`: unknown array element type {elem_ty} (expected 0..=12)"
                    ))
                })?;
                let n = self.count(&format!("element count of metadata array `{key}`"), min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(self.u64(key)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(key)?)),
            _ => {
                return Err(self.err(format_args!(
                    "metadata `{key}`: unknown value type {ty} (expected 0..=12)"
                )))
            }
        })
    }
}

/// Smallest encoding of a value of type `ty`, used to bound array counts.
fn value_min_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, FormatError> {
        let path = path.as_ref();
        let file = File::open(path)
            .map_err(|e| FormatError::new(path, format!("cannot open GGUF file: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| FormatError::new(path, format!("cannot stat GGUF file: {e}")))?
            .len();
        if len < 24 {
            return Err(FormatError::new(
                path,
                format!("truncated file: {len} bytes, a GGUF header alone needs 24"),
            ));
        }
        // SAFETY: the mapping is read-only; a concurrent writer could change bytes under us,
        // which at worst yields wrong values (every access is bounds-checked against the length
        // captured at map time), the same contract every mmap-based model loader accepts.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| FormatError::new(path, format!("cannot memory-map GGUF file: {e}")))?;
        Self::parse(path.to_path_buf(), mmap)
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<GgufFile, FormatError> {
        let mut r = Reader {
            buf: &mmap[..],
            pos: 0,
            path: &path,
        };
        let magic = r.array::<4>("magic")?;
        if &magic != MAGIC {
            return Err(FormatError::new(
                &path,
                format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\" (47 47 55 46)"),
            ));
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(r.err(
                    "GGUF version 1 is not supported (expected 2 or 3); re-convert the model",
                ))
            }
            v if v.swap_bytes() <= 3 => return Err(r.err(format_args!(
                "big-endian GGUF (version {}) is not supported (expected little-endian v2 or v3)",
                v.swap_bytes()
            ))),
            v => {
                return Err(r.err(format_args!(
                    "unsupported GGUF version {v} (expected 2 or 3)"
                )))
            }
        }
        // Minimum encoded sizes: a tensor info is name length + n_dims + type + offset; a
        // metadata entry is key length + value type + a 1-byte value.
        let n_tensors = r.count("tensor count", 24)?;
        let n_kv = r.count("metadata key/value count", 13)?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut metadata_index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            let key = r.strict_string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&key)?;
            let value = r.value(ty, &key, 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(r.err(format_args!("duplicate metadata key `{key}`")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index
            .get("general.alignment")
            .map(|&i| &metadata[i].1)
        {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
                _ => {
                    return Err(FormatError::new(
                        &path,
                        format!(
                            "general.alignment is {v:?} ({}), expected a power of two",
                            v.type_name()
                        ),
                    ))
                }
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = r.strict_string(&format!("name of tensor #{i}"))?;
            let terr = |msg: String| FormatError::tensor(&path, &name, msg);
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims > MAX_DIMS {
                return Err(terr(format!(
                    "{n_dims} dimensions, expected at most {MAX_DIMS}"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dimension")?);
            }
            let type_id = r.u32("tensor type")?;
            let offset = r.u64("tensor data offset")?;
            let ggml_type = GgmlType::from_id(type_id)
                .ok_or_else(|| terr(format!("unknown ggml type id {type_id}")))?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| terr(format!("dimensions {dims:?} overflow the element count")))?;
            if dims
                .first()
                .is_some_and(|&d0| d0 % ggml_type.block_size() as u64 != 0)
            {
                return Err(terr(format!(
                    "row length {} is not a multiple of the {ggml_type:?} block size {}",
                    dims[0],
                    ggml_type.block_size()
                )));
            }
            if ggml_type.bytes_for(n_elements).is_none() {
                return Err(terr(format!(
                    "dimensions {dims:?} overflow the byte size for {ggml_type:?}"
                )));
            }
            if offset % alignment != 0 {
                return Err(terr(format!(
                    "data offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(terr("duplicate tensor name".into()));
            }
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }

        let header_end = r.pos as u64;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        for t in &tensors {
            let nbytes = t.n_bytes();
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(nbytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(FormatError::tensor(
                        &path,
                        &t.name,
                        format!(
                            "data out of bounds: {nbytes} bytes at data offset {} (absolute {}) \
                             but the file has {file_len} bytes; the file is probably truncated",
                            t.offset,
                            data_offset as u128 + t.offset as u128
                        ),
                    ))
                }
            }
        }

        Ok(GgufFile {
            path,
            mmap,
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Keys in file order.
    pub fn metadata_keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.iter().map(|(k, _)| k.as_str())
    }

    /// Key/value pairs in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    fn missing(&self, name: &str) -> FormatError {
        FormatError::tensor(&self.path, name, "no such tensor in this GGUF file")
    }

    /// The raw (possibly quantized) bytes of a tensor, straight from the mapping.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], FormatError> {
        let t = self.tensor_info(name).ok_or_else(|| self.missing(name))?;
        // Bounds were proven in `parse`; `get` keeps this panic-free regardless.
        let start = self.data_offset + t.offset;
        usize::try_from(start)
            .ok()
            .zip(usize::try_from(t.n_bytes()).ok())
            .and_then(|(s, n)| self.mmap.get(s..s.checked_add(n)?))
            .ok_or_else(|| FormatError::tensor(&self.path, name, "tensor data out of bounds"))
    }
}

impl WeightSource for GgufFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.tensor_info(name)
            .map(GgufTensorInfo::shape)
            .ok_or_else(|| self.missing(name))
    }

    fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), FormatError> {
        let t = self.tensor_info(name).ok_or_else(|| self.missing(name))?;
        let bytes = self.tensor_bytes(name)?;
        // The element count is bounded by the data bytes (validated in `parse`), so this
        // allocation is bounded by the file size times the best compression ratio of any type.
        let n = t.n_elements() as usize;
        let mut out = vec![0f32; n];
        dequantize(t.ggml_type, bytes, n, &mut out)
            .map_err(|e| FormatError::tensor(&self.path, name, e))?;
        Ok((out, t.shape()))
    }

    fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }
}
