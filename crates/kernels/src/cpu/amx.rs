//! `y = x · Wᵀ` on Intel AMX tiles (bf16 multiplies, f32 accumulators): an opt-in throughput
//! mode (`QUIVER_CPU_AMX=1`) in which the CPU device runs every weight matmul, at every M, on
//! tiles, when the CPU has AMX-BF16 and the OS grants the tile state.
//!
//! Why: one AMX tile multiply does 16·16·32 multiply-adds; a core runs ~1.5 TFLOP/s of them here
//! against ~0.13 TFLOP/s of AVX-512 f32 FMAs, so prefill and large decode batches get 1.7–3.4×
//! faster GEMMs. Why not by default: at 1–4 rows a tile multiply wastes 15/16 of its work and
//! a tile load cannot overlap the multiplies still reading its register, so single-stream
//! decode runs at ~0.5× the FMA GEMM (measured; BENCHMARKS.md). Using tiles only for large M
//! would break the batch invariance below, which the engine's exactness guarantees rest on.
//!
//! **Arithmetic ("bf16x3").** An f32 value v is carried as two bf16, `hi = bf16(v)` and
//! `lo = bf16(v − hi)` (round to nearest even), about 17 significant bits together. Per output
//! element, over the chunks of 32 k in increasing order, one f32 accumulator takes `W_hi·x_hi`,
//! then `W_hi·x_lo`, then `W_lo·x_hi` (each a 32-term tile dot product). The dropped
//! `W_lo·x_lo` and the two representation errors bound the relative error of each product by
//! about 3·2⁻¹⁷ (≈ 2e-5), against 2⁻²⁴ per f32 FMA: PyTorch's "high" float32 matmul precision,
//! which oneDNN implements the same way. bf16 weights have no `lo`, so their products are exact
//! up to `x_lo`'s rounding. Weights are converted once at load ([`TiledWeight`], the same
//! 4 bytes per f32 weight).
//!
//! **Invariant (as in panel.rs): how an element is computed does not depend on M.** A tile's
//! 16×16 accumulators are independent per element; which rows share a tile, how many tiles run
//! together and the split into tasks never change an element's sequence of operations. So a
//! row's result is bit-identical alone (decode) or inside any batch, as on the FMA path.
//!
//! Layout. Result tiles are `Cᵀ`: 16 rows of W (n) × 16 rows of x (m). The left operand is a
//! 16 × 32 block of W, stored as a contiguous 1 KiB tile ([`TiledWeight`]); the right operand
//! is x packed once per call into VNNI tiles: tile row p holds, for each of the 16 x rows, the
//! pair `x[m][2p], x[m][2p+1]` of its 32-wide k chunk.

use half::bf16;
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::SyncPtr;

/// Rows of a tile: x rows per right operand, W rows per left operand, accumulator rows.
const TILE: usize = 16;
/// bf16 k values per tile row (64 bytes).
const KC: usize = 32;
/// u16 elements of one 16 × 64-byte tile.
const TILE_ELEMS: usize = TILE * KC;
/// Blocks (of 16 x rows, or of 16 W rows for decode) accumulated together: one accumulator
/// tile each, four of the eight tile registers; W's hi and lo and x's hi and lo take the rest.
const GROUP: usize = 4;
/// Below this many multiply-adds the whole product runs on the calling thread.
const SEQ_WORK: usize = 64 * 1024;

/// Whether AMX GEMMs are used: `QUIVER_CPU_AMX=1`, the CPU has AMX-BF16 and AVX-512BW, and the
/// OS granted the tile state to this process. Decided once per process.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let asked = match std::env::var("QUIVER_CPU_AMX").as_deref() {
            Ok("1") => true,
            Ok("0") | Err(_) => false,
            Ok(v) => {
                tracing::warn!("QUIVER_CPU_AMX={v:?} is neither 0 nor 1: using the f32 FMA GEMM");
                false
            }
        };
        if asked && !supported() {
            tracing::warn!("QUIVER_CPU_AMX=1 but this CPU or OS offers no AMX-BF16 tiles: using the f32 FMA GEMM");
        }
        asked && supported()
    })
}

