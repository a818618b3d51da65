#!/usr/bin/env bash
# The SmolLM2 serving sweep of BENCHMARKS.md: eight random rank-16 adapters on all 7 projections
# (a0..a7), one `quiver serve` with all of them registered, then
# `quiver bench sweep` over bench/scenarios/smollm2.toml (base vs 1/4/8 distinct adapters).
# Extra arguments go to the sweep (e.g. `--only decode`). Needs `make build` and the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${QUIVER_CACHE:-$PWD/.cache}
OUT=${SWEEP_OUT:-bench/results/smollm2}
ADIR=$CACHE/bench-adapters
"$CACHE/venv/bin/python" - "$ADIR" <<'PY'
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "server"))
from test_openai_api import make_random_adapter
root = sys.argv[1]
targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
for i in range(8):
    d = os.path.join(root, f"a{i}")
    if not os.path.exists(os.path.join(d, "adapter_config.json")):
        make_random_adapter(d, seed=500 + i, rank=16, targets=targets, scale=0.1)
PY
PORT=${PORT:-8000}
specs=(); for i in 0 1 2 3 4 5 6 7; do specs+=("a$i=$ADIR/a$i"); done
target/release/quiver serve --port "$PORT" --max-loras 8 --max-lora-rank 16 --lora-modules "${specs[@]}" > "$CACHE/bench-serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
target/release/quiver bench sweep --scenarios bench/scenarios/smollm2.toml --out-dir "$OUT" --base-url "http://127.0.0.1:$PORT" "$@"
