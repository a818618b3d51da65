//! Our CUDA C kernels: compiled by NVRTC for the GPU at start-up (PTX cached on disk, keyed by
//! a hash of source and architecture), and the handles of every kernel function.

use super::{lora, prefill_smem_bytes};
use anyhow::{bail, Context, Result};
use cudarc::driver::{result, sys, CudaModule};
use std::sync::Arc;
use std::path::PathBuf;

/// `kernels.cu`, `gemv.cu`, `prefill_attention.cu`, `decode_attention.cu`, `lora.cu`,
/// `lora_ahead.cu`, `moe.cu`, `lora_experts.cu`, `sample.cu`, `logit_edits.cu` then
/// `collective.cu`, one module
/// (later files use the helpers of earlier ones: kernels.cu's bf16 and reduction helpers,
/// gemv.cu's cp.async and dot8, prefill_attention.cu's mma / ldmatrix).
pub(super) const KERNELS_SRC: &str = concat!(include_str!("kernels.cu"), include_str!("gemv.cu"), include_str!("prefill_attention.cu"), include_str!("decode_attention.cu"), include_str!("lora.cu"), include_str!("lora_ahead.cu"), include_str!("lora_rows.cu"), include_str!("lora_epilogue.cu"), include_str!("moe.cu"), include_str!("lora_experts.cu"), include_str!("sample.cu"), include_str!("logit_edits.cu"), include_str!("collective.cu"), include_str!("lora_tail.cu"));

pub(super) struct Kernels {
    pub(super) f32_to_bf16: sys::CUfunction,
    pub(super) f32_to_bf16_split: sys::CUfunction,
    pub(super) add_bias: sys::CUfunction,
    pub(super) add_inplace: sys::CUfunction,
    pub(super) embedding_bf16: sys::CUfunction,
    pub(super) embedding_f32: sys::CUfunction,
    pub(super) gather_rows: sys::CUfunction,
    pub(super) rms_norm: sys::CUfunction,
    pub(super) add_rms_norm: sys::CUfunction,
    pub(super) rope_qk: sys::CUfunction,
    pub(super) silu_mul: sys::CUfunction,
    pub(super) kv_write: sys::CUfunction,
    pub(super) paged_attention: sys::CUfunction,
    /// Decode attention by KV head (`decode_attention.cu`) for head_dim 64, 128, 256 (index),
    /// up to 4 and up to 8 query heads per KV head.
    pub(super) paged_attention_gqa: [[sys::CUfunction; 3]; 2],
    /// Tensor-core prefill attention for head_dim rounded up to 32, 64, 96, 128.
    pub(super) prefill_attention: [sys::CUfunction; 4],
    /// Single-row GEMV for k % 8 == 0 (cp.async-streamed W), and the plain one for any k.
    pub(super) gemv1_bf16: sys::CUfunction,
    pub(super) gemv1_silu_bf16: sys::CUfunction,
    pub(super) gemv1_rope_bf16: sys::CUfunction,
    pub(super) gemv1_lora_bf16: sys::CUfunction,
    pub(super) gemv1_lora_silu_bf16: sys::CUfunction,
    pub(super) gemv1_lora_rope_bf16: sys::CUfunction,
    pub(super) gemv_bf16_any_k: sys::CUfunction,
    pub(super) lora_shrink: sys::CUfunction,
    pub(super) lora_shrink_mma: sys::CUfunction,
    pub(super) lora_shrink_ids: sys::CUfunction,
    pub(super) lora_expand: sys::CUfunction,
    /// The grouping of an MoE layer's routed positions by (adapter slot, expert) (`lora_experts.cu`).
    pub(super) lora_expert_group: sys::CUfunction,
    /// RMSNorm fused with the next site's shrink (`lora_ahead.cu`), for slices of at most 256,
    /// 512 and 1024 inputs a block.
    pub(super) rms_norm_shrink: [sys::CUfunction; 3],
    /// The same, adding the previous site's deferred delta first (`lora_epilogue.rs`).
    pub(super) rms_norm_lora2: [sys::CUfunction; 3],
    /// A LoRA site's whole delta row by row, 1 / 2 / 4 / 8 input chunks a lane (`lora_rows.cu`).
    pub(super) lora_rows: [sys::CUfunction; 4],
    /// RoPE and SiLU·mul adding a LoRA expand first (`lora_epilogue.cu`).
    pub(super) rope_qk_lora: sys::CUfunction,
    pub(super) silu_mul_lora: sys::CUfunction,
    pub(super) lora_tail_scatter: sys::CUfunction,
    pub(super) lora_tail_shrink: sys::CUfunction,
    pub(super) sample_rows: sys::CUfunction,
    pub(super) resolve_drawn: sys::CUfunction,
    pub(super) logit_edits: sys::CUfunction,
    /// A tensor-parallel rank's part of an all-reduce, and the logits' all-gather (`collective.cu`).
    pub(super) tp_all_reduce: sys::CUfunction,
    pub(super) tp_all_gather_cols: sys::CUfunction,
    pub(super) tp_fence: sys::CUfunction,
    pub(super) tp_all_reduce_flags: sys::CUfunction,
    pub(super) tp_all_gather_cols_flags: sys::CUfunction,
}

