#!/usr/bin/env python3
"""Compiles Quiver's CUDA module the way the CUDA device does at start-up, without a GPU.

  nvrtc_gate.py LIBNVRTC [PTXAS]

The module is the .cu files of crates/kernels/src/cuda in the order of `KERNELS_SRC`'s
`concat!` (module.rs), compiled by NVRTC with the device's options for sm_90. Fails when NVRTC
rejects it (printing its log) or when a kernel the Rust side loads by name (`f("name")` in
cuda/*.rs) is not an entry of the PTX: either would fail every CUDA start. With PTXAS, the PTX is
assembled for sm_90 too, and kernels that spill registers are listed (a report, not a failure).
"""
import ctypes
import pathlib
import os
import re
import subprocess
import sys
import tempfile

CUDA = pathlib.Path(__file__).resolve().parent.parent / "crates/kernels/src/cuda"
ARCH = "sm_90"


def module_source():
    rs = (CUDA / "module.rs").read_text()
    line = next(l for l in rs.splitlines() if "KERNELS_SRC" in l and "concat!" in l)
    files = re.findall(r'include_str!\("([^"]+)"\)', line)
    return files, "".join((CUDA / f).read_text() for f in files)


def compile_ptx(lib, src):
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"quiver.cu", 0, None, None) != 0:
        sys.exit("nvrtc_gate: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={ARCH}".encode(), b"--std=c++17"]
    # The tuning constants an A/B sets on the device (module.rs `nvrtc_defines`), to see their
    # registers and spills here first.
    opts += [f"-D{w}".encode() for w in os.environ.get("QUIVER_CUDA_NVRTC_DEFINES", "").split()]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        print(log.value.decode(errors="replace"))
        sys.exit(f"nvrtc_gate: NVRTC failed to compile Quiver's CUDA module for {ARCH} (error {rc}): every CUDA start would fail")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    files, src = module_source()
    ptx = compile_ptx(sys.argv[1], src)
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
    loaded = set()
    for rs in CUDA.glob("*.rs"):
        loaded |= set(re.findall(r'\bf\("(\w+)"\)', rs.read_text()))
    if not loaded:
        sys.exit("nvrtc_gate: found no kernel loaded by name (`f(\"name\")` in cuda/*.rs): the loaders changed, update this gate")
    missing = sorted(loaded - entries)
    if missing:
        sys.exit(f"nvrtc_gate: kernels loaded by name but not in the module: {', '.join(missing)}")
    print(f"nvrtc_gate: {len(files)} files, {len(entries)} kernels compiled for {ARCH}, all {len(loaded)} loaded by name present")
    if len(sys.argv) > 2:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as out:
            out.write(ptx)
            out.flush()
            r = subprocess.run([sys.argv[2], f"-arch={ARCH}", "-v", out.name, "-o", "/dev/null"], capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr)
            sys.exit("nvrtc_gate: ptxas rejected the PTX")
        kernel = None
        for l in r.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", l)
            if m:
                kernel = m.group(1)
            m = re.search(r"Used (\d+) registers", l)
            if m and kernel and os.environ.get("NVRTC_GATE_REGS") and re.search(os.environ["NVRTC_GATE_REGS"], kernel):
                print(f"nvrtc_gate: {kernel}: {m.group(1)} registers")
            m = re.search(r"(\d+) bytes spill stores", l)
            if m and int(m.group(1)) > 0:
                print(f"nvrtc_gate: {kernel} spills ({l.strip()})")


if __name__ == "__main__":
    main()
