//! Device buffers: an OpenCL buffer object and its size, released on drop.
//!
//! OpenCL keeps a released buffer alive until the commands queued on it have finished, so a
//! scratch buffer may be replaced (grown) while kernels that read the old one are still queued.

use opencl3::context::Context;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
use opencl3::types::cl_mem;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A buffer in an OpenCL device's memory.
pub struct ClBuf {
    pub(super) buf: Buffer<u8>,
    pub(super) bytes: usize,
    /// The device's running total of allocated bytes (its `memory_info`).
    allocated: Arc<AtomicUsize>,
}

// SAFETY: an OpenCL memory object is a handle the runtime synchronizes (OpenCL API calls are
// thread-safe except clSetKernelArg on one kernel, which the device serializes).
unsafe impl Send for ClBuf {}
unsafe impl Sync for ClBuf {}

impl ClBuf {
    /// An uninitialized buffer of `bytes` (at least 4: OpenCL refuses empty buffers).
    pub(super) fn new(ctx: &Context, bytes: usize, allocated: &Arc<AtomicUsize>) -> anyhow::Result<ClBuf> {
        let size = bytes.max(4).next_multiple_of(4);
        // SAFETY: a plain allocation without a host pointer.
        let buf = unsafe { Buffer::<u8>::create(ctx, CL_MEM_READ_WRITE, size, std::ptr::null_mut()) }
            .map_err(|e| anyhow::anyhow!("allocating {bytes} bytes of OpenCL device memory: {e}"))?;
        allocated.fetch_add(size, Ordering::Relaxed);
        Ok(ClBuf { buf, bytes, allocated: allocated.clone() })
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub(super) fn mem(&self) -> cl_mem {
        self.buf.get()
    }
}

impl Drop for ClBuf {
    fn drop(&mut self) {
        self.allocated.fetch_sub(self.bytes.max(4).next_multiple_of(4), Ordering::Relaxed);
    }
}
