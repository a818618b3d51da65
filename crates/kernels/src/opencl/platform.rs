//! Which OpenCL device `xpu[:N]` / `opencl[:N]` names, what it can do, and which kernel set it
//! runs: Intel's DPAS matrix kernels at the subgroup width the GPU has, or the portable kernels.

use super::kernel_set::KernelSet;
use anyhow::{bail, Result};
use opencl3::device::{Device, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU, CL_DEVICE_TYPE_GPU};
use opencl3::platform::get_platforms;
use opencl3::types::cl_device_id;

/// Intel's PCI vendor id, which Intel's OpenCL runtimes report for their GPUs.
const INTEL_VENDOR_ID: u32 = 0x8086;
/// `CL_DEVICE_SUB_GROUP_SIZES_INTEL` (cl_intel_required_subgroup_size): a `size_t` array.
const CL_DEVICE_SUB_GROUP_SIZES_INTEL: u32 = 0x4108;

/// The extensions the DPAS kernels use: the matrix builtin, subgroup block reads and shuffles,
/// and a subgroup width fixed per kernel.
pub(super) const DPAS_EXTENSIONS: [&str; 3] = ["cl_intel_subgroup_matrix_multiply_accumulate", "cl_intel_subgroups", "cl_intel_required_subgroup_size"];

/// What the device reports that the kernels depend on.
pub(super) struct Caps {
    pub(super) id: cl_device_id,
    pub(super) platform: String,
    pub(super) name: String,
    pub(super) is_gpu: bool,
    pub(super) is_cpu: bool,
    pub(super) extensions: String,
    pub(super) sub_group_sizes: Vec<usize>,
    pub(super) max_work_group: usize,
    pub(super) local_mem: u64,
    pub(super) global_mem: u64,
    pub(super) max_alloc: u64,
    /// Single-precision division and square root may be built correctly rounded.
    pub(super) correct_divide: bool,
}

impl Caps {
    pub(super) fn has(&self, ext: &str) -> bool {
        self.extensions.split_whitespace().any(|e| e == ext)
    }
}

/// Every OpenCL device, in platform order, or why there is none.
fn all_devices() -> Result<Vec<(String, Device)>> {
    let platforms = get_platforms().map_err(|e| {
        anyhow::anyhow!(
            "no OpenCL runtime ({e}): libOpenCL.so.1 could not be loaded or no platform is installed. Install the ICD loader \
             (Debian: ocl-icd-libopencl1) and a driver: for Intel GPUs Intel's compute runtime (Debian/Ubuntu: intel-opencl-icd)"
        )
    })?;
    let mut out = Vec::new();
    for p in platforms {
        let pname = p.name().unwrap_or_default();
        for id in p.get_devices(CL_DEVICE_TYPE_ALL).unwrap_or_default() {
            out.push((pname.clone(), Device::new(id)));
        }
    }
    if out.is_empty() {
        bail!("no OpenCL device: the OpenCL loader found no platform with a device (is a driver's ICD file under /etc/OpenCL/vendors, or OCL_ICD_VENDORS set?)");
    }
    Ok(out)
}

fn describe(devs: &[(String, Device)]) -> String {
    devs.iter().map(|(p, d)| format!("{} ({p})", d.name().unwrap_or_default())).collect::<Vec<_>>().join(", ")
}