/// The CPU and OS can run the tile kernel (regardless of `QUIVER_CPU_AMX`).
pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        return false;
    }
    #[allow(unused_unsafe)]
    // SAFETY: cpuid is baseline on x86-64; leaf 7 exists when leaf 0 reports it.
    let (max, edx7) = unsafe { (__cpuid_count(0, 0).eax, __cpuid_count(7, 0).edx) };
    let (amx_bf16, amx_tile) = (edx7 >> 22 & 1 == 1, edx7 >> 24 & 1 == 1);
    if max < 7 || !amx_bf16 || !amx_tile {
        return false;
    }
    // Linux keeps the 8 KiB tile state off by default: ask for it once for the whole process
    // (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); a refusal means no tiles.
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain syscall that only changes this process's permitted xsave features.
    unsafe {
        std::arch::asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// bf16 bits of `v`, rounded to nearest even (NaN stays NaN).
#[inline(always)]
fn bf16_bits(v: f32) -> u32 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16;
    if v.is_nan() { (b >> 16) | 0x40 } else { rounded }
}

/// `(hi, lo)` with `hi = bf16(v)`, `lo = bf16(v − hi)`.
#[inline(always)]
fn split(v: f32) -> (u16, u16) {
    let hi = bf16_bits(v);
    (hi as u16, bf16_bits(v - f32::from_bits(hi << 16)) as u16)
}

/// One 32-wide chunk of a row, zero past `k`.
#[inline(always)]
fn chunk<T: Copy + Default>(row: &[T], kc: usize) -> [T; KC] {
    let start = kc * KC;
    let mut c = [T::default(); KC];
    if start + KC <= row.len() {
        c.copy_from_slice(&row[start..start + KC]);
    } else if start < row.len() {
        c[..row.len() - start].copy_from_slice(&row[start..]);
    }
    c
}

/// A weight element type that can be tiled: f32 (split into two bf16 planes) or bf16 (one).
pub trait AmxWeight: Copy + Default + Send + Sync + 'static {
    /// bf16 planes per weight: 2 (hi, lo) for f32, 1 for bf16.
    const PLANES: usize;
    /// The bf16 bits of each plane (the second is unused with one plane).
    fn planes(self) -> (u16, u16);
}

impl AmxWeight for f32 {
    const PLANES: usize = 2;
    #[inline(always)]
    fn planes(self) -> (u16, u16) {
        split(self)
    }
}

impl AmxWeight for bf16 {
    const PLANES: usize = 1;
    #[inline(always)]
    fn planes(self) -> (u16, u16) {
        (self.to_bits(), 0)
    }
}

/// Writes rows `0..rows.len() / k` (≤ 16) of W, block `j` of a group, into the group's `panel`
/// as left-operand tiles: tile `(kc, plane)` at `((kc · GROUP + j) · PLANES + plane) ·
/// TILE_ELEMS`, row r at `r · 32`. Rows past the end and k past `k` stay zero.
fn convert_panel<W: AmxWeight>(rows: &[W], k: usize, panel: &mut [u16], j: usize) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512BW (and so F) was just detected.
        return unsafe { convert_panel_avx512(rows, k, panel, j) };
    }
    convert_panel_body(rows, k, panel, j)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn convert_panel_avx512<W: AmxWeight>(rows: &[W], k: usize, panel: &mut [u16], j: usize) {
    convert_panel_body(rows, k, panel, j)
}

#[inline(always)]
fn convert_panel_body<W: AmxWeight>(rows: &[W], k: usize, panel: &mut [u16], j: usize) {
    for (r, row) in rows.chunks_exact(k).enumerate() {
        for kc in 0..k.div_ceil(KC) {
            let t = (kc * GROUP + j) * W::PLANES * TILE_ELEMS + r * KC;
            let c = chunk(row, kc);
            for (i, v) in c.iter().enumerate() {
                let (hi, lo) = v.planes();
                panel[t + i] = hi;
                if W::PLANES == 2 {
                    panel[t + TILE_ELEMS + i] = lo;
                }
            }
        }
    }
}

/// A weight matrix `[rows, cols]` stored as left-operand tiles, converted once at load:
/// tile `(nb, kc, plane)` (16 rows from `16·nb`, 32 columns from `32·kc`) at
/// `(((nb / 4 · kcs + kc) · 4 + nb % 4) · planes + plane) · 512` u16, zero-padded past the last
/// row (to a whole group of four row blocks) and column. The four row blocks of a group are
/// interleaved per k chunk because decode multiplies them together: a task then streams W
/// strictly front to back, 1 KiB per tile, which the prefetchers follow.
pub struct TiledWeight {
    rows: usize,
    cols: usize,
    planes: usize,
    data: crate::aligned::AlignedVec<u16>,
}

