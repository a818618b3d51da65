#!/usr/bin/env python3
"""What LoRA's expand would cost inside the base GEMM (GPU machine, PyTorch's cuBLAS).

The design this measures before it is built (issue 19, `docs/lora-in-the-gemm.md`): every LoRA-able weight keeps its pool
slots' scaled B as S·r extra input columns ([W | B_1 .. B_S], row stride K + S·r), and a step's
GEMM input carries each row's shrink t = x·Aᵀ in its slot's r columns of the same tail (zeros in
the others), so one GEMM over K + S·r columns adds every row's delta: no expand launch, no
epilogue, no f32 pass over the output per slice. Today's separate expands move ~22.5 GB of f32
output in a 2048-row 8B prefill step (the 0.88 prefill ratio) and cost ~20-70 µs a layer of
latency in decode steps. This prints, for the Llama-3.1-8B sites, the time of the GEMM over
K + tail against over K, reading the operands in place with the tail's row stride (as the
design would), for tails of 1, 4, 16 and 64 rank-16 slots.

    python3 scripts/lora_ktail_probe.py [rows,...]     (default 1,16,64,256,2048)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import timed  # median ms of a callable, CUDA events  # noqa: E402

SITES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TAILS = [16, 64, 256, 1024]


def main():
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 64, 256, 2048]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: GEMM time over K + tail against over K (bf16, median of 30, µs)")
    print(f"{'site':>8}{'rows':>6}{'K µs':>9}" + "".join(f"{'+' + str(t):>14}" for t in TAILS))
    for site, (k, n) in SITES.items():
        ld = k + max(TAILS)
        w = torch.randn(n, ld, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, ld, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            # Views with the full row stride: cuBLAS reads them in place (lda = ld).
            base = 1e3 * timed(lambda: torch.mm(x[:, :k], w[:, :k].t(), out=y), 30)
            cells = []
            for t in TAILS:
                us = 1e3 * timed(lambda: torch.mm(x[:, : k + t], w[:, : k + t].t(), out=y), 30)
                cells.append(f"{us:>8.1f} {us / base:>4.2f}x")
            print(f"{site:>8}{m:>6}{base:>9.1f}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
