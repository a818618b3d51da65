//! The OpenCL devices a test run covers: the device `opencl:0` under each kernel set named in
//! `QUIVER_TEST_OPENCL_SETS` (default `portable,dpas16,dpas8`; a DPAS set on a runtime without
//! the matrix extension runs with the software builtin), on the platform named by
//! `QUIVER_TEST_OPENCL_PLATFORM` when set (`make test` sets both, once for Intel's CPU runtime and
//! once for PoCL, so a run can never test another runtime than the one it says). A device that
//! cannot be opened fails the test: there is no skip.

use super::{platform, KernelSet, OpenClDevice};

impl std::str::FromStr for KernelSet {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "portable" => Ok(KernelSet::Portable),
            "dpas16" => Ok(KernelSet::Dpas { lanes: 16, emulated: false }),
            "dpas8" => Ok(KernelSet::Dpas { lanes: 8, emulated: false }),
            _ => Err(format!("unknown OpenCL kernel set `{s}` (expected portable, dpas16 or dpas8)")),
        }
    }
}

/// The kernel sets under test.
pub fn kernel_sets() -> Vec<KernelSet> {
    let v = std::env::var("QUIVER_TEST_OPENCL_SETS").unwrap_or_else(|_| "portable,dpas16,dpas8".into());
    v.split(',').map(|s| s.trim().parse().unwrap_or_else(|e| panic!("QUIVER_TEST_OPENCL_SETS: {e}"))).collect()
}

/// `opencl:0` running `set` (DPAS emulated where the device lacks the builtin).
pub fn device(set: KernelSet) -> OpenClDevice {
    let hint = "the OpenCL tests run on the runtimes scripts/setup-opencl.sh installs: run `make test` (or set OCL_ICD_VENDORS=$QUIVER_CACHE/opencl/intel-cpu after scripts/setup-opencl.sh)";
    let caps = platform::select(false, 0).unwrap_or_else(|e| panic!("{e:#}\n{hint}"));
    if let Ok(want) = std::env::var("QUIVER_TEST_OPENCL_PLATFORM") {
        assert!(caps.platform.contains(&want), "opencl:0 is on platform `{}`, not the `{want}` this run tests ({hint})", caps.platform);
    }
    let set = match set {
        KernelSet::Dpas { lanes, .. } => {
            let emulated = !caps.has(platform::DPAS_EXTENSIONS[0]);
            for ext in &platform::DPAS_EXTENSIONS[1..] {
                assert!(caps.has(ext), "{}: no {ext}, which the DPAS kernels need even emulated", caps.name);
            }
            assert!(caps.sub_group_sizes.contains(&lanes), "{}: no {lanes}-lane subgroups (has {:?})", caps.name, caps.sub_group_sizes);
            KernelSet::Dpas { lanes, emulated }
        }
        s => s,
    };
    OpenClDevice::with_caps(super::DeviceKind::OpenCl(0), caps, set).unwrap_or_else(|e| panic!("opening opencl:0 with {set:?}: {e:#}"))
}
