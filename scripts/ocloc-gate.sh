#!/usr/bin/env bash
# The DPAS codegen gate: compiles every kernel of dpas.cl with Intel's offline GPU compiler
# (`ocloc`, Debian intel-opencl-icd, installed by scripts/setup-opencl.sh) for PVC (16-lane
# subgroups) and DG2 (dg2-g10, 8 lanes), disassembles the binaries, and fails unless each kernel
# contains `dpas` instructions and no unresolved call (`calla`). Spills are reported.
# No Intel GPU is needed: this checks that the real builtin lowers to XMX instructions.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
src=$here/crates/kernels/src/opencl
# ocloc disasm loads libiga64.so, which Debian ships as libiga64.so.1 (setup-opencl.sh links it).
export LD_LIBRARY_PATH=$cache/opencl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
command -v ocloc >/dev/null || { echo "ocloc-gate: ocloc not found (run scripts/setup-opencl.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
kernels=$(sed -n 's/^void \([a-z0-9_]*\)(.*/\1/p' "$src/dpas.cl") # kernels start a line with void; helpers are inline
[ -n "$kernels" ] || { echo "ocloc-gate: no kernels found in dpas.cl" >&2; exit 1; }
status=0
for target in 16:pvc 8:dg2-g10; do
    sg=${target%%:*} device=${target##*:}
    dir=$work/$device
    mkdir -p "$dir"
    # The same text the device builds: the kernel set's prelude, common.cl, dpas.cl; CL2.0
    # because this IGC's CL3.0 header does not build.
    { printf '#define QUIVER_DPAS 1\n#define SG %s\n#define DPAS_EMULATE 0\n' "$sg"; cat "$src/common.cl" "$src/dpas.cl"; } > "$dir/dpas.cl"
    if ! ocloc compile -file "$dir/dpas.cl" -device "$device" -options "-cl-std=CL2.0 -DDPAS_MT=2 -DDPAS_NT=2" -output dpas -out_dir "$dir" > "$dir/build.log" 2>&1; then
        echo "[FAILED] $device: ocloc compile"; cat "$dir/build.log"; status=1; continue
    fi
    bin=$(ls "$dir"/dpas*.bin | head -n1)
    ocloc disasm -file "$bin" -device "$device" -dump "$dir/asm" > "$dir/disasm.log" 2>&1 || { echo "[FAILED] $device: ocloc disasm"; cat "$dir/disasm.log"; status=1; continue; }
    for k in $kernels; do
        asm=$dir/asm/${k}_KernelHeap.asm
        if [ ! -f "$asm" ]; then echo "[FAILED] $device $k: no disassembly"; status=1; continue; fi
        n=$(grep -c 'dpas\.' "$asm" || true)
        calls=$(grep -c 'calla' "$asm" || true)
        # IGC warns "kernel NAME compiled SIMDn allocated N regs and spilled around X".
        spills=$(sed -n "s/.*kernel $k .*spilled around \([0-9]*\).*/\1/p" "$dir/build.log" | head -n1)
        if [ "$n" -gt 0 ] && [ "$calls" -eq 0 ]; then r=ok; else r=FAILED; status=1; fi
        echo "[$r] $device ($sg lanes) $k: $n dpas instructions, $calls unresolved calls, spills: ${spills:-none}"
    done
done
exit $status
