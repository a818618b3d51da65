//! Causal attention over a paged KV cache, varlen: every new token row attends to all cached
//! positions of its own sequence up to and including its own position.

use crate::{AttnBatch, KvStorage, Tensor};
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Index of the sequence owning token row `row` (seq_starts is a CSR offset array).
fn seq_of_row(seq_starts: &[u32], row: usize) -> usize {
    // partition_point gives the first start > row; the owner is the one before it.
    seq_starts.partition_point(|&s| s as usize <= row) - 1
}

pub(super) fn paged_attention(qkv: &Tensor, b: &AttnBatch<'_>, kv: &mut KvStorage, layer: usize, n_heads: usize, scale: f32, out: &mut Tensor) {
    let l = kv.layout;
    let (hd, nkv, bs) = (l.head_dim, l.n_kv_heads, l.block_size);
    let width = (n_heads + 2 * nkv) * hd;
    let rows = b.positions.len();
    let qkv = &qkv.as_cpu()[..rows * width];
    let kvw = nkv * hd;
    let nseq = b.seq_starts.len() - 1;

    // Write this step's keys and values into their cache slots first, so attention below reads
    // cached and new tokens the same way.
    {
        let (kc, vc) = (kv.k[layer].as_cpu_mut(), kv.v[layer].as_cpu_mut());
        for s in 0..nseq {
            let table = &b.block_tables[s * b.block_table_stride..];
            for r in b.seq_starts[s] as usize..b.seq_starts[s + 1] as usize {
                let pos = b.positions[r] as usize;
                let slot = table[pos / bs] as usize * bs + pos % bs;
                let k_off = r * width + n_heads * hd;
                kc[slot * kvw..(slot + 1) * kvw].copy_from_slice(&qkv[k_off..k_off + kvw]);
                vc[slot * kvw..(slot + 1) * kvw].copy_from_slice(&qkv[k_off + kvw..k_off + 2 * kvw]);
            }
        }
    }

    let kc = kv.k[layer].as_cpu();
    let vc = kv.v[layer].as_cpu();
    let group = n_heads / nkv;
    let out = &mut out.as_cpu_mut()[..rows * n_heads * hd];
    // Work is proportional to the context each row attends to, not to the output size.
    let work = b.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * n_heads * hd;
    super::for_rows_if(work >= super::PAR_MIN_ELEMS, out, hd, |idx, o| {
        let (r, h) = (idx / n_heads, idx % n_heads);
        let s = seq_of_row(b.seq_starts, r);
        let table = &b.block_tables[s * b.block_table_stride..];
        let ctx = b.positions[r] as usize + 1;
        let kvh = h / group;
        let q = &qkv[r * width + h * hd..r * width + (h + 1) * hd];
        SCORES.with(|sc| {
            let mut sc = sc.borrow_mut();
            if sc.len() < ctx {
                sc.resize(ctx, 0.0);
            }
            super::simd::attend_head(q, kc, vc, table, bs, kvw, kvh * hd, scale, &mut sc[..ctx], o);
        });
    });
}
