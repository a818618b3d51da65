//! Causal attention over a paged KV cache, varlen: every new token row attends to all cached
//! positions of its own sequence up to and including its own position.
//!
//! The unit of work is a (sequence, kv head) pair and its *queries*: the sequence's new rows ×
//! the q heads that share the kv head, in (row, head) order. Register tiles of up to `MR` queries
//! go over the keys four at a time with the GEMM's register tile, so a K row is loaded once per
//! tile instead of once per query (GQA groups in decode, rows × heads in prefill); then each
//! query's softmax; then `o = Σ_t p_t·v_t` with the tile's accumulators in registers, a V row
//! loaded once per tile.
//!
//! **Invariant: a query's output depends only on its q, the K/V of its context and the
//! context's length, never on the tile it shares.** Scores are GEMM tile elements (whose
//! accumulation order is independent of the tile by the GEMM's own invariant); the softmax runs
//! per query; the weighted sum adds `p_t·v_t` in position order, and positions past a query's
//! context (a prefill tile spans rows at several positions) carry weight exactly 0, which leaves
//! an accumulator unchanged. So a row gets bit-identical attention in prefill and in decode, in
//! any batch: what the exact replay of a preempted request relies on.

use super::dot::{tile, Portable, Simd, NR};
use super::simd::{exp_shift_sum, isa, prefetch_l2, Isa};
use crate::{AttnBatch, KvStorage, Tensor};
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// Scores of one tile, `[MR][ctx]`.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Cache row offsets of a sequence's positions (see `Group::offs`).
    static OFFSETS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// Tasks before each sequence (prefix sums), reused across steps.
    static TASKS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Most queries per register tile (the GEMM's widest row tile).
const MR: usize = 6;
/// Tiles per parallel task: enough work to pay for a task, small enough to balance a single
/// long prefill over the threads.
const TILES_PER_TASK: usize = 8;

/// One (sequence, kv head)'s view of the step.
struct Group<'a> {
    qkv: &'a [f32],
    width: usize,
    hd: usize,
    /// q heads per kv head.
    group: usize,
    /// First q head of this kv head.
    head0: usize,
    n_heads: usize,
    kc: &'a [f32],
    vc: &'a [f32],
    table: &'a [u32],
    bs: usize,
    kvw: usize,
    /// This kv head's offset inside a cached K/V row.
    koff: usize,
    scale: f32,
    /// The sequence's first token row and the positions of all rows.
    row0: usize,
    positions: &'a [u32],
    /// Offset of each context position's row in the K/V caches, for the positions the queries
    /// being run attend to (filled by `run`): looked up through the block table with a division
    /// per key and pass, decode attention spent more time in integer division than in its
    /// multiply-adds (16% of a 16-stream engine run, for ~2% of the FLOPs).
    offs: &'a [usize],
}

impl Group<'_> {
    /// Token row, q head of the sequence's query `i`.
    fn query(&self, i: usize) -> (usize, usize) {
        (self.row0 + i / self.group, self.head0 + i % self.group)
    }
    /// Offset of position `t`'s row, this kv head's part, in the K/V caches.
    #[inline(always)]
    fn kv_at(&self, t: usize) -> usize {
        self.offs[t] + self.koff
    }
    /// `offs` for positions `0..ctx`, walking the block table block by block.
    fn fill_offsets(&self, ctx: usize, offs: &mut Vec<usize>) {
        offs.clear();
        for (blk, &id) in self.table[..ctx.div_ceil(self.bs)].iter().enumerate() {
            let base = id as usize * self.bs * self.kvw;
            let n = self.bs.min(ctx - blk * self.bs);
            offs.extend((0..n).map(|o| base + o * self.kvw));
        }
    }
}

