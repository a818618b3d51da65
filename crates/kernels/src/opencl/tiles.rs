//! Tile sizes of the weight GEMMs: compiled into the programs as `-D` defines and used by the
//! host for the launch grids, from one value each, so the two can never disagree. The defaults
//! are untuned guesses; `QUIVER_OPENCL_TILES` (e.g. `GEMM_T=8,GEMV_WG=128,DPAS_NT=4`) overrides
//! them at start-up, which is how a kernel gets tuned on real hardware without a code change.
//! Every size keeps each output's multiply-add chain over k in order, so tuning never changes a
//! result, only the speed (batch invariance holds for any choice).

use super::KernelSet;
use anyhow::{bail, Result};

/// Most rows of the GEMV (`GEMV_ROWS` in gemm.cl): the most rows it can take.
pub(super) const GEMV_ROWS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tiles {
    /// Output tile edge of the portable GEMM; its work-group is `GEMM_T²` work-items.
    pub(super) gemm_t: usize,
    /// GEMV work-group (one output column per work-item) and input chunk staged per pass.
    pub(super) gemv_wg: usize,
    pub(super) gemv_kc: usize,
    /// Row tiles of 8 and column tiles of one subgroup width per DPAS subgroup.
    pub(super) dpas_mt: usize,
    pub(super) dpas_nt: usize,
    /// Most grouped rows of one expert per tile of the experts' grouped GEMM (a work-group row
    /// of its grid; the GEMM and DPAS tiles run over them in turn).
    pub(super) moe_tile_m: usize,
    /// Steps of at most this many rows take the GEMV (0..=`GEMV_ROWS`), longer ones the tiled
    /// GEMM. The GEMV runs one work-item per output column, so a 2048-wide output keeps only
    /// 2048 chains in flight: right for a CPU runtime (W read once for all rows, from cache),
    /// far too few loads in flight for a GPU. Under NVIDIA's OpenCL driver on an H200 a one-row
    /// step took 89 ms with the GEMV and a 16-row step 13 ms with the GEMM, so GPUs default to
    /// the GEMM from one row (same arithmetic: the result does not change, only the speed).
    pub(super) gemv_max_m: usize,
}

impl Default for Tiles {
    fn default() -> Self {
        Tiles { gemm_t: 16, gemv_wg: 64, gemv_kc: 64, dpas_mt: 2, dpas_nt: 2, moe_tile_m: 32, gemv_max_m: GEMV_ROWS }
    }
}

impl Tiles {
    /// The defaults with `spec` (`NAME=VALUE,...`) applied; a name or value out of range is an
    /// error naming it, not a silent default.
    #[cfg(test)]
    pub(super) fn parse(spec: &str) -> Result<Self> {
        Self::parse_over(Tiles::default(), spec)
    }

    fn parse_over(mut t: Tiles, spec: &str) -> Result<Self> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((name, value)) = item.split_once('=') else { bail!("QUIVER_OPENCL_TILES: `{item}` is not NAME=VALUE") };
            let v: usize = value.trim().parse().map_err(|_| anyhow::anyhow!("QUIVER_OPENCL_TILES: {name}={value} is not a whole number"))?;
            let (slot, lo, hi) = match name.trim() {
                "GEMM_T" => (&mut t.gemm_t, 1, 32),
                "GEMV_WG" => (&mut t.gemv_wg, 1, 1024),
                "GEMV_KC" => (&mut t.gemv_kc, 1, 1024),
                // Accumulators live in registers: 8 floats a lane per (row tile, column tile).
                "DPAS_MT" => (&mut t.dpas_mt, 1, 4),
                "DPAS_NT" => (&mut t.dpas_nt, 1, 4),
                "MOE_TILE_M" => (&mut t.moe_tile_m, 1, 1024),
                "GEMV_MAX_M" => (&mut t.gemv_max_m, 0, GEMV_ROWS),
                n => bail!("QUIVER_OPENCL_TILES: unknown tile `{n}` (expected GEMM_T, GEMV_WG, GEMV_KC, GEMV_MAX_M, DPAS_MT, DPAS_NT, MOE_TILE_M)"),
            };
            if !(lo..=hi).contains(&v) {
                bail!("QUIVER_OPENCL_TILES: {name}={v} is outside {lo}..={hi}");
            }
            *slot = v;
        }
        Ok(t)
    }

    /// The tiles of this run: `QUIVER_OPENCL_TILES` over the defaults for a GPU or not.
    pub(super) fn from_env(is_gpu: bool) -> Result<Self> {
        let defaults = Tiles { gemv_max_m: if is_gpu { 0 } else { GEMV_ROWS }, ..Tiles::default() };
        Self::parse_over(defaults, &std::env::var("QUIVER_OPENCL_TILES").unwrap_or_default())
    }

    /// The `-D` defines every program of the set is compiled with.
    pub(super) fn defines(&self, set: &KernelSet) -> String {
        let mut d = format!("-DGEMM_T={} -DGEMV_WG={} -DGEMV_KC={} -DMOE_TILE_M={}", self.gemm_t, self.gemv_wg, self.gemv_kc, self.moe_tile_m);
        if let KernelSet::Dpas { .. } = set {
            d.push_str(&format!(" -DDPAS_MT={} -DDPAS_NT={}", self.dpas_mt, self.dpas_nt));
        }
        d
    }

    /// The largest work-group the GEMMs launch.
    pub(super) fn max_work_group(&self) -> usize {
        (self.gemm_t * self.gemm_t).max(self.gemv_wg)
    }

    /// Local memory the GEMM kernels use at most (gemm.cl's `xs`, `ws` arrays).
    pub(super) fn local_mem_bytes(&self) -> usize {
        let gemm = 2 * self.gemm_t * (self.gemm_t + 1);
        let gemv = GEMV_ROWS * self.gemv_kc + self.gemv_wg * (self.gemv_kc + 1);
        gemm.max(gemv) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_apply_and_bad_specs_name_the_tile() {
        assert_eq!(Tiles::parse("").unwrap(), Tiles::default());
        let t = Tiles::parse("GEMM_T=8, DPAS_NT=4, MOE_TILE_M=5").unwrap();
        assert_eq!((t.gemm_t, t.dpas_nt, t.gemv_wg, t.moe_tile_m), (8, 4, 64, 5));
        assert!(t.defines(&KernelSet::Portable).contains("-DMOE_TILE_M=5"));
        assert!(t.defines(&KernelSet::Dpas { lanes: 16, emulated: false }).contains("-DDPAS_NT=4"));
        assert!(!t.defines(&KernelSet::Portable).contains("DPAS"));
        assert_eq!(Tiles::parse("GEMV_MAX_M=0").unwrap().gemv_max_m, 0);
        assert!(Tiles::parse("GEMV_MAX_M=5").unwrap_err().to_string().contains("GEMV_MAX_M=5"));
        for (bad, says) in [("GEMM_T=0", "GEMM_T=0"), ("FOO=1", "FOO"), ("GEMV_KC", "NAME=VALUE"), ("DPAS_MT=x", "DPAS_MT=x")] {
            let e = Tiles::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
