//! Microbenchmark behind `auto`'s choice on CPU (run: `cargo test --release -p quiver-lora --test
//! bench_auto -- --ignored --nocapture`). Llama-1B-like qkv/down sites, rank 16, 4 adapters.

use std::time::Instant;

use quiver_kernels::cpu::CpuDevice;
use quiver_kernels::lora::MAX_SLICES;
use quiver_kernels::{LoraTable, LoraX, Tensor};
use quiver_lora::backend::create_backend;
use quiver_lora::batch::LoraBatchInfo;
use quiver_lora::mem_pool::LoraMemoryPool;
use quiver_lora::{EvictionPolicy, LinearSite, LoraModelDims, LoraModule, SiteRef};

#[test]
#[ignore]
fn bench_segmented_vs_chunked() {
    let dims = LoraModelDims { num_layers: 1, hidden: 2048, q_out: 2048, kv_out: 512, intermediate: 8192, vocab: 32000, moe: None };
    let dev = std::sync::Arc::new(CpuDevice::new());
    let pool = LoraMemoryPool::new(dev.clone(), dims, 4, 16, &LoraModule::PROJECTIONS, EvictionPolicy::Lru).unwrap();
    // Ranks and scalings are normally set by loading; a table of our own marks all 4 slots full.
    let mut table = LoraTable::host(1, 4);
    table.ranks.fill(16);
    table.scalings = vec![1.0; 4 * MAX_SLICES];
    let shapes: [(&str, usize, usize); 4] = [("decode 32 rows, 4 adapters interleaved", 32, 1), ("decode 64 rows, 4 adapters", 64, 1), ("prefill 4 seqs x 16", 4, 16), ("prefill 4 seqs x 128", 4, 128)];
    for site in [LinearSite::Qkv, LinearSite::Down] {
        let (buffers, _) = pool.site(0, site).unwrap();
        let v = SiteRef { buffers, table: &table, entry: 0 };
        for (what, nseq, len) in shapes {
            let mut info = LoraBatchInfo::with_capacity(4, 1024, 16, 0);
            let seqs: Vec<Option<u32>> = (0..nseq).map(|i| Some((i % 4) as u32)).collect();
            let starts: Vec<u32> = (0..=nseq as u32).map(|i| i * len as u32).collect();
            info.build(&seqs, &starts, &[], |_| 16).unwrap();
            let m = nseq * len;
            let x = Tensor::cpu(vec![0.01f32; m * buffers.shape.in_dim]);
            let mut y = Tensor::zeros_cpu(m * buffers.shape.out_dim());
            for b in ["segmented", "chunked", "auto"] {
                let be = create_backend(b, quiver_kernels::DeviceKind::Cpu).unwrap();
                be.apply(&*dev, v, &info.tokens, LoraX::Dense(&x), &mut y);
                let iters = 20;
                let t = Instant::now();
                for _ in 0..iters {
                    be.apply(&*dev, v, &info.tokens, LoraX::Dense(&x), &mut y);
                }
                eprintln!("{site:?} {what}: {b:>9} {:8.1} us", t.elapsed().as_secs_f64() * 1e6 / iters as f64);
            }
        }
    }
}
