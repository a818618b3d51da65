//! The logit edits op on the CPU device against the engine's old host path (the shared check is
//! in `device_kernels::logit_edits`; `opencl_kernels.rs` and `cuda_kernels.rs` run it on theirs).

mod device_kernels;

#[test]
fn logit_edits_match_the_host_path() {
    device_kernels::logit_edits::logit_edits_match_the_host_path(&quiver_kernels::cpu::CpuDevice::new());
}