/// Scores of queries `xs` against the `NR` keys `ws`, scaled, into rows `i0..` of `sc` (row
/// stride `cmax`) at column `t0` (the keys past `cmax` are dropped).
///
/// # Safety
/// q rows and K rows hold `hd` readable floats; the CPU supports `S`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_scores<S: Simd, const N: usize>(xs: &[*const f32], ws: [*const f32; NR], hd: usize, scale: f32, sc: &mut [f32], i0: usize, cmax: usize, t0: usize) {
    let x: [*const f32; N] = std::array::from_fn(|i| xs[i]);
    let d = unsafe { tile::<S, N, f32>(x, ws, hd) };
    for (i, row) in d.iter().enumerate() {
        for (j, &v) in row.iter().enumerate().take(cmax - t0) {
            sc[(i0 + i) * cmax + t0 + j] = v * scale;
        }
    }
}

/// How many keys ahead of the score tile its K rows are prefetched.
const KV_AHEAD: usize = 16;

/// Hint that the `len` floats at `p` will be read soon: into L1, or into L2 when `later`. The
/// last element's line too, for rows that do not start on a line.
#[inline(always)]
fn prefetch_row<S: Simd>(p: *const f32, len: usize, later: bool) {
    for l in (0..len).step_by(16).chain(std::iter::once(len.saturating_sub(1))) {
        let at = p.wrapping_add(l) as *const u8;
        if later {
            prefetch_l2(at);
        } else {
            // SAFETY: a prefetch never faults, and `S` is what the caller runs on.
            unsafe { S::prefetch(at) };
        }
    }
}

/// Queries `q0..q0 + R` of `g`, written to `out` (row stride `n_heads·hd`). Scores take `QR`
/// queries per dot-product tile, and the weighted sum as many vectors of the head dim (4, 2 or 1)
/// per register tile as keep its `R` rows within `ACC` accumulators: what the instruction set's
/// registers hold. AVX-512 (32): 6 × 4 keys, 24 accumulators; AVX2 (16): 3 × 4 keys, 12 (6
/// queries × 2 vectors, a decode row's 3 GQA heads × 4; with 6 × 4 in both, AVX2 spilled 24
/// accumulators every step, and 3 × 2 left the weighted sum waiting on its 6 FMA chains).
///
/// # Safety
/// The queries' output rows are this call's alone; the CPU supports `S`.
#[inline(always)]
unsafe fn tile_queries<S: Simd, const R: usize, const QR: usize, const ACC: usize>(g: &Group<'_>, q0: usize, out: *mut f32, scores: &mut Vec<f32>) {
    let hd = g.hd;
    let mut xs = [std::ptr::null::<f32>(); R];
    let mut ctx = [0usize; R];
    for i in 0..R {
        let (r, h) = g.query(q0 + i);
        xs[i] = g.qkv[r * g.width + h * hd..].as_ptr();
        ctx[i] = g.positions[r] as usize + 1;
    }
    let cmax = ctx.iter().copied().max().unwrap_or(0);
    if scores.len() < R * cmax {
        scores.resize(R * cmax, 0.0);
    }
    let sc = &mut scores[..R * cmax];
    // Scores, four keys at a time (the last group repeats its last key and drops the extras).
    let mut t0 = 0;
    while t0 < cmax {
        let ws: [*const f32; NR] = std::array::from_fn(|j| g.kc[g.kv_at((t0 + j).min(cmax - 1))..].as_ptr());
        // The K and V rows of a context are scattered over the pool's blocks (one kv head's
        // 256 bytes every `kvw` floats) and, over a step's sequences and layers, far larger than
        // the caches: each was a cache miss the loop waited on (57% of decode attention's samples
        // sat on V loads). Ask for the K rows `KV_AHEAD` keys ahead, and for these keys' V rows,
        // which the weighted sum reads after the softmax.
        for j in 0..NR {
            if t0 + KV_AHEAD + j < cmax {
                prefetch_row::<S>(g.kc[g.kv_at(t0 + KV_AHEAD + j)..].as_ptr(), hd, false);
            }
            if t0 + j < cmax {
                prefetch_row::<S>(g.vc[g.kv_at(t0 + j)..].as_ptr(), hd, true);
            }
        }
        let mut i0 = 0;
        while i0 < R {
            let n = QR.min(R - i0);
            let x = &xs[i0..];
            // SAFETY: q rows and K rows hold hd readable floats; the CPU supports S (caller).
            unsafe {
                match n {
                    1 => qk_scores::<S, 1>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                    2 => qk_scores::<S, 2>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                    3 => qk_scores::<S, 3>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                    4 => qk_scores::<S, 4>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                    5 => qk_scores::<S, 5>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                    _ => qk_scores::<S, 6>(x, ws, hd, g.scale, sc, i0, cmax, t0),
                }
            }
            i0 += n;
        }
        t0 += NR;
    }
    // Softmax per query; weights past its context are 0.
    for (i, &c) in ctx.iter().enumerate() {
        let s = &mut sc[i * cmax..(i + 1) * cmax];
        let max = s[..c].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let inv = 1.0 / exp_shift_sum(&mut s[..c], max);
        s[..c].iter_mut().for_each(|p| *p *= inv);
        s[c..].fill(0.0);
    }
    // o = Σ_t p_t · v_t: blocks of 4 or 2 vectors of the head dim, then single vectors, then
    // single elements.
    let ld = g.n_heads * hd;
    let orows: [*mut f32; R] = std::array::from_fn(|i| {
        let (r, h) = g.query(q0 + i);
        // SAFETY: the caller owns these output rows.
        unsafe { out.add(r * ld + h * hd) }
    });
    let mut d0 = 0;
    let vc = if 4 * R <= ACC { 4 } else { 2 };
    while d0 + vc * S::L <= hd {
        // SAFETY: d0 + vc·L ≤ hd: inside every V row and output row.
        unsafe {
            if vc == 4 {
                weighted_sum::<S, R, 4>(g, sc, cmax, d0, orows)
            } else {
                weighted_sum::<S, R, 2>(g, sc, cmax, d0, orows)
            }
        };
        d0 += vc * S::L;
    }
    while d0 + S::L <= hd {
        // SAFETY: as above.
        unsafe { weighted_sum::<S, R, 1>(g, sc, cmax, d0, orows) };
        d0 += S::L;
    }
    for (i, &o) in orows.iter().enumerate() {
        for d in d0..hd {
            let mut a = 0.0f32;
            for t in 0..cmax {
                a = sc[i * cmax + t].mul_add(g.vc[g.kv_at(t) + d], a);
            }
            // SAFETY: d < hd, inside the caller's output row.
            unsafe { *o.add(d) = a };
        }
    }
}

