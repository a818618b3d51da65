//! Sampling on the GPU against the host reference (`quiver_kernels::sample`) on the same
//! logits: greedy identical, seeded top-k / top-p / min-p draws identical in ≥ 99.9% of draws
//! (the only freedom left is `exp` rounding in the last place), logprobs within 1e-5, ranks and
//! top alternatives identical. Needs a GPU: ignored by default, run by `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]

use quiver_kernels::cuda::CudaDevice;
use quiver_kernels::sample::{sample_rows_host, SampleOut, SampleSpec};
use quiver_kernels::Device;
use rand::{rngs::StdRng, Rng as _, SeedableRng};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_draws_match_the_host_reference() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("sampling: seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let gpu = CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}"));
    let (mut draws, mut differ, mut greedy_draws) = (0usize, 0usize, 0usize);
    let mut worst_lp = 0f32;
    // Vocabularies: tiny, not a multiple of the block, SmolLM2's, Qwen's.
    for &vocab in &[7usize, 1000, 4099, 49152, 151_936] {
        let rows = 64;
        // Logits like a model's: a few strong candidates over a broad floor, ties included
        // (bf16 logits tie often), some rows partly masked.
        let mut logits = vec![0f32; rows * vocab];
        for r in 0..rows {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            let spread = [0.5f32, 2.0, 6.0][r % 3];
            for x in row.iter_mut() {
                *x = rng.random_range(-1.0f32..1.0) * spread;
                if r % 4 == 1 {
                    *x = (*x * 8.0).round() / 8.0;
                }
            }
            for _ in 0..4 {
                let i = rng.random_range(0..vocab);
                row[i] += rng.random_range(2.0f32..8.0);
            }
            if r % 5 == 2 {
                for x in row.iter_mut().step_by(3) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let t = gpu.tensor_from(&logits);
        let reps = if vocab > 100_000 { 20 } else { 40 };
        for rep in 0..reps {
            let specs: Vec<SampleSpec> = (0..rows as u32)
                .map(|row| {
                    let kind = (row as usize + rep) % 6;
                    SampleSpec {
                        row,
                        top_k: if kind == 1 || kind == 4 { rng.random_range(1..60) } else { 0 },
                        inv_temperature: if kind == 0 { 0.0 } else { 1.0 / rng.random_range(0.3f32..1.5) },
                        top_p: if kind == 2 || kind == 4 { rng.random_range(0.5f32..0.99) } else { 1.0 },
                        min_p: if kind == 3 || kind == 4 { rng.random_range(0.0f32..0.2) } else { 0.0 },
                        logprobs: if row % 3 == 0 { (row % 21) as i32 } else { -1 },
                        seed: rng.random(),
                        counter: rep as u64,
                    }
                })
                .collect();
            let mut got = vec![SampleOut::default(); rows];
            let mut want = vec![SampleOut::default(); rows];
            gpu.sample(&t, vocab, &specs, &mut got);
            sample_rows_host(&logits, vocab, &specs, &mut want, &mut Vec::new());
            for (i, s) in specs.iter().enumerate() {
                let (g, w) = (&got[i], &want[i]);
                draws += 1;
                if s.inv_temperature == 0.0 {
                    greedy_draws += 1;
                    assert_eq!(g.token, w.token, "vocab {vocab}: greedy row {i} differs");
                }
                if g.token != w.token {
                    differ += 1;
                    continue;
                }
                if s.logprobs >= 0 {
                    assert_eq!((g.rank, g.n_top), (w.rank, w.n_top), "vocab {vocab} row {i}: rank / alternatives");
                    assert_eq!(&g.top_ids[..g.n_top as usize], &w.top_ids[..w.n_top as usize], "vocab {vocab} row {i}: top ids");
                    let mut d = (g.logprob - w.logprob).abs();
                    for k in 0..g.n_top as usize {
                        d = d.max((g.top_logprobs[k] - w.top_logprobs[k]).abs());
                    }
                    worst_lp = worst_lp.max(d);
                }
            }
        }
    }
    eprintln!("sampling: {draws} draws ({greedy_draws} greedy), {differ} differ from the host, worst logprob difference {worst_lp:.2e}");
    assert!(draws >= 10_000);
    assert!(differ * 1000 <= draws, "{differ} of {draws} draws differ (more than 0.1%)");
    assert!(worst_lp <= 1e-5, "logprobs differ by {worst_lp}");
}
