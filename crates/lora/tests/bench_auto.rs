//! Microbenchmark behind `auto`'s choice (run: `cargo test --release -p quiver-lora --test
//! bench_auto -- --ignored --nocapture`). Llama-1B-like qkv/down sites, rank 16, 4 adapters.

use std::time::Instant;

use quiver_lora::backend::{create_backend, LoraInput, Scratch};
use quiver_lora::batch::LoraBatchInfo;
use quiver_lora::mem_pool::LoraMemoryPool;
use quiver_lora::{EvictionPolicy, LinearSite, LoraModelDims, LoraModule};

#[test]
#[ignore]
fn bench_segmented_vs_chunked() {
    let dims = LoraModelDims { num_layers: 1, hidden: 2048, q_out: 2048, kv_out: 512, intermediate: 8192, vocab: 32000 };
    let pool = LoraMemoryPool::new(dims, 4, 16, &LoraModule::PROJECTIONS, EvictionPolicy::Lru).unwrap();
    // Ranks and scalings are normally set by loading; fake a full pool through the public view.
    let shapes: [(&str, usize, usize); 4] = [("decode 32 rows, 4 adapters interleaved", 32, 1), ("decode 64 rows, 4 adapters", 64, 1), ("prefill 4 seqs x 16", 4, 16), ("prefill 4 seqs x 128", 4, 128)];
    for site in [LinearSite::Qkv, LinearSite::Down] {
        let mut v = pool.site_view(0, site).unwrap();
        let ranks = [16u32; 4];
        let scal = [1.0f32; 12];
        v.ranks = &ranks;
        v.scalings = &scal;
        for (what, nseq, len) in shapes {
            let mut info = LoraBatchInfo::with_capacity(4, 1024, 16);
            let seqs: Vec<Option<u32>> = (0..nseq).map(|i| Some((i % 4) as u32)).collect();
            let starts: Vec<u32> = (0..=nseq as u32).map(|i| i * len as u32).collect();
            info.build(&seqs, &starts, &[], |_| 16).unwrap();
            let m = nseq * len;
            let x = vec![0.01f32; m * v.in_dim];
            let mut y = vec![0.0f32; m * v.out_dim];
            for b in ["segmented", "chunked", "auto"] {
                let be = create_backend(b, quiver_kernels::DeviceKind::Cpu).unwrap();
                let mut sc = Scratch::default();
                be.apply(&v, &info.tokens, LoraInput::Dense(&x), &mut y, &mut sc);
                let iters = 20;
                let t = Instant::now();
                for _ in 0..iters {
                    be.apply(&v, &info.tokens, LoraInput::Dense(&x), &mut y, &mut sc);
                }
                eprintln!("{site:?} {what}: {b:>9} {:8.1} us", t.elapsed().as_secs_f64() * 1e6 / iters as f64);
            }
        }
    }
}
