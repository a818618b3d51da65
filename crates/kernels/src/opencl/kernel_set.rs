//! The kernel sets a device may run, chosen once at start-up (`platform::choose_kernels`).

/// Which matrix kernels a device runs; the small ops and attention are portable in every set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSet {
    /// OpenCL C 1.2 without extensions: any OpenCL device (PoCL, NVIDIA, Intel).
    Portable,
    /// Intel's `cl_intel_subgroup_matrix_multiply_accumulate` (DPAS on the XMX units) for the
    /// weight GEMMs and the LoRA shrink / expand, at `lanes` work-items per subgroup (16: PVC and
    /// Xe2; 8: DG2 / Arc A-series / Flex). `emulated`: the matrix builtin in software, following
    /// the extension specification's reference semantics (tests on runtimes without DPAS).
    Dpas { lanes: usize, emulated: bool },
}

impl KernelSet {
    /// Defines prepended to every program of the set.
    pub(super) fn prelude(&self) -> String {
        match *self {
            KernelSet::Portable => String::new(),
            KernelSet::Dpas { lanes, emulated } => {
                format!("#define QUIVER_DPAS 1\n#define SG {lanes}\n#define DPAS_EMULATE {}\n", emulated as u8)
            }
        }
    }
    pub fn describe(&self) -> String {
        match *self {
            KernelSet::Portable => "portable kernels (OpenCL C 1.2)".into(),
            KernelSet::Dpas { lanes, emulated: false } => format!("DPAS kernels, {lanes}-lane subgroups"),
            KernelSet::Dpas { lanes, emulated: true } => format!("DPAS kernels, {lanes}-lane subgroups, matrix builtin emulated in software"),
        }
    }
}
