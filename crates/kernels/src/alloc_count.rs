//! A counting global allocator for the tests that prove a hot path allocates nothing: a test
//! binary installs it with `#[global_allocator] static A: CountingAlloc = CountingAlloc;` and
//! counts the allocations made inside `count_allocations`. One test per binary, so no other
//! test thread allocates while counting.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct CountingAlloc;

static COUNT: AtomicUsize = AtomicUsize::new(0);
static ON: AtomicBool = AtomicBool::new(false);

// SAFETY: forwards to the system allocator; the counters are atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(p, l, n) }
    }
}

/// Allocations (and reallocations) made while `f` runs, when `CountingAlloc` is the global
/// allocator.
pub fn count_allocations(f: impl FnOnce()) -> usize {
    COUNT.store(0, Ordering::SeqCst);
    ON.store(true, Ordering::SeqCst);
    f();
    ON.store(false, Ordering::SeqCst);
    COUNT.load(Ordering::SeqCst)
}