impl TiledWeight {
    pub fn from_f32(rows: usize, cols: usize, w: &[f32]) -> Self {
        Self::build(rows, cols, w)
    }
    pub fn from_bf16(rows: usize, cols: usize, w: &[bf16]) -> Self {
        Self::build(rows, cols, w)
    }
    fn build<W: AmxWeight>(rows: usize, cols: usize, w: &[W]) -> Self {
        assert_eq!(w.len(), rows * cols, "tiled weight: data does not match its shape");
        let per_group = GROUP * cols.div_ceil(KC).max(1) * W::PLANES * TILE_ELEMS;
        let mut data = crate::aligned::AlignedVec::zeroed(rows.div_ceil(GROUP * TILE) * per_group);
        if cols > 0 {
            data.par_chunks_mut(per_group).enumerate().for_each(|(ng, dst)| {
                for j in 0..GROUP {
                    let r0 = ((ng * GROUP + j) * TILE).min(rows);
                    let r1 = (r0 + TILE).min(rows);
                    convert_panel(&w[r0 * cols..r1 * cols], cols, dst, j)
                }
            });
        }
        TiledWeight { rows, cols, planes: W::PLANES, data }
    }
    /// `true` for f32 weights (hi and lo planes), `false` for bf16.
    pub fn is_f32(&self) -> bool {
        self.planes == 2
    }
    pub fn size_bytes(&self) -> usize {
        self.data.len() * 2
    }
    /// Row `r` as f32 (hi + lo for f32 weights: the value the GEMM multiplies by).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let kcs = self.cols.div_ceil(KC);
        let (nb, rr) = (r / TILE, r % TILE);
        for (c, o) in out[..self.cols].iter_mut().enumerate() {
            let t = (((nb / GROUP * kcs + c / KC) * GROUP + nb % GROUP) * self.planes) * TILE_ELEMS + rr * KC + c % KC;
            let hi = f32::from_bits((self.data[t] as u32) << 16);
            *o = if self.planes == 2 { hi + f32::from_bits((self.data[t + TILE_ELEMS] as u32) << 16) } else { hi };
        }
    }
}

/// Packs rows `0..x.len() / k` (≤ 16) of x as right-operand tiles: tile `(kc, plane)` at
/// `(kc · 2 + plane) · TILE_ELEMS`, element `(m, k = kc·32 + 2p + j)` at `p · 32 + m · 2 + j`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_x_block_avx512(x: &[f32], k: usize, dst: &mut [u16]) {
    pack_x_block_body(x, k, dst)
}

#[inline(always)]
fn pack_x_block_body(x: &[f32], k: usize, dst: &mut [u16]) {
    let rows = x.len() / k;
    if rows < TILE {
        dst.fill(0);
    }
    for m in 0..rows {
        let row = &x[m * k..(m + 1) * k];
        for kc in 0..k.div_ceil(KC) {
            let c = chunk(row, kc);
            let (mut h, mut l) = ([0u16; KC], [0u16; KC]);
            for t in 0..KC {
                (h[t], l[t]) = split(c[t]);
            }
            let base = kc * 2 * TILE_ELEMS + m * 2;
            for p in 0..KC / 2 {
                let o = base + p * KC;
                dst[o] = h[2 * p];
                dst[o + 1] = h[2 * p + 1];
                dst[o + TILE_ELEMS] = l[2 * p];
                dst[o + TILE_ELEMS + 1] = l[2 * p + 1];
            }
        }
    }
}

fn pack_x_block(x: &[f32], k: usize, dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512BW (and so F) was just detected.
        return unsafe { pack_x_block_avx512(x, k, dst) };
    }
    pack_x_block_body(x, k, dst)
}

thread_local! {
    static XPACK: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// A 64-byte aligned window of `len` elements in `buf`, growing it once to the largest need.
fn aligned_window(buf: &mut Vec<u16>, len: usize) -> &mut [u16] {
    if buf.len() < len + 32 {
        buf.resize(len + 32, 0);
    }
    let off = buf.as_ptr().align_offset(64);
    &mut buf[off..off + len]
}


/// `y = x · Wᵀ` for x `[m, w.cols]`, y `[m, w.rows]`; the caller checked `enabled()`.
pub fn matmul(x: &[f32], m: usize, w: &TiledWeight, y: &mut [f32]) {
    let (k, n) = (w.cols, w.rows);
    assert!(x.len() >= m * k && y.len() >= m * n, "amx matmul: buffers too small for {m}x{k} · ({n}x{k})ᵀ");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y[..m * n].fill(0.0);
        return;
    }
    let len = m.div_ceil(TILE) * k.div_ceil(KC) * 2 * TILE_ELEMS;
    XPACK.with(|buf| match buf.try_borrow_mut() {
        Ok(mut buf) => matmul_packed(aligned_window(&mut buf, len), x, m, w, y),
        Err(_) => matmul_packed(aligned_window(&mut Vec::new(), len), x, m, w, y),
    })
}

