# Sourced by the GPU scripts (after `cd` to the repository): $DATA (QUIVER_GPU_DATA, default
# /tmp/quiver-gpu) and $LOGS under it (the device tool returns at most 8 files, so full logs stay
# there), the CUDA libraries on the path (gpu-env.sh), and `step NAME COMMAND...`: runs the
# command with its output in $LOGS/NAME.log, prints `[ok|FAILED] NAME (s)` and a failure's last
# lines, and sets `status=1` on a failure.
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
LOGS=$DATA/logs
mkdir -p "$LOGS"
export QUIVER_GPU_DATA=$DATA PYTHONUNBUFFERED=1
. scripts/gpu-env.sh
status=0
step() { # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$LOGS/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
    echo "[$r] $name ($((SECONDS - t0)) s)"
    [ $r = ok ] || tail -n 30 "$LOGS/$name.log"
}
