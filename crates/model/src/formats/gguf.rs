//! GGUF v3 parser and dequantization.
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

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;

use super::{FormatError, WeightSource};

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

/// Element type of a tensor's data, with ggml's on-disk ids.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

const QK_K: usize = 256;

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 40,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        block_fn(self).is_some()
    }

    /// Bytes taken by `n_elements` elements, or `None` when the count is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if n_elements % bs != 0 {
            return None;
        }
        (n_elements / bs).checked_mul(self.block_bytes() as u64)
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

// ---------------------------------------------------------------------------------------------
// Dequantization.
//
// Each block function mirrors the arithmetic of gguf-py's `quants.py` operation for operation
// (all in f32, products formed in the same order, no fused multiply-add) so results are
// bit-identical to the Python oracle, not merely close.

type BlockFn = fn(&[u8], &mut [f32]);

fn block_fn(ty: GgmlType) -> Option<BlockFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => deq_f32,
        F16 => deq_f16,
        BF16 => deq_bf16,
        Q4_0 => deq_q4_0,
        Q4_1 => deq_q4_1,
        Q5_0 => deq_q5_0,
        Q5_1 => deq_q5_1,
        Q8_0 => deq_q8_0,
        Q2_K => deq_q2_k,
        Q3_K => deq_q3_k,
        Q4_K => deq_q4_k,
        Q5_K => deq_q5_k,
        Q6_K => deq_q6_k,
        Q8_K => deq_q8_k,
        _ => return None,
    })
}

/// Dequantize `n_elements` values of type `ty` from `bytes` into `out`. Large inputs are split
/// over rayon by whole blocks.
pub fn dequantize(
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let f = block_fn(ty)
        .ok_or_else(|| format!("dequantization of ggml type {ty:?} is not supported"))?;
    let bs = ty.block_size();
    let bb = ty.block_bytes();
    if n_elements % bs != 0 {
        return Err(format!(
            "{n_elements} elements is not a multiple of the {ty:?} block size {bs}"
        ));
    }
    let n_blocks = n_elements / bs;
    let need = n_blocks.checked_mul(bb).ok_or("byte size overflows")?;
    if bytes.len() != need {
        return Err(format!(
            "{n_elements} {ty:?} elements need {need} bytes, got {}",
            bytes.len()
        ));
    }
    if out.len() != n_elements {
        return Err(format!(
            "output holds {} values, expected {n_elements}",
            out.len()
        ));
    }
    // Scalar types are converted element-wise; group them so each rayon task is sizable.
    let per_task_blocks = if bs == 1 { 16384 } else { (16384 / bs).max(1) };
    if n_blocks <= per_task_blocks {
        run_blocks(f, bs, bb, bytes, out);
    } else {
        out.par_chunks_mut(per_task_blocks * bs)
            .zip(bytes.par_chunks(per_task_blocks * bb))
            .for_each(|(o, b)| run_blocks(f, bs, bb, b, o));
    }
    Ok(())
}

fn run_blocks(f: BlockFn, bs: usize, bb: usize, bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(bs).zip(bytes.chunks_exact(bb)) {
        f(b, o);
    }
}

#[inline]
fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn deq_f32(b: &[u8], o: &mut [f32]) {
    o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn deq_f16(b: &[u8], o: &mut [f32]) {
    o[0] = rd_f16(b, 0);
}

fn deq_bf16(b: &[u8], o: &mut [f32]) {
    o[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
}

/// Low nibbles hold elements 0..16, high nibbles 16..32.
#[inline]
fn nibble32(qs: &[u8], i: usize) -> u8 {
    if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    }
}

fn deq_q4_0(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qs = &b[2..18];
    for (i, y) in o.iter_mut().enumerate().take(32) {
        *y = d * (nibble32(qs, i) as i32 - 8) as f32;
    }
}

fn deq_q4_1(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let qs = &b[4..20];
    for (i, y) in o.iter_mut().enumerate().take(32) {
        *y = d * nibble32(qs, i) as f32 + m;
    }
}

fn deq_q5_0(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for (i, y) in o.iter_mut().enumerate().take(32) {
        let q = nibble32(qs, i) | ((((qh >> i) & 1) as u8) << 4);
        *y = d * (q as i32 - 16) as f32;
    }
}

fn deq_q5_1(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let m = rd_f16(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for (i, y) in o.iter_mut().enumerate().take(32) {
        let q = nibble32(qs, i) | ((((qh >> i) & 1) as u8) << 4);
        *y = d * q as f32 + m;
    }
}

fn deq_q8_0(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (y, &q) in o.iter_mut().zip(&b[2..34]) {
        *y = q as i8 as f32 * d;
    }
}

/// Layout `{u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}`; each qs byte carries four 2-bit
/// values for elements 32 apart.
fn deq_q2_k(b: &[u8], o: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = rd_f16(b, 80);
    let dmin = rd_f16(b, 82);
    for (e, y) in o.iter_mut().enumerate().take(QK_K) {
        let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
        let q = (qs[h * 32 + l] >> (2 * j)) & 3;
        let sc = scales[e / 16];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *y = dl * q as f32 - ml;
    }
}

/// Layout `{u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}` with 6-bit signed scales.
fn deq_q3_k(b: &[u8], o: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = rd_f16(b, 108);
    let mut scales = [0f32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = ((low | (high << 4)) as i8 - 32) as f32;
    }
    for (e, y) in o.iter_mut().enumerate().take(QK_K) {
        let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
        let ql = ((qs[h * 32 + l] >> (2 * j)) & 3) as i8;
        // A set hmask bit means "no offset"; a clear one subtracts 4.
        let hbit = ((hmask[l] >> (e / 32)) & 1) ^ 1;
        let q = ql - ((hbit << 2) as i8);
        let dl = d * scales[e / 16];
        *y = dl * q as f32;
    }
}

/// The 12-byte packed 6-bit (scale, min) pairs shared by Q4_K and Q5_K.
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, mn)
}

