//! Steady-state steps allocate nothing: building batch info and running every backend through
//! the hook, repeatedly, after a warm-up. The only test in this binary, so no other test
//! thread allocates while counting.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use quiver_kernels::{DeviceKind, Tensor};
use quiver_lora::{LinearSite, LoraConfig, LoraHook, LoraManager, LoraModule};

struct Counting;
static COUNT: AtomicUsize = AtomicUsize::new(0);
static ON: AtomicBool = AtomicBool::new(false);

unsafe impl GlobalAlloc for Counting {
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

#[global_allocator]
static A: Counting = Counting;

#[test]
fn steady_state_steps_do_not_allocate() {
    for backend in ["reference", "segmented", "chunked", "auto"] {
        let cfg = LoraConfig { max_loras_per_batch: 3, max_lora_rank: 8, target_modules: LoraModule::ALL.to_vec(), backend: backend.into(), ..Default::default() };
        let mut m = LoraManager::new(DIMS, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
        let a = m.load_adapter("a", simple_adapter("za", 1, 8, &LoraModule::ALL)).unwrap();
        let b = m.load_adapter("b", simple_adapter("zb", 2, 3, &LoraModule::ALL)).unwrap();
        // A prefill and a decode batch, alternating, on one thread; then a big prefill on the
        // global pool, where the backends fan out with rayon.
        let prefill = (vec![Some(a), None, Some(b)], vec![0u32, 100, 150, 250], vec![99u32, 149, 249]);
        let big = (vec![Some(a), None, Some(b)], vec![0u32, 150, 200, 330], vec![149u32, 199, 329]);
        let decode_seqs: Vec<_> = (0..24).map(|i| [Some(a), Some(b), None][i % 3]).collect();
        let decode = (decode_seqs, (0..=24u32).collect::<Vec<_>>(), (0..24u32).collect::<Vec<_>>());
        let maxw = DIMS.intermediate * 2 + DIMS.vocab;
        let x = Tensor::cpu(vec![0.1; 400 * maxw]);
        let mut y = Tensor::zeros_cpu(400 * maxw);
        let ids: Vec<u32> = (0..400u32).map(|i| i % DIMS.vocab as u32).collect();
        let mut step = |m: &mut LoraManager, (seqs, starts, logits): &(Vec<Option<quiver_lora::AdapterKey>>, Vec<u32>, Vec<u32>)| {
            let hook = m.prepare_batch(seqs, starts, logits).unwrap();
            let rows = *starts.last().unwrap() as usize;
            hook.embedding(&quiver_kernels::cpu::CpuDevice::new(), &ids[..rows], &mut y);
            for l in 0..DIMS.num_layers {
                for s in LinearSite::ALL {
                    hook.linear(&quiver_kernels::cpu::CpuDevice::new(), l, s, &x, rows, &mut y);
                }
            }
            hook.lm_head(&quiver_kernels::cpu::CpuDevice::new(), &x, logits, &mut y);
        };
        // Serial path (one worker thread, as on a 1-core machine): not a single allocation.
        let serial = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        serial.install(|| {
            for _ in 0..3 {
                step(&mut m, &prefill);
                step(&mut m, &decode);
            }
            COUNT.store(0, Ordering::SeqCst);
            ON.store(true, Ordering::SeqCst);
            for _ in 0..10 {
                step(&mut m, &prefill);
                step(&mut m, &decode);
            }
            ON.store(false, Ordering::SeqCst);
        });
        assert_eq!(COUNT.load(Ordering::SeqCst), 0, "backend {backend} allocated in steady state");
        // Rayon path: our code allocates nothing, but rayon's global injector queue allocates
        // one block per 63 injected jobs (crossbeam-deque), so allow that amortized trickle.
        for _ in 0..3 {
            step(&mut m, &big);
        }
        COUNT.store(0, Ordering::SeqCst);
        ON.store(true, Ordering::SeqCst);
        for _ in 0..10 {
            step(&mut m, &big);
        }
        ON.store(false, Ordering::SeqCst);
        let n = COUNT.load(Ordering::SeqCst);
        eprintln!("{backend}: {n} allocations in 10 parallel-sized steps");
        assert!(n <= 5, "backend {backend}: {n} allocations in 10 parallel-sized steps");
    }
}