/// Bytes of W a task should keep in L2 while every group of x rows passes over it.
const TASK_W_BYTES: usize = 512 * 1024;

fn matmul_packed(xp: &mut [u16], x: &[f32], m: usize, w: &TiledWeight, y: &mut [f32]) {
    let (k, n) = (w.cols, w.rows);
    let kcs = k.div_ceil(KC);
    let block = kcs * 2 * TILE_ELEMS;
    let pack = |(mb, dst): (usize, &mut [u16])| {
        let rows = TILE.min(m - mb * TILE);
        pack_x_block(&x[mb * TILE * k..(mb * TILE + rows) * k], k, dst)
    };
    if m >= 4 * TILE {
        xp.par_chunks_mut(block).enumerate().for_each(pack);
    } else {
        xp.chunks_mut(block).enumerate().for_each(pack);
    }
    let xp: &[u16] = xp;
    let ngs = n.div_ceil(GROUP * TILE);
    let yp = SyncPtr(y.as_mut_ptr() as *const f32);
    // SAFETY: tasks write disjoint column ranges of y; x and y were bounds-checked above and xp
    // holds one packed block per 16 rows of x.
    let task = |groups: std::ops::Range<usize>| {
        // The whole wrapper, not its raw pointer field, must be captured to cross threads.
        #[allow(clippy::redundant_locals)]
        let yp = yp;
        unsafe {
            if w.planes == 2 {
                task_body::<2>(xp, m, kcs, &w.data, n, groups, yp.0 as *mut f32)
            } else {
                task_body::<1>(xp, m, kcs, &w.data, n, groups, yp.0 as *mut f32)
            }
        }
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || m * n * k < SEQ_WORK {
        task(0..ngs);
    } else {
        // Enough tasks to balance the threads; with many x rows, few enough W rows per task
        // that its share of W stays in L2 while each group of x rows passes over it.
        let mut per = ngs.div_ceil(threads * 8).max(1);
        if m > TILE {
            per = per.min((TASK_W_BYTES / (GROUP * TILE * kcs * KC * w.planes * 2)).max(1));
        }
        (0..ngs.div_ceil(per)).into_par_iter().for_each(|t| task(t * per..((t + 1) * per).min(ngs)));
    }
}

/// Tile configuration (palette 1): all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    let mut i = 0;
    while i < 8 {
        c.colsb[i] = 64;
        c.rows[i] = TILE as u8;
        i += 1;
    }
    c
};

#[repr(C, align(64))]
struct Scratch([f32; TILE * TILE]);

/// Loads the right-operand tiles (x's hi and lo) at `b` and `b + 1 KiB` into tmm6/tmm7.
///
/// # Safety
/// The tile configuration is loaded; 2 KiB at `b` are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_x(b: *const u16) {
    unsafe {
        std::arch::asm!("tileloadd tmm6, [{b} + {s}*1]", "tileloadd tmm7, [{l} + {s}*1]",
            b = in(reg) b, l = in(reg) b.add(TILE_ELEMS), s = in(reg) 64usize, options(nostack, readonly))
    }
}

/// Loads the left-operand tiles (W's hi, and lo for f32) at `a` into tmm4 (and tmm5).
///
/// # Safety
/// The tile configuration is loaded; `PLANES` KiB at `a` are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_w<const PLANES: usize>(a: *const u16) {
    unsafe {
        std::arch::asm!("tileloadd tmm4, [{a} + {s}*1]", a = in(reg) a, s = in(reg) 64usize, options(nostack, readonly));
        if PLANES == 2 {
            std::arch::asm!("tileloadd tmm5, [{a} + {s}*1]", a = in(reg) a.add(TILE_ELEMS), s = in(reg) 64usize, options(nostack, readonly));
        }
    }
}

