#!/usr/bin/env python3
"""The fused attention kernels keep their state in registers: for every architecture the build
targets, ptxas reports no stack frame and no spills for each kernel of the files named.

    kernel_resources_test.py --nvcc NVCC --arch 80 [--arch 90 ...] --include DIR FILE.cu [...]

Why a test: a register array indexed at run time (or a kernel grown past the register file)
moves to local memory, which is device DRAM behind the L1. Nothing fails and the answers are
the same; the kernel just slows down, and only a GPU run would show it. ptxas says so at build
time on any machine with nvcc, so this checks it there. The other kernels (kernels.cu) are not
held to it: RopeKernel's float64 sincos keeps libdevice's argument reduction on the stack, on
a path that runs once per value.
"""
import argparse
import re
import subprocess
import sys
import tempfile

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def kernel_resources(nvcc, arch, includes, source):
    """[(kernel, sm, stack bytes, spill store bytes, spill load bytes, registers)] from ptxas -v."""
    with tempfile.NamedTemporaryFile(suffix=".o") as obj:
        cmd = [nvcc, "-O3", "-DNDEBUG", "-std=c++17", f"--generate-code=arch=compute_{arch},code=sm_{arch}",
               "-Xptxas", "-v", "-x", "cu", "-c", source, "-o", obj.name]
        cmd[1:1] = [f"-I{d}" for d in includes]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"kernel_resources: nvcc failed on {source} for sm_{arch}:\n{run.stderr}")
    found, current = [], None
    for line in run.stderr.splitlines():  # ptxas -v reports on stderr
        if m := ENTRY.search(line):
            current = [m.group(1), m.group(2)]
        elif current and (m := FRAME.search(line)):
            current += [int(m.group(1)), int(m.group(2)), int(m.group(3))]
        elif current and len(current) == 5 and (m := REGISTERS.search(line)):
            found.append(tuple(current + [int(m.group(1))]))
            current = None
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", required=True)
    ap.add_argument("--arch", action="append", required=True, help="a CUDA architecture, e.g. 90")
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("sources", nargs="+")
    args = ap.parse_args()
    failures = []
    for source in args.sources:
        for arch in args.arch:
            kernels = kernel_resources(args.nvcc, arch, args.include, source)
            if not kernels:
                failures.append(f"{source}, sm_{arch}: ptxas reported no kernel (its output changed?)")
            for name, sm, stack, stores, loads, registers in kernels:
                print(f"{sm} {registers:4d} registers, {stack} B stack, {stores}/{loads} B spilled: {name}")
                if stack or stores or loads:
                    failures.append(f"{source}, {sm}: {name} uses local memory: a {stack}-byte stack frame, "
                                    f"{stores} bytes of spill stores and {loads} of spill loads (expected 0)")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