/// The device `xpu:N` (the N-th Intel GPU) or `opencl:N` (the N-th device of any kind) names.
pub(super) fn select(intel_gpu: bool, index: usize) -> Result<Caps> {
    let devs = all_devices()?;
    let pick: Vec<&(String, Device)> = if intel_gpu {
        devs.iter().filter(|(_, d)| d.dev_type().is_ok_and(|t| t & CL_DEVICE_TYPE_GPU != 0) && d.vendor_id().is_ok_and(|v| v == INTEL_VENDOR_ID)).collect()
    } else {
        devs.iter().collect()
    };
    let Some((platform, d)) = pick.get(index) else {
        if intel_gpu && pick.is_empty() {
            bail!("device xpu:{index} requested but no Intel GPU is among the OpenCL devices (found: {}). Intel GPUs need Intel's compute runtime (Debian/Ubuntu: intel-opencl-icd; see the README)", describe(&devs));
        }
        let what = if intel_gpu { "Intel GPU" } else { "OpenCL device" };
        bail!("device {}:{index} requested but there are {} {what}(s): {}", if intel_gpu { "xpu" } else { "opencl" }, pick.len(), describe(&devs));
    };
    let t = d.dev_type().unwrap_or(0);
    let sub_group_sizes = d
        .get_data(CL_DEVICE_SUB_GROUP_SIZES_INTEL)
        .map(|b| b.chunks_exact(std::mem::size_of::<usize>()).map(|c| usize::from_ne_bytes(c.try_into().unwrap())).collect())
        .unwrap_or_default();
    Ok(Caps {
        id: d.id(),
        platform: platform.clone(),
        name: d.name().unwrap_or_default(),
        is_gpu: t & CL_DEVICE_TYPE_GPU != 0,
        is_cpu: t & CL_DEVICE_TYPE_CPU != 0,
        extensions: d.extensions().unwrap_or_default(),
        sub_group_sizes,
        max_work_group: d.max_work_group_size().unwrap_or(0),
        local_mem: d.local_mem_size().unwrap_or(0),
        global_mem: d.global_mem_size().unwrap_or(0),
        max_alloc: d.max_mem_alloc_size().unwrap_or(0),
        correct_divide: d.single_fp_config().is_ok_and(|c| c & opencl3::device::CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT != 0),
    })
}

/// The kernel set for this device: `QUIVER_OPENCL_KERNELS` (`portable`, `dpas16`, `dpas8`;
/// default `auto`) and `QUIVER_OPENCL_EMULATE_DPAS=1` (the software DPAS builtin, for testing the
/// DPAS kernels on a runtime without the matrix extension) decide, else the device's extensions
/// and subgroup sizes: DPAS at 16 lanes (PVC, Xe2) if it has them, at 8 (DG2), else portable.
pub(super) fn choose_kernels(caps: &Caps) -> Result<KernelSet> {
    let emulate = std::env::var_os("QUIVER_OPENCL_EMULATE_DPAS").is_some_and(|v| v != "0");
    let want = std::env::var("QUIVER_OPENCL_KERNELS").unwrap_or_else(|_| "auto".into());
    let dpas_ok = |lanes: usize| -> Result<()> {
        let needed: &[&str] = if emulate { &DPAS_EXTENSIONS[1..] } else { &DPAS_EXTENSIONS };
        let missing: Vec<&str> = needed.iter().copied().filter(|e| !caps.has(e)).collect();
        if !missing.is_empty() {
            bail!("{}: the {lanes}-lane DPAS kernels need {}{}", caps.name, missing.join(", "), if emulate { "" } else { " (QUIVER_OPENCL_EMULATE_DPAS=1 emulates the matrix builtin)" });
        }
        if !caps.sub_group_sizes.contains(&lanes) {
            bail!("{}: the {lanes}-lane DPAS kernels need subgroups of {lanes}; the device has {:?}", caps.name, caps.sub_group_sizes);
        }
        Ok(())
    };
    match want.as_str() {
        "portable" => Ok(KernelSet::Portable),
        "dpas16" | "dpas8" => {
            let lanes = if want == "dpas16" { 16 } else { 8 };
            dpas_ok(lanes)?;
            Ok(KernelSet::Dpas { lanes, emulated: emulate })
        }
        "auto" => {
            for lanes in [16, 8] {
                if dpas_ok(lanes).is_ok() && (emulate || caps.has(DPAS_EXTENSIONS[0])) {
                    return Ok(KernelSet::Dpas { lanes, emulated: emulate && !caps.has(DPAS_EXTENSIONS[0]) });
                }
            }
            Ok(KernelSet::Portable)
        }
        v => bail!("QUIVER_OPENCL_KERNELS={v:?}: expected auto, portable, dpas16 or dpas8"),
    }
}
