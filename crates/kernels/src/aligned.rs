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
}

// SAFETY: AlignedVec owns its elements like a Vec does.
unsafe impl<T: Copy + Send> Send for AlignedVec<T> {}
unsafe impl<T: Copy + Sync> Sync for AlignedVec<T> {}

impl<T: Copy> AlignedVec<T> {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len * std::mem::size_of::<T>(), ALIGN.max(std::mem::align_of::<T>())).expect("AlignedVec: size overflow")
    }

    /// A copy of `src` in aligned memory.
    pub fn from_slice(src: &[T]) -> Self {
        let len = src.len();
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return AlignedVec { ptr: NonNull::dangling(), len };
        }
        let layout = Self::layout(len);
        // SAFETY: layout has a nonzero size; the copy fills all `len` elements before use.
        unsafe {
            let p = alloc(layout) as *mut T;
            let Some(ptr) = NonNull::new(p) else { handle_alloc_error(layout) };
            std::ptr::copy_nonoverlapping(src.as_ptr(), ptr.as_ptr(), len);
            AlignedVec { ptr, len }
        }
    }

    /// `len` zeros in aligned memory (fresh pages from the allocator, no copy).
    pub fn zeroed(len: usize) -> Self
    where
        T: bytemuck::Zeroable,
    {
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return AlignedVec { ptr: NonNull::dangling(), len };
        }
        let layout = Self::layout(len);
        // SAFETY: layout has a nonzero size; all-zero bytes are a valid T (Zeroable).
        unsafe {
            let Some(ptr) = NonNull::new(alloc_zeroed(layout) as *mut T) else { handle_alloc_error(layout) };
            AlignedVec { ptr, len }
        }
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
        if self.len != 0 && std::mem::size_of::<T>() != 0 {
            // SAFETY: allocated in from_slice with this very layout.
            unsafe { dealloc(self.ptr.as_ptr() as *mut u8, Self::layout(self.len)) }
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
}
