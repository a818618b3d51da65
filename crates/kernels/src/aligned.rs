//! A fixed-length heap buffer whose start is 64-byte (cache-line) aligned.
//!
//! Weights live in these: the CPU GEMM's vector loads then never straddle two cache lines
//! (rows of every Llama-family width stay aligned too), so it streams W as stored. With the
//! allocator's 16-byte alignment it had to copy each task's block of W to aligned scratch
//! first, which measured as a third of a 16-row decode step.

use std::alloc::{alloc, alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

pub const ALIGN: usize = 64;

pub struct AlignedVec<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    /// What the allocator returned (`ptr` rounded down), for `dealloc`.
    raw: *mut u8,
}

// SAFETY: AlignedVec owns its elements like a Vec does.
unsafe impl<T: Copy + Send> Send for AlignedVec<T> {}
unsafe impl<T: Copy + Sync> Sync for AlignedVec<T> {}

impl<T: Copy> AlignedVec<T> {
    /// `len` elements and room to round the start up to `ALIGN`, at the allocator's own
    /// alignment: asked for 64-byte alignment, the system allocator zeroes with a memset of the
    /// whole block, where `calloc` hands out fresh pages that the kernel zeroes on first touch.
    /// That made a KV pool of several GiB resident (and cost its page clearing) at start-up.
    fn layout(len: usize) -> Layout {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).and_then(|b| b.checked_add(ALIGN)).expect("AlignedVec: size overflow");
        Layout::from_size_align(bytes, std::mem::align_of::<T>().max(16)).expect("AlignedVec: size overflow")
    }

    fn empty() -> Self {
        AlignedVec { ptr: NonNull::dangling(), len: 0, raw: std::ptr::null_mut() }
    }

    /// # Safety
    /// `raw` came from the allocator with `layout(len)`.
    unsafe fn from_raw(raw: *mut u8, len: usize) -> Self {
        let layout = Self::layout(len);
        if raw.is_null() {
            handle_alloc_error(layout);
        }
        let ptr = raw.wrapping_add(raw.align_offset(ALIGN)) as *mut T;
        // SAFETY: rounding up by less than ALIGN stays inside the block, which holds len more.
        AlignedVec { ptr: unsafe { NonNull::new_unchecked(ptr) }, len, raw }
    }

    /// A copy of `src` in aligned memory.
    pub fn from_slice(src: &[T]) -> Self {
        let len = src.len();
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return AlignedVec { len, ..Self::empty() };
        }
        // SAFETY: the layout has a nonzero size; the copy fills all `len` elements before use.
        unsafe {
            let v = Self::from_raw(alloc(Self::layout(len)), len);
            std::ptr::copy_nonoverlapping(src.as_ptr(), v.ptr.as_ptr(), len);
            v
        }
    }

    /// `len` zeros in aligned memory (fresh pages from the allocator, no copy, no memset).
    pub fn zeroed(len: usize) -> Self
    where
        T: bytemuck::Zeroable,
    {
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return AlignedVec { len, ..Self::empty() };
        }
        // SAFETY: the layout has a nonzero size; all-zero bytes are a valid T (Zeroable).
        unsafe { Self::from_raw(alloc_zeroed(Self::layout(len)), len) }
    }
}

impl<T: Copy> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr holds len initialized elements (or is dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Drop for AlignedVec<T> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: allocated in from_raw's callers with this very layout.
            unsafe { dealloc(self.raw, Self::layout(self.len)) }
        }
    }
}

impl<T: Copy> Clone for AlignedVec<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter().take(8)).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_is_aligned_and_zero() {
        let v = AlignedVec::<u16>::zeroed(1000);
        assert_eq!(v.as_ptr() as usize % ALIGN, 0);
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|&x| x == 0));
        assert!(AlignedVec::<f32>::zeroed(0).is_empty());
    }

    #[test]
    fn aligned_copy_of_the_data() {
        for len in [0usize, 1, 15, 1000] {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let mut v = AlignedVec::from_slice(&src);
            assert_eq!(&v[..], &src[..]);
            if len > 0 {
                assert_eq!(v.as_ptr() as usize % ALIGN, 0);
                v[len - 1] = -1.0;
                assert_eq!(v.clone()[len - 1], -1.0);
            }
        }
        let b = AlignedVec::from_slice(&[half::bf16::ONE; 33]);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
    }

    /// Resident memory of this process, from /proc (Linux).
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
    }

    /// A large zeroed buffer (a KV pool) costs address space, not memory, until it is written.
    #[cfg(target_os = "linux")]
    #[test]
    fn zeroed_pages_stay_untouched() {
        let before = resident_bytes();
        let v = AlignedVec::<f32>::zeroed(512 << 20);
        let grew = resident_bytes().saturating_sub(before);
        assert_eq!(v[(512 << 20) - 1], 0.0);
        assert!(grew < 256 << 20, "2 GiB of zeroed buffer made {grew} bytes resident");
    }
}
