//! Kernel launches on the device's stream: programmatic stream serialization (PDL) and thread
//! block clusters as launch attributes, and the touch counter every launch, copy and GEMM bumps
//! (what the bf16 input shadow and the LoRA shrink computed ahead check that nothing ran since).

use super::*;

impl CudaDevice {
    /// Launches `f` on the device's stream. With `pdl` the launch allows programmatic stream
    /// serialization: the kernel may be scheduled while its predecessor drains (hiding launch
    /// latency and the predecessor's tail, which matter in a decode step of ~330 small kernels).
    /// That is safe because every kernel of the module starts with `pdl_entry()`, which waits for
    /// the predecessor's completion before touching memory a kernel writes.
    ///
    /// # Safety
    /// `params` must match `f`'s C signature, every pointer a live device buffer of this context.
    /// `cluster` > 1: blocks in clusters of that many along x (sm_90; the kernel's grid is a
    /// multiple of it).
    pub(super) unsafe fn launch_raw(&self, f: sys::CUfunction, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, cluster: u32, params: &mut [*mut c_void]) -> Result<(), result::DriverError> {
        self.touch();
        let stream = self.current_stream();
        if !self.pdl && cluster <= 1 {
            return result::launch_kernel(f, grid, block, smem, stream, params);
        }
        // SAFETY: a zeroed attribute is valid; we set its id and the matching union field.
        let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
        let mut n = 0;
        if self.pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 1 {
            debug_assert!(grid.0.is_multiple_of(cluster));
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()).result()
    }

    pub(super) fn touch(&self) {
        self.touches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.copy.drained.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}