impl Kernels {
    /// The handles of every kernel in `module`, with the shared-memory limits raised where a
    /// kernel needs more than the default 48 KB.
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<Kernels> {
        let f = |n: &str| -> Result<sys::CUfunction> { Ok(module.load_function(n).with_context(|| format!("kernel {n}"))?.cu_function()) };
        let k = Kernels {
            f32_to_bf16: f("f32_to_bf16")?,
            f32_to_bf16_split: f("f32_to_bf16_split")?,
            add_bias: f("add_bias")?,
            add_inplace: f("add_inplace")?,
            embedding_bf16: f("embedding_bf16")?,
            embedding_f32: f("embedding_f32")?,
            gather_rows: f("gather_rows")?,
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rope_qk: f("rope_qk")?,
            silu_mul: f("silu_mul")?,
            kv_write: f("kv_write")?,
            paged_attention: f("paged_attention")?,
            paged_attention_gqa: [
                [f("paged_attention_gqa_64_4")?, f("paged_attention_gqa_128_4")?, f("paged_attention_gqa_256_4")?],
                [f("paged_attention_gqa_64_8")?, f("paged_attention_gqa_128_8")?, f("paged_attention_gqa_256_8")?],
            ],
            prefill_attention: [f("prefill_attention_32")?, f("prefill_attention_64")?, f("prefill_attention_96")?, f("prefill_attention_128")?],
            gemv1_bf16: f("gemv1_bf16")?,
            gemv1_silu_bf16: f("gemv1_silu_bf16")?,
            gemv1_rope_bf16: f("gemv1_rope_bf16")?,
            gemv1_lora_bf16: f("gemv1_lora_bf16")?,
            gemv1_lora_silu_bf16: f("gemv1_lora_silu_bf16")?,
            gemv1_lora_rope_bf16: f("gemv1_lora_rope_bf16")?,
            gemv_bf16_any_k: f("gemv_bf16_1")?,
            lora_shrink: f("lora_shrink")?,
            lora_shrink_mma: f("lora_shrink_mma")?,
            lora_shrink_ids: f("lora_shrink_ids")?,
            lora_expand: f("lora_expand")?,
            lora_expert_group: f("lora_expert_group")?,
            rms_norm_shrink: [f("rms_norm_shrink_1")?, f("rms_norm_shrink_2")?, f("rms_norm_shrink_4")?],
            rms_norm_lora2: [f("rms_norm_lora2_1")?, f("rms_norm_lora2_2")?, f("rms_norm_lora2_4")?],
            lora_rows: [f("lora_rows_1")?, f("lora_rows_2")?, f("lora_rows_4")?, f("lora_rows_8")?],
            rope_qk_lora: f("rope_qk_lora")?,
            silu_mul_lora: f("silu_mul_lora")?,
            lora_tail_scatter: f("lora_tail_scatter")?,
            lora_tail_shrink: f("lora_tail_shrink")?,
            sample_rows: f("sample_rows")?,
            resolve_drawn: f("resolve_drawn")?,
            logit_edits: f("logit_edits")?,
            tp_all_reduce: f("tp_all_reduce")?,
            tp_all_gather_cols: f("tp_all_gather_cols")?,
            tp_fence: f("tp_fence")?,
            tp_all_reduce_flags: f("tp_all_reduce_flags")?,
            tp_all_gather_cols_flags: f("tp_all_gather_cols_flags")?,
        };
        for (i, &pf) in k.prefill_attention.iter().enumerate() {
            let bytes = prefill_smem_bytes(32 * (i + 1)) as i32;
            // SAFETY: a function of the module just loaded; the value is within the H100/H200's
            // 227 KB per block (and within an sm_80's 163 KB).
            unsafe { result::function::set_function_attribute(pf, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes) }
                .context("raising the prefill attention's shared-memory limit")?;
        }
        // SAFETY: as above; within every sm_80+ GPU's per-block limit.
        unsafe { result::function::set_function_attribute(k.lora_expand, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, lora::EXPAND_MAX_SMEM as i32) }
            .context("raising the LoRA expand's shared-memory limit")?;
        Ok(k)
    }
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("QUIVER_CACHE_DIR") {
        return PathBuf::from(d).join("kernels");
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("quiver").join("kernels");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("quiver").join("kernels")
}

/// Compile-time tuning constants set from `QUIVER_CUDA_NVRTC_DEFINES` (`NAME=VALUE` words, e.g.
/// `LRW_MIN_BLOCKS=3 LEP_MIN_BLOCKS=8`): the kernels' `#ifndef` defaults are what ships, and an
/// A/B of another value needs no rebuild, only this variable. Anything but `NAME=VALUE` with a
/// name of capitals, digits and underscores and a number is refused, naming the word.
fn nvrtc_defines() -> Result<Vec<String>> {
    let Some(v) = std::env::var_os("QUIVER_CUDA_NVRTC_DEFINES") else { return Ok(Vec::new()) };
    let v = v.to_string_lossy().into_owned();
    v.split_whitespace()
        .map(|w| {
            let ok = w.split_once('=').is_some_and(|(n, x)| {
                n.starts_with(|c: char| c.is_ascii_uppercase())
                    && n.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                    && x.parse::<f64>().is_ok()
            });
            if ok { Ok(format!("-D{w}")) } else { Err(anyhow::anyhow!("QUIVER_CUDA_NVRTC_DEFINES: {w:?} is not NAME=NUMBER")) }
        })
        .collect()
}

/// PTX for `arch`, from the disk cache or freshly compiled by NVRTC.
pub(super) fn kernels_ptx(arch: &str) -> Result<String> {
    let defines = nvrtc_defines()?;
    // A toolchain change may change the hash: that only costs one recompilation.
    let key = {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        (arch, KERNELS_SRC, &defines).hash(&mut h);
        h.finish()
    };
    let path = cache_dir().join(format!("quiver-{key:016x}-{arch}.ptx"));
    if let Ok(s) = std::fs::read_to_string(&path) {
        return Ok(s);
    }
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(defines);
    let opts = cudarc::nvrtc::CompileOptions { options, ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_SRC, opts).map_err(|e| anyhow::anyhow!("NVRTC failed to compile Quiver's kernels for {arch}: {e:?}"))?;
    let src = ptx.to_src();
    // The cache is an optimization: failing to write it is not an error.
    if std::fs::create_dir_all(path.parent().unwrap()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &src).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(src)
}

/// Checks that the CUDA libraries we load at run time are present, naming the missing one.
pub(super) fn check_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries.
    let present = unsafe {
        [
            ("the CUDA driver (libcuda.so)", cudarc::driver::sys::is_culib_present()),
            ("NVRTC (libnvrtc.so)", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLAS (libcublas.so)", cudarc::cublas::sys::is_culib_present()),
        ]
    };
    for (what, ok) in present {
        if !ok {
            bail!("CUDA device requested but {what} could not be loaded: is an NVIDIA driver and CUDA runtime installed, and on LD_LIBRARY_PATH?");
        }
    }
    Ok(())
}
