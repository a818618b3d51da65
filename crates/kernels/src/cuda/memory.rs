//! Device and page-locked host allocations, freed on drop.

use anyhow::{Context, Result};
use cudarc::driver::{result, sys, CudaContext};
use std::ffi::c_void;
use std::sync::Arc;

/// Bumped by every device allocation: a recorded graph bakes in buffer addresses, so any
/// allocation (a grown workspace, a new KV store) retires every recording.
pub(super) static ALLOC_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A plain device allocation (cuMemAlloc), freed on drop.
pub struct DevBuf {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    pub(super) ctx: Arc<CudaContext>,
}

impl DevBuf {
    pub(super) fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf> {
        ctx.bind_to_thread()?;
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0, ctx: ctx.clone() });
        }
        let ptr = unsafe { result::malloc_sync(bytes) }.with_context(|| format!("cuMemAlloc of {bytes} bytes"))?;
        ALLOC_GENERATION.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }?;
        // cuMemsetD8 on device memory returns before it has run, on the legacy stream, which
        // does not order our non-blocking streams: without this a copy queued next on them (an
        // upload into the fresh buffer) could land before the zeros do and be wiped.
        result::ctx::synchronize()?;
        Ok(DevBuf { ptr, bytes, ctx: ctx.clone() })
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes > 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context and freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (cuMemHostAlloc), the host end of the copy stream's transfers: a
/// copy from or to it runs on the DMA engine without the host staging it, so queuing one never
/// blocks the host.
pub(super) struct PinnedBuf {
    pub(super) ptr: *mut u8,
    pub(super) bytes: usize,
    pub(super) ctx: Arc<CudaContext>,
}

impl PinnedBuf {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBuf> {
        ctx.bind_to_thread()?;
        if bytes == 0 {
            return Ok(PinnedBuf { ptr: std::ptr::null_mut(), bytes: 0, ctx: ctx.clone() });
        }
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.with_context(|| format!("cuMemHostAlloc of {bytes} bytes"))? as *mut u8;
        Ok(PinnedBuf { ptr, bytes, ctx: ctx.clone() })
    }
    /// The first `len` elements of type `T` (`len · size_of::<T>() ≤ bytes`).
    pub(super) fn slice_mut<T: Copy>(&mut self, len: usize) -> &mut [T] {
        assert!(len * std::mem::size_of::<T>() <= self.bytes, "pinned buffer too small");
        if len == 0 {
            return &mut [];
        }
        // SAFETY: in bounds (asserted), page-aligned memory we own; any bit pattern is a valid u32/f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.bytes > 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in this context; no copy uses it any more (the
            // owner waits for its copies before replacing or dropping it).
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}
