//! Dequantization of ggml's block formats to f32.
//!
//! Each block function mirrors the arithmetic of gguf-py's `quants.py` operation for operation
//! (all in f32, products formed in the same order, no fused multiply-add) so results are
//! bit-identical to the Python oracle, not merely close.

// `%` rather than `is_multiple_of`: the workspace declares rust-version 1.85, older than that API.
#![allow(clippy::manual_is_multiple_of)]

use half::{bf16, f16};
use rayon::prelude::*;

use super::ggml_type::{GgmlType, QK_K};

type BlockFn = fn(&[u8], &mut [f32]);

pub(super) fn block_fn(ty: GgmlType) -> Option<BlockFn> {
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