/// Layout `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`; sub-block `s` of 32 takes the low
/// (even `s`) or high (odd `s`) nibbles of `qs[32*(s/2)..][..32]`.
fn deq_q4_k(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let dmin = rd_f16(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for (s, ys) in o.chunks_exact_mut(32).enumerate().take(8) {
        let dl = d * sc[s] as f32;
        let ml = dmin * mn[s] as f32;
        let src = &qs[(s / 2) * 32..(s / 2) * 32 + 32];
        let shift = 4 * (s % 2);
        for (y, &q) in ys.iter_mut().zip(src) {
            *y = dl * ((q >> shift) & 0x0F) as f32 - ml;
        }
    }
}

/// Q4_K plus `u8 qh[32]` (before qs) supplying bit 4 of sub-block `s` in bit `s` of `qh[l]`.
fn deq_q5_k(b: &[u8], o: &mut [f32]) {
    let d = rd_f16(b, 0);
    let dmin = rd_f16(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (s, ys) in o.chunks_exact_mut(32).enumerate().take(8) {
        let dl = d * sc[s] as f32;
        let ml = dmin * mn[s] as f32;
        let src = &qs[(s / 2) * 32..(s / 2) * 32 + 32];
        let shift = 4 * (s % 2);
        for (l, y) in ys.iter_mut().enumerate() {
            let q = ((src[l] >> shift) & 0x0F) | (((qh[l] >> s) & 1) << 4);
            *y = dl * q as f32 - ml;
        }
    }
}

/// Layout `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`.
fn deq_q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = rd_f16(b, 208);
    for (e, y) in o.iter_mut().enumerate().take(QK_K) {
        let h = e / 128;
        let r = e % 128;
        let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        let q = (lo | (hi << 4)) as i8 - 32;
        let dl = d * scales[e / 16] as i8 as f32;
        *y = dl * q as f32;
    }
}

/// Layout `{f32 d; i8 qs[256]; i16 bsums[16]}`; the sums only serve dot products.
fn deq_q8_k(b: &[u8], o: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in o.iter_mut().zip(&b[4..260]) {
        *y = d * q as i8 as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_layouts() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
        assert_eq!(GgmlType::Q4_K.block_bytes(), 2 + 2 + 12 + 128);
        assert_eq!(GgmlType::Q6_K.block_bytes(), 128 + 64 + 16 + 2);
    }

    #[test]
    fn dequantize_rejects_size_mismatch() {
        let mut out = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 17], 32, &mut out).is_err());
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 18], 31, &mut out).is_err());
        assert!(dequantize(GgmlType::IQ2_XXS, &[0u8; 66], 256, &mut vec![0f32; 256]).is_err());
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 18], 32, &mut out).is_ok());
    }

    #[test]
    fn q4_0_known_block() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2] = 0xF0; // element 0 -> 0, element 16 -> 15
        let mut out = vec![0f32; 32];
        dequantize(GgmlType::Q4_0, &b, 32, &mut out).unwrap();
        assert_eq!(out[0], -4.0);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn parallel_path_matches_serial() {
        let n_blocks = 5000;
        let mut bytes = vec![0u8; n_blocks * 18];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        for blk in bytes.chunks_exact_mut(18) {
            blk[0..2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
        }
        let mut par = vec![0f32; n_blocks * 32];
        dequantize(GgmlType::Q4_0, &bytes, n_blocks * 32, &mut par).unwrap();
        let mut ser = vec![0f32; n_blocks * 32];
        run_blocks(deq_q4_0, 32, 18, &bytes, &mut ser);
        assert_eq!(par, ser);
    }
}
