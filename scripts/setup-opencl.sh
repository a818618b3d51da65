#!/usr/bin/env bash
# The OpenCL runtimes the OpenCL tests run on, installed on a fresh machine; idempotent.
# - Debian: the ICD loader (libOpenCL.so.1, which opencl3 loads at run time), PoCL (portable
#   kernels only: OpenCL C 1.2, no subgroups) and Intel's GPU compiler package, whose offline
#   compiler `ocloc` is the DPAS codegen gate (scripts/ocloc-gate.sh).
# - PyPI: Intel's CPU OpenCL runtime (subgroups, bf16 conversions), into the project cache
#   ($QUIVER_CACHE/intel-opencl; proprietary licence, so never committed).
# Writes one ICD folder per runtime, $QUIVER_CACHE/opencl/{intel-cpu,pocl}/, each naming one
# library: a test run sets OCL_ICD_VENDORS to one of them, so it sees exactly that runtime
# (the Intel runtime finds its own libraries through its RUNPATH).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
debs="ocl-icd-libopencl1 pocl-opencl-icd intel-opencl-icd"
missing=
for p in $debs; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; done
if [ -n "$missing" ]; then
    # As root, or through sudo where there is one; otherwise say what to install.
    if [ "$(id -u)" = 0 ]; then as_root=; elif command -v sudo >/dev/null; then as_root="sudo -n"; else
        echo "setup-opencl: missing Debian packages:$missing (install them as root)" >&2; exit 1
    fi
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
rt=$cache/intel-opencl
pins="intel-opencl-rt==2026.2.0 intel-cmplr-lib-rt==2026.2.0 tbb==2023.2.0"
if [ ! -f "$rt/.quiver-pins" ] || [ "$(cat "$rt/.quiver-pins")" != "$pins" ]; then
    # A venv of its own: the wheels place their libraries relative to the environment's prefix.
    rm -rf "$rt"
    python3 -m venv "$rt"
    "$rt/bin/pip" install -q --no-deps $pins
    echo "$pins" > "$rt/.quiver-pins"
fi
lib=$(find "$rt" -name 'libintelocl.so' -printf '%h\n' | head -n1)
[ -n "$lib" ] || { echo "setup-opencl: libintelocl.so not found under $rt" >&2; exit 1; }
mkdir -p "$cache/opencl/intel-cpu" "$cache/opencl/pocl" "$cache/opencl/lib"
echo "$lib/libintelocl.so" > "$cache/opencl/intel-cpu/intel-cpu.icd"
pocl=$(find /usr/lib -name 'libpocl.so.2*' | sort | head -n1)
[ -n "$pocl" ] || { echo "setup-opencl: PoCL's libpocl.so.2 not found" >&2; exit 1; }
echo "$pocl" > "$cache/opencl/pocl/pocl.icd"
# ocloc disassembles through libiga64.so, which Debian ships only as libiga64.so.1.
iga=$(find /usr/lib -name 'libiga64.so.1' | head -n1)
[ -n "$iga" ] || { echo "setup-opencl: libiga64.so.1 (intel-opencl-icd) not found" >&2; exit 1; }
ln -sf "$iga" "$cache/opencl/lib/libiga64.so"