/// Accumulator tile `c` (tmm0–3) += `W_hi·x_hi`, then `W_hi·x_lo`, then (f32 W) `W_lo·x_hi`,
/// from the operands `load_w` and `load_x` put in tmm4–7.
///
/// # Safety
/// The tile configuration is loaded and the operand tiles hold data.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn multiply<const PLANES: usize>(c: usize) {
    macro_rules! dp {
        ($c:literal) => {
            if PLANES == 2 {
                std::arch::asm!(concat!("tdpbf16ps tmm", $c, ", tmm4, tmm6"), concat!("tdpbf16ps tmm", $c, ", tmm4, tmm7"),
                    concat!("tdpbf16ps tmm", $c, ", tmm5, tmm6"), options(nostack, nomem))
            } else {
                std::arch::asm!(concat!("tdpbf16ps tmm", $c, ", tmm4, tmm6"), concat!("tdpbf16ps tmm", $c, ", tmm4, tmm7"), options(nostack, nomem))
            }
        };
    }
    unsafe {
        match c {
            0 => dp!("0"),
            1 => dp!("1"),
            2 => dp!("2"),
            _ => dp!("3"),
        }
    }
}

/// Stores accumulator tile `i` (of x block `mb`, W block `nbi`) into y.
///
/// # Safety
/// As `task_body`; the tile configuration is loaded.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_tile(i: usize, out: &mut Scratch, m: usize, mb: usize, n: usize, nbi: usize, y: *mut f32) {
    use std::arch::asm;
    let p = out.0.as_mut_ptr();
    unsafe {
        match i {
            0 => asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) p, s = in(reg) 64usize, options(nostack)),
            1 => asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) p, s = in(reg) 64usize, options(nostack)),
            2 => asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) p, s = in(reg) 64usize, options(nostack)),
            _ => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) p, s = in(reg) 64usize, options(nostack)),
        }
    }
    let (m0, n0) = (mb * TILE, nbi * TILE);
    let cols = TILE.min(n - n0);
    for mm in 0..TILE.min(m - m0) {
        // SAFETY: row m0 + mm < m and columns n0..n0 + cols ≤ n belong to the caller's task.
        let yr = unsafe { y.add((m0 + mm) * n + n0) };
        for nn in 0..cols {
            unsafe { *yr.add(nn) = out.0[nn * TILE + mm] };
        }
    }
}