/// Columns `d0..d0 + C·L` of `o_i = Σ_{t < cmax} p[i·cmax + t] · v_t` for the tile's `R` queries,
/// accumulators in registers, each V vector loaded once for the tile.
///
/// # Safety
/// `d0 + C·L ≤ hd`; `orows` are the caller's; the CPU supports `S`.
#[inline(always)]
unsafe fn weighted_sum<S: Simd, const R: usize, const C: usize>(g: &Group<'_>, p: &[f32], cmax: usize, d0: usize, orows: [*mut f32; R]) {
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        for t in 0..cmax {
            let v = g.vc[g.kv_at(t) + d0..].as_ptr();
            let mut vv = [S::zero(); C];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = S::load(v.add(c * S::L));
            }
            for i in 0..R {
                let w = S::splat(p[i * cmax + t]);
                for c in 0..C {
                    acc[i][c] = S::madd(w, vv[c], acc[i][c]);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (c, &v) in a.iter().enumerate() {
                S::store(orows[i].add(d0 + c * S::L), v);
            }
        }
    }
}

/// Queries `q0..q1` of `g`, in tiles of up to `MR`. No closures in here: a closure does not
/// inherit the caller's target features, and the vector helpers stop inlining inside it.
///
/// # Safety
/// See `tile_queries`.
#[inline(always)]
unsafe fn run_queries<S: Simd, const QR: usize, const ACC: usize>(g: &Group<'_>, q0: usize, q1: usize, out: *mut f32, sc: &mut Vec<f32>) {
    let mut q = q0;
    while q < q1 {
        let r = MR.min(q1 - q);
        // SAFETY: forwarded from the caller.
        unsafe {
            match r {
                1 => tile_queries::<S, 1, QR, ACC>(g, q, out, sc),
                2 => tile_queries::<S, 2, QR, ACC>(g, q, out, sc),
                3 => tile_queries::<S, 3, QR, ACC>(g, q, out, sc),
                4 => tile_queries::<S, 4, QR, ACC>(g, q, out, sc),
                5 => tile_queries::<S, 5, QR, ACC>(g, q, out, sc),
                _ => tile_queries::<S, 6, QR, ACC>(g, q, out, sc),
            }
        }
        q += r;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_entry {
    use super::super::dot::x86::{Avx2, Avx512};
    use super::Group;
    /// # Safety
    /// The CPU has AVX-512F; see `tile_queries`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn avx512(g: &Group<'_>, q0: usize, q1: usize, out: *mut f32, sc: &mut Vec<f32>) {
        unsafe { super::run_queries::<Avx512, 6, 24>(g, q0, q1, out, sc) }
    }
    /// # Safety
    /// The CPU has AVX2 and FMA; see `tile_queries`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(g: &Group<'_>, q0: usize, q1: usize, out: *mut f32, sc: &mut Vec<f32>) {
        unsafe { super::run_queries::<Avx2, 3, 12>(g, q0, q1, out, sc) }
    }
}

