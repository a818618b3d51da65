#!/usr/bin/env bash
# The served engine against the forward pass on the GPU machine (issue: the serving engine at GPU
# speed), after scripts/gpu-check.sh made the models (same $QUIVER_GPU_DATA): `quiver bench
# generate` on the Llama-3.1-8B-shaped bf16 model (the ceiling: decode steps at each batch size,
# a greedy draw per row on the device, contexts 160..224 as a served 128-in / 128-out request
# decodes at 128..256), then one `quiver serve` with the GPU defaults and `quiver
# bench serve` at each concurrency, 128 tokens in, 128 out, --ignore-eos, base model. Prints
# output tok/s, the ratio to the ceiling at the same batch and to the load's ceiling (the same
# requests' prefill steps too, which the decode ceiling leaves out: at 256 × 128 prompt tokens a
# quarter of the GPU time), TTFT / TPOT / ITL percentiles.
#
#   SERVE_CONC       concurrencies (default "1 16 64 256")
#   SERVE_PROMPTS    prompts per run = max(8, this × concurrency) (default 3)
#   SERVE_ARGS       extra `quiver serve` arguments (`--disable-overlap-schedule`: the engine
#                    without overlapped scheduling, for an A/B against the default)
#   SERVE_CEILING=0  keep the ceiling an earlier run on this machine measured (A/B of SERVE_ARGS)
#   QUIVER_ENGINE_PROFILE=1  also print the server's step report after each concurrency
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
OUT=${OUT:-$PWD/gpu-out}
LOGS=$DATA/logs
mkdir -p "$OUT" "$LOGS" "$DATA/serve"
. scripts/gpu-env.sh
concs=${SERVE_CONC:-1 16 64 256}
per=${SERVE_PROMPTS:-3}
model=$DATA/models/llama8b
[ "${SERVE_CEILING:-1}" = 0 ] && [ -f "$DATA/serve/ceiling.json" ] || .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$model" --prompt-len 128 --decode-context 160 --decode-steps 64 --reps 3 \
    --batch-sizes "$(echo $concs | tr ' ' ',')" --output-json "$DATA/serve/ceiling.json" > "$LOGS/serve-ceiling.log" 2>&1 \
    || { echo "bench generate failed"; tail -n 5 "$LOGS/serve-ceiling.log"; }
port=8767
# shellcheck disable=SC2086
.gpu/bin/quiver serve --device cuda --dtype bf16 --model "$model" --port $port ${SERVE_ARGS:-} > "$LOGS/serve-engine.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
curl -sf localhost:$port/health >/dev/null || { echo "server did not come up"; tail -n 20 "$LOGS/serve-engine.log"; exit 1; }
grep -m1 "batch limits" "$LOGS/serve-engine.log"
for c in $concs; do
    n=$((c * per > 8 ? c * per : 8))
    .gpu/bin/quiver bench serve --base-url "http://127.0.0.1:$port" --model llama8b --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1 --random-vocab-size 49000 --ignore-eos --num-prompts "$n" --max-concurrency "$c" --warmup-requests "$c" \
        --no-progress --output-json "$DATA/serve/engine-c$c.json" > "$LOGS/serve-engine-c$c.log" 2>&1 \
        || { echo "bench c$c failed"; tail -n 5 "$LOGS/serve-engine-c$c.log"; }
    # With QUIVER_ENGINE_PROFILE=1 in the environment: the server's last step report after this
    # concurrency (rows a step, steps carrying prompts: what a budget setting does to the load).
    [ "${QUIVER_ENGINE_PROFILE:-0}" = 0 ] || { echo "c$c engine profile:"; grep -E "engine profile, (decode|with prefill)" "$LOGS/serve-engine.log" | tail -n 2 | cut -c1-160; }
done
python3 - "$DATA/serve" "$concs" <<'PY' | tee "$OUT/serve-engine.txt"
import json, os, sys
d, concs = sys.argv[1], sys.argv[2].split()
ceil, load = {}, {}
p = os.path.join(d, "ceiling.json")
IN = OUT = 128
if os.path.exists(p):
    j = json.load(open(p))
    for r in j.get("decode", j.get("rows", [])):
        b = r["batch"]
        ceil[str(b)] = r["tok_s"]
        # The load's own ceiling: a wave of b requests is b prompts prefilled (at the rate the
        # bench measured for b prompts in one step) plus OUT - 1 decode steps of b rows.
        if r.get("prefill_tok_s"):
            load[str(b)] = b * OUT / (b * IN / r["prefill_tok_s"] + (OUT - 1) * b / r["tok_s"])
print("ceiling: decode steps alone; load: the same load's prefill and decode steps back to back (no host time)")
print(f"{'conc':>5}{'ceiling':>10}{'load':>9}{'served':>10}{'ratio':>7}{'/load':>7}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'failed':>7}")
for c in concs:
    p = os.path.join(d, f"engine-c{c}.json")
    if not os.path.exists(p):
        print(f"{c:>5}   (missing)")
        continue
    s = json.load(open(p))
    cl, ld = ceil.get(c, float("nan")), load.get(c, float("nan"))
    t, tp, it = s["ttft_ms"], s["tpot_ms"], s["itl_ms"]
    print(f"{c:>5}{cl:>10.1f}{ld:>9.1f}{s['output_throughput']:>10.1f}{s['output_throughput'] / cl:>7.3f}{s['output_throughput'] / ld:>7.3f}{t['median']:>10.1f}{t['p99']:>8.1f}{tp['median']:>10.2f}{tp['p99']:>8.2f}{it['median']:>9.2f}{it['p99']:>8.2f}{s['failed']:>7}")
PY
