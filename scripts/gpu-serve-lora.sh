#!/usr/bin/env bash
# The GPU serving sweep of the LoRA issue, on the GPU machine after scripts/gpu-check.sh made the
# models and adapters (same $QUIVER_GPU_DATA): one `quiver serve` of the Llama-3.1-8B-shaped bf16
# model with N adapter names (rank 16, all 7 projections; the few adapter files are served under
# several names each, which gives as many distinct slots), then `quiver bench serve` at each
# concurrency for the base model and for requests spread over 1 and N distinct adapters, 128
# tokens in, 128 out, --ignore-eos. Prints output tok/s, median TPOT and p99 TTFT per run and the
# ratio of each adapter run to base at the same concurrency (measured seconds apart, one server).
#
#   SERVE_ADAPTERS   adapter counts besides 1 (default "4 16 64": issue 19's sweep)
#   SERVE_CONC       concurrencies (default "1 16 64 256": issue 19's sweep; ~4 min on an H100)
#   SERVE_PROMPTS    prompts per run = max(8, this × concurrency) (default 2)
#   SERVE_PROFILE=1  the server prints where its engine thread's time goes (QUIVER_ENGINE_PROFILE);
#                    each run's lines follow a marker in the server log, and are printed at the end
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
OUT=${OUT:-$PWD/gpu-out}
LOGS=$DATA/logs
mkdir -p "$OUT" "$LOGS" "$DATA/serve"
. scripts/gpu-env.sh
counts=${SERVE_ADAPTERS:-4 16 64}
concs=${SERVE_CONC:-1 16 64 256}
per=${SERVE_PROMPTS:-2}
max_ads=1; for n in $counts; do [ "$n" -gt "$max_ads" ] && max_ads=$n; done
max_conc=1; for c in $concs; do [ "$c" -gt "$max_conc" ] && max_conc=$c; done
files=("$DATA"/adapters/lora8b-r16-*)
specs=(); for i in $(seq 0 $((max_ads - 1))); do specs+=("a$i=${files[$((i % ${#files[@]}))]}"); done
port=8766
[ "${SERVE_PROFILE:-0}" = 1 ] && export QUIVER_ENGINE_PROFILE=1
: > "$LOGS/serve-lora.log"
.gpu/bin/quiver serve --device cuda --dtype bf16 --model "$DATA/models/llama8b" --port $port --max-loras "$max_ads" \
    --max-lora-rank 16 --max-running-requests "$max_conc" --max-num-batched-tokens $((max_conc * 128 > 2048 ? max_conc * 128 : 2048)) \
    --lora-modules "${specs[@]}" >> "$LOGS/serve-lora.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
curl -sf localhost:$port/health >/dev/null || { echo "server did not come up"; tail -n 20 "$LOGS/serve-lora.log"; exit 1; }
run() { # tag conc lora-names...
    local tag=$1 conc=$2; shift 2
    local n=$((conc * per > 8 ? conc * per : 8))
    local lora=(); [ $# -gt 0 ] && lora=(--lora-names "$@" --lora-distribution distinct)
    echo "=== run $tag c$conc" >> "$LOGS/serve-lora.log"
    .gpu/bin/quiver bench serve --base-url "http://127.0.0.1:$port" --model llama8b --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1 --random-vocab-size 49000 --ignore-eos --num-prompts "$n" --max-concurrency "$conc" --warmup-requests "$conc" \
        --no-progress "${lora[@]}" --output-json "$DATA/serve/$tag-c$conc.json" > "$LOGS/serve-$tag-c$conc.log" 2>&1 \
        || { echo "bench $tag c$conc failed"; tail -n 5 "$LOGS/serve-$tag-c$conc.log"; }
}
for c in $concs; do
    run base "$c"
    run lora1 "$c" a0
    for n in $counts; do
        names=(); for i in $(seq 0 $((n - 1))); do names+=("a$i"); done
        run "lora$n" "$c" "${names[@]}"
    done
done
python3 - "$DATA/serve" "$concs" "$counts" <<'PY' | tee "$OUT/serve-lora.txt"
import json, os, sys
d, concs, counts = sys.argv[1], sys.argv[2].split(), ["1"] + sys.argv[3].split()
def load(tag, c):
    p = os.path.join(d, f"{tag}-c{c}.json")
    return json.load(open(p)) if os.path.exists(p) else None
print(f"{'run':<10}{'conc':>6}{'out tok/s':>12}{'vs base':>9}{'TPOT p50 ms':>13}{'TTFT p99 ms':>13}{'failed':>8}")
for c in concs:
    b = load("base", c)
    for tag in ["base"] + [f"lora{n}" for n in counts]:
        s = load(tag, c)
        if not s:
            print(f"{tag:<10}{c:>6}   (missing)")
            continue
        ratio = s["output_throughput"] / b["output_throughput"] if b else float("nan")
        print(f"{tag:<10}{c:>6}{s['output_throughput']:>12.1f}{ratio:>9.3f}{s['tpot_ms']['median']:>13.2f}{s['ttft_ms']['p99']:>13.1f}{s['failed']:>8}")
PY
if [ "${SERVE_PROFILE:-0}" = 1 ]; then
    echo "engine profile per run (server log, ms per step):"
    grep -E "^=== run|engine profile" "$LOGS/serve-lora.log" | sed -E 's/quiver: engine profile, //' | tee -a "$OUT/serve-lora.txt"
fi
