//! Which part of a model each tensor-parallel rank holds (Megatron's split), the checks that
//! a model can be split N ways, and the host-side slicing of full weights to a rank's shard
//! before they reach the device.

use crate::config::{ModelConfig, QkNormKind};
use quiver_lora::TpShard;
use std::ops::Range;

/// Every rank's shard of `config` split `ranks` ways, or what does not divide (naming the
/// config field and the flag), or what cannot be split at all.
pub fn shards(config: &ModelConfig, ranks: usize) -> Result<Vec<TpShard>, String> {
    let c = config;
    let n = ranks;
    let flag = format!("--tensor-parallel-size {n}");
    if n == 0 {
        return Err(format!("{flag}: at least one rank"));
    }
    if c.moe.is_some() {
        return Err(format!("{flag}: mixture-of-experts layers are not split over ranks (no expert parallelism yet)"));
    }
    if c.qk_norm == Some(QkNormKind::Whole) {
        return Err(format!("{flag}: the q/k RMSNorm over whole projections (OLMoE) spans every rank's heads"));
    }
    let divides = |what: &str, v: usize| if v.is_multiple_of(n) { Ok(()) } else { Err(format!("{flag}: {what} = {v} is not divisible by {n}")) };
    divides("num_attention_heads", c.num_heads)?;
    divides("intermediate_size", c.intermediate_size)?;
    divides("vocab_size", c.vocab_size)?;
    if c.num_kv_heads >= n {
        divides("num_key_value_heads", c.num_kv_heads)?;
    } else if !n.is_multiple_of(c.num_kv_heads) {
        return Err(format!("{flag}: with num_key_value_heads = {} below the ranks, the ranks must be a multiple of it to replicate each kv head evenly", c.num_kv_heads));
    }
    let hd = c.head_dim;
    let (q_heads, kv_heads) = (c.num_heads / n, (c.num_kv_heads / n).max(1));
    let (inter, vocab) = (c.intermediate_size / n, c.vocab_size / n);
    Ok((0..n)
        .map(|r| {
            // With fewer kv heads than ranks, N / n_kv consecutive ranks share one: exactly the
            // ranks whose q heads belong to its group.
            let kv0 = if c.num_kv_heads >= n { r * kv_heads } else { r / (n / c.num_kv_heads) };
            TpShard {
                rank: r,
                ranks: n,
                q: r * q_heads * hd..(r + 1) * q_heads * hd,
                kv: kv0 * hd..(kv0 + kv_heads) * hd,
                inter: r * inter..(r + 1) * inter,
                vocab: r * vocab..(r + 1) * vocab,
            }
        })
        .collect())
}

/// Rows `rows` of a row-major matrix `cols` wide (`w` itself when that is all of it).
pub fn take_rows(w: Vec<f32>, cols: usize, rows: Range<usize>) -> Vec<f32> {
    if rows.start == 0 && rows.end * cols == w.len() {
        return w;
    }
    w[rows.start * cols..rows.end * cols].to_vec()
}

/// Columns `keep` of a row-major matrix `cols` wide (`w` itself when that is all of it).
pub fn take_cols(w: Vec<f32>, cols: usize, keep: Range<usize>) -> Vec<f32> {
    if keep == (0..cols) {
        return w;
    }
    w.chunks(cols).flat_map(|row| &row[keep.clone()]).copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;

    fn config(heads: usize, kv: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 96,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 1,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: None,
            moe: None,
            has_lm_head: true,
        }
    }

    /// Each rank's q heads use the kv heads it holds, whether kv heads are split or replicated.
    #[test]
    fn ranks_hold_the_kv_heads_of_their_q_heads() {
        for (heads, kv, n) in [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 4), (8, 2, 8), (8, 4, 2)] {
            let c = config(heads, kv);
            for s in shards(&c, n).unwrap() {
                let group = heads / kv;
                let (q0, q1) = (s.q.start / 8, s.q.end / 8);
                let need = q0 / group..(q1 - 1) / group + 1;
                assert_eq!(s.kv.start / 8..s.kv.end / 8, need, "heads {heads} kv {kv} ranks {n} rank {}", s.rank);
            }
        }
    }

    #[test]
    fn what_does_not_divide_is_named() {
        let e = shards(&config(6, 2), 4).unwrap_err();
        assert!(e.contains("num_attention_heads = 6") && e.contains("--tensor-parallel-size 4"), "{e}");
        let e = shards(&config(8, 3), 2).unwrap_err();
        assert!(e.contains("num_key_value_heads = 3 is not divisible by 2"), "{e}");
        let mut c = config(12, 4);
        c.intermediate_size = 120;
        let e = shards(&c, 6).unwrap_err();
        assert!(e.contains("num_key_value_heads = 4"), "{e}");
        let mut c = config(8, 8);
        c.vocab_size = 97;
        assert!(shards(&c, 2).unwrap_err().contains("vocab_size = 97"));
    }
}
