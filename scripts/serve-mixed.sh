#!/usr/bin/env bash
# The mixed-load check of the serving-engine issue: one `quiver serve`, requests of spread-out
# lengths (uniform prompt 5–100% of MIXED_IN tokens, output 5–100% of MIXED_OUT: a ShareGPT-like
# spread without the dataset, which the GPU machine cannot download), first alone (the unloaded
# TPOT), then all at once up to MIXED_CONC in flight (the peak request rate), then Poisson
# arrivals at fractions of that peak. Prints output tok/s and p50 / p99 TPOT per run and p99
# TPOT over the unloaded one; the target is ≤ 1.5× up to 80% of peak.
#
#   QUIVER        binary (default .gpu/bin/quiver, else target/release/quiver)
#   MIXED_MODEL   model path (default $QUIVER_GPU_DATA/models/llama8b)
#   MIXED_DEVICE  --device (default cuda), MIXED_DTYPE --dtype (default bf16)
#   MIXED_IN / MIXED_OUT (default 1024 / 512), MIXED_CONC (default 256)
#   MIXED_FRACTIONS (default "0.2 0.4 0.6 0.8 1.0"), MIXED_SECONDS per Poisson run (default 60)
#   MIXED_VOCAB   random token ids below this (default 49000)
#   MIXED_ARGS    extra `quiver serve` arguments (an A/B of scheduler limits)
#   MIXED_PEAK    req/s to take as the peak instead of measuring it (an A/B of MIXED_ARGS at the
#                 same arrival rates as a run before it)
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
OUT=${OUT:-$PWD/gpu-out}
dir=$DATA/serve-mixed
mkdir -p "$OUT" "$dir"
[ -f scripts/gpu-env.sh ] && . scripts/gpu-env.sh
q=${QUIVER:-$( [ -x .gpu/bin/quiver ] && echo .gpu/bin/quiver || echo target/release/quiver )}
model=${MIXED_MODEL:-$DATA/models/llama8b}
in=${MIXED_IN:-1024}; out=${MIXED_OUT:-512}; conc=${MIXED_CONC:-256}; secs=${MIXED_SECONDS:-60}
port=8768
"$q" serve --device "${MIXED_DEVICE:-cuda}" --dtype "${MIXED_DTYPE:-bf16}" --model "$model" --served-model-name mixed --port $port ${MIXED_ARGS:-} > "$dir/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
curl -sf localhost:$port/health >/dev/null || { echo "server did not come up"; tail -n 20 "$dir/serve.log"; exit 1; }
bench() { # tag, extra args...
    local tag=$1; shift
    rm -f "$dir/$tag.json"
    "$q" bench serve --base-url "http://127.0.0.1:$port" --model mixed --random-input-len "$in" --random-output-len "$out" \
        --random-range-ratio 0.05 --random-vocab-size "${MIXED_VOCAB:-49000}" --ignore-eos --seed 7 --no-progress \
        --output-json "$dir/$tag.json" "$@" > "$dir/$tag.log" 2>&1 || { echo "bench $tag failed"; tail -n 5 "$dir/$tag.log"; }
}
bench unloaded --num-prompts 8 --max-concurrency 1 --warmup-requests 1
if [ -n "${MIXED_PEAK:-}" ]; then
    peak=$MIXED_PEAK
    python3 -c "import json;json.dump({'request_throughput': $peak, 'output_throughput': float('nan'), 'given': True}, open('$dir/peak.json', 'w'))"
else
    bench peak --num-prompts $((conc * 2)) --max-concurrency "$conc" --warmup-requests "$conc"
    peak=$(python3 -c "import json;print(json.load(open('$dir/peak.json'))['request_throughput'])" 2>/dev/null || echo 0)
fi
python3 -c "import sys; sys.exit(0 if $peak > 0 else 1)" || { echo "the peak run completed nothing"; tail -n 5 "$dir/peak.log"; exit 1; }
for f in ${MIXED_FRACTIONS:-0.2 0.4 0.6 0.8 1.0}; do
    rate=$(python3 -c "print(max(0.01, $peak * $f))")
    n=$(python3 -c "print(max(16, int($peak * $f * $secs)))")
    bench "rate-$f" --num-prompts "$n" --request-rate "$rate" --max-concurrency "$conc"
done
python3 - "$dir" "${MIXED_FRACTIONS:-0.2 0.4 0.6 0.8 1.0}" <<'PY' | tee "$OUT/serve-mixed.txt"
import json, os, sys
d, fracs = sys.argv[1], sys.argv[2].split()
load = lambda t: json.load(open(os.path.join(d, t + ".json"))) if os.path.exists(os.path.join(d, t + ".json")) else None
base, peak = load("unloaded"), load("peak")
if not base or not peak:
    sys.exit("missing the unloaded or the peak run")
t0 = base["tpot_ms"]["median"]
print(f"unloaded TPOT p50 {t0:.2f} ms; peak {peak['request_throughput']:.2f} req/s" + (" (given)" if peak.get("given") else f", {peak['output_throughput']:.1f} out tok/s"))
print(f"{'load':>6}{'req/s':>8}{'out tok/s':>11}{'TPOT p50':>10}{'p99':>8}{'p99/unloaded':>14}{'TTFT p99':>10}{'failed':>7}")
for f in fracs:
    s = load("rate-" + f)
    if not s:
        print(f"{f:>6}   (missing)")
        continue
    print(f"{float(f):>6.0%}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}{s['tpot_ms']['median']:>10.2f}{s['tpot_ms']['p99']:>8.2f}{s['tpot_ms']['p99'] / t0:>14.2f}{s['ttft_ms']['p99']:>10.1f}{s['failed']:>7}")
PY