/// # Safety
/// See `tile_queries`; `isa` is what this CPU supports.
unsafe fn run(isa: Isa, g: &Group<'_>, q0: usize, q1: usize, out: *mut f32) {
    SCORES.with(|sc| {
        OFFSETS.with(|offs| {
            let sc = &mut sc.borrow_mut();
            let offs = &mut offs.borrow_mut();
            // Positions grow along a sequence's rows, but take the largest context of the
            // range whatever the order.
            let ctx = (q0..q1).map(|q| g.positions[g.query(q).0] as usize + 1).max().unwrap_or(0);
            g.fill_offsets(ctx, offs);
            let g = &Group { offs: &offs[..], ..*g };
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => x86_entry::avx512(g, q0, q1, out, sc),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => x86_entry::avx2(g, q0, q1, out, sc),
                    _ => run_queries::<Portable, 2, 8>(g, q0, q1, out, sc),
                }
            }
        })
    })
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

    let (kc, vc) = (kv.k[layer].as_cpu(), kv.v[layer].as_cpu());
    let group = n_heads / nkv;
    let out = &mut out.as_cpu_mut()[..rows * n_heads * hd];
    let outp = super::SyncPtr(out.as_mut_ptr() as *const f32);
    let isa = isa();
    let grp = |s: usize, g: usize| Group {
        qkv,
        width,
        hd,
        group,
        head0: g * group,
        n_heads,
        kc,
        vc,
        table: &b.block_tables[s * b.block_table_stride..],
        bs,
        kvw,
        koff: g * hd,
        scale,
        row0: b.seq_starts[s] as usize,
        positions: b.positions,
        offs: &[],
    };
    let queries = |s: usize| (b.seq_starts[s + 1] - b.seq_starts[s]) as usize * group;
    // Work is proportional to the context each row attends to, not to the output size.
    let work = b.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * n_heads * hd;
    if work < super::PAR_MIN_ELEMS {
        for s in 0..nseq {
            for g in 0..nkv {
                // SAFETY: one thread writes every output row; the ISA was detected.
                unsafe { run(isa, &grp(s, g), 0, queries(s), outp.0 as *mut f32) };
            }
        }
        return;
    }
    // Tasks: per sequence and kv head, blocks of TILES_PER_TASK tiles of its queries.
    let per_task = MR * TILES_PER_TASK;
    TASKS.with(|t| {
        // A thread waiting inside this op's parallel loop may run another forward pass's whole
        // step (steps run on pool workers, see `CpuDevice::run_step`), whose attention then
        // finds the buffer borrowed and uses a fresh one.
        let mut own = Vec::new();
        let mut held = t.try_borrow_mut();
        let before = match held.as_mut() {
            Ok(b) => &mut **b,
            Err(_) => &mut own,
        };
        before.clear();
        let mut n = 0u32;
        for s in 0..nseq {
            before.push(n);
            n += (nkv * queries(s).div_ceil(per_task)) as u32;
        }
        let before = &before[..];
        (0..n as usize).into_par_iter().for_each(|task| {
            // The whole wrapper, not its raw-pointer field, must be captured (edition 2021
            // closures capture fields), or the closure is not Send.
            #[allow(clippy::redundant_locals)]
            let outp = outp;
            let s = before.partition_point(|&b| b as usize <= task) - 1;
            let blocks = queries(s).div_ceil(per_task);
            let (g, blk) = ((task - before[s] as usize) / blocks, (task - before[s] as usize) % blocks);
            let q0 = blk * per_task;
            // SAFETY: tasks own disjoint (row, head) outputs: sequences own their rows, kv
            // heads their q heads, blocks their queries. The ISA was detected.
            unsafe { run(isa, &grp(s, g), q0, (q0 + per_task).min(queries(s)), outp.0 as *mut f32) };
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvLayout;

    /// A 13-row prompt with a head dim that leaves a partial vector (24) and three q heads per kv
    /// head: prefill matches an f64 softmax-attention reference, and feeding the same rows one at
    /// a time (decode) gives bit-identical outputs.
    #[test]
    fn prefill_matches_reference_and_decode_bit_for_bit() {
        let (nh, nkv, hd, bs, rows) = (6, 2, 24, 4, 13);
        let width = (nh + 2 * nkv) * hd;
        let mut seed = 7u32;
        let qkv: Vec<f32> = (0..rows * width)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        let layout = KvLayout { num_layers: 1, num_blocks: 8, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let table: Vec<u32> = vec![5, 2, 7, 0];
        let scale = 0.3f32;
        let new_kv = || KvStorage { layout, k: vec![Tensor::zeros_cpu(layout.layer_len())], v: vec![Tensor::zeros_cpu(layout.layer_len())] };
        // Prefill: all rows in one call.
        let positions: Vec<u32> = (0..rows as u32).collect();
        let mut kv = new_kv();
        let mut out = Tensor::zeros_cpu(rows * nh * hd);
        let b = AttnBatch { seq_starts: &[0, rows as u32], positions: &positions, ctx_lens: &[rows as u32], block_tables: &table, block_table_stride: 4 };
        paged_attention(&Tensor::cpu(qkv.clone()), &b, &mut kv, 0, nh, scale, &mut out);
        let pre = out.as_cpu()[..rows * nh * hd].to_vec();
        for r in 0..rows {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let q = &qkv[r * width + h * hd..][..hd];
                let key = |t: usize| &qkv[t * width + nh * hd + g * hd..][..hd];
                let val = |t: usize| &qkv[t * width + (nh + nkv) * hd + g * hd..][..hd];
                let s: Vec<f64> = (0..=r).map(|t| q.iter().zip(key(t)).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64).collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for d in 0..hd {
                    let want: f64 = (0..=r).map(|t| (s[t] - m).exp() / z * val(t)[d] as f64).sum();
                    let got = pre[r * nh * hd + h * hd + d] as f64;
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "row {r} head {h} dim {d}: {got} vs {want}");
                }
            }
        }
        // Decode: the same rows one per call.
        let mut kv = new_kv();
        for r in 0..rows {
            let mut o = Tensor::zeros_cpu(nh * hd);
            let b = AttnBatch { seq_starts: &[0, 1], positions: &[r as u32], ctx_lens: &[r as u32 + 1], block_tables: &table, block_table_stride: 4 };
            paged_attention(&Tensor::cpu(qkv[r * width..(r + 1) * width].to_vec()), &b, &mut kv, 0, nh, scale, &mut o);
            assert_eq!(&o.as_cpu()[..nh * hd], &pre[r * nh * hd..(r + 1) * nh * hd], "row {r}: decode differs from prefill");
        }
    }
}