/// Columns `64·groups.start .. 64·groups.end` (clipped to n) of y, for every row.
///
/// Two loop orders, the same arithmetic per element: up to 16 x rows (decode), the four W
/// blocks of a group share the x tiles, loaded once per k chunk, and W streams front to back;
/// more rows, four x blocks (which then stay in L2) share each W tile as every W block of the
/// task passes over them.
///
/// # Safety
/// `xp` holds one packed block of `kcs` chunks per 16 rows of x; `w` is a tiled weight of
/// `PLANES` planes with at least `groups.end` groups; y is `m × n`; no other thread writes
/// these columns.
#[cfg(target_arch = "x86_64")]
unsafe fn task_body<const PLANES: usize>(xp: &[u16], m: usize, kcs: usize, w: &[u16], n: usize, groups: std::ops::Range<usize>, y: *mut f32) {
    use std::arch::asm;
    let mbs = m.div_ceil(TILE);
    let wtile = |nbi: usize, kc: usize| unsafe { w.as_ptr().add((((nbi / GROUP) * kcs + kc) * GROUP + nbi % GROUP) * PLANES * TILE_ELEMS) };
    let xtile = |mb: usize, kc: usize| unsafe { xp.as_ptr().add((mb * kcs + kc) * 2 * TILE_ELEMS) };
    let nb_end = (groups.end * GROUP).min(n.div_ceil(TILE));
    let mut out = Scratch([0.0; TILE * TILE]);
    // SAFETY (all asm below): the configuration is valid for palette 1 and set on this thread
    // before any tile use; every tile load reads 16 rows of 64 bytes inside xp or w (groups
    // are padded to four blocks, so the decode loop's tiles all exist).
    unsafe {
        asm!("ldtilecfg [{c}]", c = in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
        if mbs == 1 {
            for ng in groups.clone() {
                let n0 = ng * GROUP;
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                for kc in 0..kcs {
                    load_x(xtile(0, kc));
                    for j in 0..GROUP {
                        load_w::<PLANES>(wtile(n0 + j, kc));
                        multiply::<PLANES>(j);
                    }
                }
                for j in 0..GROUP.min(nb_end.saturating_sub(n0)) {
                    store_tile(j, &mut out, m, 0, n, n0 + j, y);
                }
            }
            return;
        }
        let mut mb = 0;
        while mb < mbs {
            let g = GROUP.min(mbs - mb);
            for nbi in groups.start * GROUP..nb_end {
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                for kc in 0..kcs {
                    load_w::<PLANES>(wtile(nbi, kc));
                    for i in 0..g {
                        load_x(xtile(mb + i, kc));
                        multiply::<PLANES>(i);
                    }
                }
                for i in 0..g {
                    store_tile(i, &mut out, m, mb + i, n, nbi, y);
                }
            }
            mb += g;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn task_body<const PLANES: usize>(_: &[u16], _: usize, _: usize, _: &[u16], _: usize, _: std::ops::Range<usize>, _: *mut f32) {
    unreachable!("AMX is never enabled off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn seed() -> u64 {
        let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        eprintln!("amx test seed {s}");
        s
    }

    fn random(rng: &mut impl Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn run(x: &[f32], m: usize, w: &TiledWeight) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.rows];
        matmul(x, m, w, &mut y);
        y
    }

    /// Against an f64 product of the f32 values: each product's relative error is at most
    /// ~3·2⁻¹⁷ (bf16x3) or 2⁻¹⁷ (bf16 weights, x split), plus f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    fn check(got: &[f32], x: &[f32], w: &[f32], m: usize, k: usize, n: usize, rel: f64, what: &str) {
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64);
                let (want, mag) = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
                let g = got[i * n + j] as f64;
                assert!((g - want).abs() <= (rel + 1e-6 * (k as f64).sqrt()) * mag + 1e-30, "{what} m={m} k={k} n={n} [{i},{j}]: {g} vs {want}");
            }
        }
    }

    #[test]
    fn tiled_products_are_accurate_and_batch_invariant() {
        if !supported() {
            eprintln!("no AMX here: skipped");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        // Odd shapes (tails in every dimension), then shapes that take the parallel path, the
        // four-block x groups and several tasks.
        let shapes = [(1, 1, 1), (3, 7, 5), (17, 33, 19), (16, 32, 16), (5, 100, 40), (70, 576, 131), (130, 64, 1000), (9, 1536, 577)];
        for &(m, k, n) in &shapes {
            let x = random(&mut rng, m * k);
            // Real activations have outliers: make some columns large so reassociation shows.
            let x: Vec<f32> = x.iter().enumerate().map(|(t, &v)| if t % k % 97 == 3 { v * 300.0 } else { v }).collect();
            let w = random(&mut rng, n * k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let (tf, tb) = (TiledWeight::from_f32(n, k, &w), TiledWeight::from_bf16(n, k, &wb));
            let (all, allb) = (run(&x, m, &tf), run(&x, m, &tb));
            check(&all, &x, &w, m, k, n, 4.0 * 2f64.powi(-17), "f32");
            check(&allb, &x, &wr, m, k, n, 2.0 * 2f64.powi(-17), "bf16");
            for i in 0..m {
                let row = &x[i * k..(i + 1) * k];
                assert_eq!(run(row, 1, &tf), all[i * n..(i + 1) * n], "f32 row {i} of {m} (k={k} n={n})");
                assert_eq!(run(row, 1, &tb), allb[i * n..(i + 1) * n], "bf16 row {i} of {m} (k={k} n={n})");
            }
        }
    }

    #[test]
    fn tiled_rows_read_back() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
        let (n, k) = (37, 70);
        let w = random(&mut rng, n * k);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let (tf, tb) = (TiledWeight::from_f32(n, k, &w), TiledWeight::from_bf16(n, k, &wb));
        let mut row = vec![0.0; k];
        for r in 0..n {
            tf.row_f32(r, &mut row);
            for (g, e) in row.iter().zip(&w[r * k..(r + 1) * k]) {
                assert!((g - e).abs() <= e.abs() * 2f32.powi(-16), "f32 row {r}: {g} vs {e}");
            }
            tb.row_f32(r, &mut row);
            assert!(row.iter().zip(&wb[r * k..(r + 1) * k]).all(|(g, e)| *g == e.to_f32()), "bf16 row {r}");
        }
    }

    #[test]
    fn split_rounds_to_nearest_even_and_keeps_nan() {
        for v in [1.0f32, -3.5, 1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 0.1, -7.3e-12, 6.5e4, f32::INFINITY] {
            let (hi, lo) = split(v);
            assert_eq!(hi, bf16::from_f32(v).to_bits(), "hi of {v}");
            if v.is_finite() {
                assert_eq!(lo, bf16::from_f32(v - bf16::from_bits(hi).to_f32()).to_bits(), "lo of {v}");
            }
        }
        assert!(bf16::from_bits(split(f32::NAN).0).is_nan());
    }
}
