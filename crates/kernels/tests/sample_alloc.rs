//! Drawing a step's tokens allocates nothing once warm: the CPU device's sampling op over a
//! batch of filtered, seeded draws with logprobs, repeated. The only test in this binary, so no
//! other test thread allocates while counting.

use quiver_kernels::alloc_count::{count_allocations, CountingAlloc};
use quiver_kernels::sample::{SampleOut, SampleSpec};
use quiver_kernels::{open_device, DeviceKind};

#[global_allocator]
static A: CountingAlloc = CountingAlloc;

#[test]
fn steady_state_sampling_does_not_allocate() {
    let d = open_device(DeviceKind::Cpu).unwrap();
    let (rows, vocab) = (48usize, 5000usize);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 7919) % 1013) as f32 / 97.0)
        .collect();
    let t = d.tensor_from(&logits);
    let mut specs: Vec<SampleSpec> = (0..rows as u32)
        .map(|row| SampleSpec {
            row,
            top_k: [0, 40][row as usize % 2],
            inv_temperature: [0.0, 1.25][(row as usize / 2) % 2],
            top_p: 0.9,
            min_p: 0.01,
            logprobs: (row % 4) as i32 - 1,
            seed: row as u64,
            counter: 0,
        })
        .collect();
    let mut out = vec![SampleOut::default(); rows];
    for c in 0..10 {
        specs.iter_mut().for_each(|s| s.counter = c);
        d.sample(&t, vocab, &specs, &mut out);
    }
    let n = count_allocations(|| {
        for c in 10..20 {
            specs.iter_mut().for_each(|s| s.counter = c);
            d.sample(&t, vocab, &specs, &mut out);
        }
    });
    assert_eq!(n, 0, "allocations in 10 warm sampling steps");
    assert!(out.iter().all(|o| (o.token as usize) < vocab));
}
