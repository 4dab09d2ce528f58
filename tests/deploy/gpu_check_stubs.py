#!/usr/bin/python3
"""Stand-ins for the GPU machine's tools, for tests/deploy/gpu_check_test.py.

One program under many names (the test links each name to this file): nvidia-smi, nvcc, cmake,
c++, ninja, ctest, compute-sanitizer, and the binaries the fake cmake "builds" (backend_test,
forward_bench, ...). Each call appends one line to $FAKE_TRACE: its name, its arguments, and the
environment variables the script is meant to set for it. Nothing is compiled and nothing needs
a GPU.

Controlled by the environment:
  FAKE_TRACE   the trace file
  FAKE_FAIL    a comma list of what fails: build (the second build phase, after the targets the
               later steps need were made), tests, memcheck, racecheck, synccheck, bench-fp32,
               bench-tf32, bench-gemm-attention, bench-graphs
  FAKE_SLEEP   what sleeps how long before it answers, "build:30,bench-fp32:60"
  FAKE_GPU     0: nvidia-smi lists no GPU (the default: an NVIDIA H200, compute capability 9.0)
  FAKE_SANITIZER_REFUSES  1: compute-sanitizer refuses to run (its own error line, no test run)

`gpu_check_stubs.py --write-torch DIR` writes a fake `torch` package into DIR instead: shapes
only, no arithmetic, enough for bench/peers/torch_attention.py to run through; each
scaled_dot_product_attention call records the TF32 switches it ran under (in $FAKE_TRACE).
"""
import json
import os
import sys
import time

NAME = os.path.basename(sys.argv[0])
ARGS = sys.argv[1:]
# Every unit test binary of the core-only tree, as CTest names it when it is missing.
UNIT_BINARIES = ["core_test", "backend_test", "attention_test", "cpu_kernels_test", "memory_footprint_test",
                 "cuda_emulated_test", "spectrum_test", "plugin_abi_test"]
# What `cmake --build` makes for the later steps: the unit tests and the benchmark.
BUILT = {name: f"tests/{name}" for name in UNIT_BINARIES}
BUILT["forward_bench"] = "bench/forward_bench"
BUILT["attnserve_cuda_plugin"] = "server/backend/cuda/libattnserve_cuda_plugin.so"


def trace(*extra):
    with open(os.environ["FAKE_TRACE"], "a") as f:
        f.write(" ".join([NAME, *ARGS, *extra]) + "\n")


def fails(what):
    return what in os.environ.get("FAKE_FAIL", "").split(",")


def sleep_for(what):
    for item in filter(None, os.environ.get("FAKE_SLEEP", "").split(",")):
        key, secs = item.split(":")
        if key == what:
            time.sleep(float(secs))


def arg(flag, default=None):
    return ARGS[ARGS.index(flag) + 1] if flag in ARGS else default


def nvidia_smi():
    if os.environ.get("FAKE_GPU", "1") == "0":
        if "-L" in ARGS:
            print("No devices were found")
            return 6
        return 6
    if "-L" in ARGS:
        print("GPU 0: NVIDIA H200 (UUID: GPU-00000000-1111-2222-3333-444444444444)")
    elif "--query-gpu=compute_cap" in ARGS:
        print("9.0")
    elif any(a.startswith("--query-gpu=") for a in ARGS):
        print("name, driver_version, memory.total [MiB], compute_cap")
        print("NVIDIA H200, 570.124.06, 143771 MiB, 9.0")
    else:
        print("NVIDIA-SMI 570.124.06    Driver Version: 570.124.06    CUDA Version: 12.8")
    return 0


def make(build_dir, target):
    path = os.path.join(build_dir, BUILT[target])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        os.symlink(os.path.abspath(__file__), path) if target != "attnserve_cuda_plugin" else open(path, "w").close()


def cmake():
    if "--version" in ARGS:
        print("cmake version 3.28.3")
        return 0
    if "--build" in ARGS:
        build_dir = arg("--build")
        targets = ARGS[ARGS.index("--target") + 1:] if "--target" in ARGS else ["all"]
        trace()
        print(f"[1/43] Building CXX object ... ({' '.join(targets)})", flush=True)
        if targets == ["all"]:
            sleep_for("build")
            if fails("build"):
                print("FAILED: tests/CMakeFiles/core_test.dir/unit/core_test.cc.o\n"
                      "tests/unit/core_test.cc:1:1: error: a fake compile error")
                return 1
            targets = list(BUILT)
        for target in targets:
            make(build_dir, target)
        return 0
    build_dir = arg("-B")
    trace()
    os.makedirs(build_dir, exist_ok=True)
    open(os.path.join(build_dir, "CMakeCache.txt"), "w").close()
    open(os.path.join(build_dir, "CTestTestfile.cmake"), "w").close()
    print("-- Configuring done\n-- Generating done")
    return 0


def ctest():
    if "--version" in ARGS:
        print("ctest version 3.28.3")
        return 0
    build_dir = arg("--test-dir")
    if "-N" in ARGS:
        for name in UNIT_BINARIES:
            if not os.path.exists(os.path.join(build_dir, "tests", name)):
                print(f"  Test  #1: {name}_NOT_BUILT")
        return 0
    trace(f"ATTNSERVE_REQUIRE_BACKENDS={os.environ.get('ATTNSERVE_REQUIRE_BACKENDS', '')}")
    sleep_for("tests")
    if fails("tests"):
        print("75/76 Test #12: Backends/BackendTest.RandomizedFormsMatchFloat64Reference/cuda ...***Failed")
        print("\n99% tests passed, 1 tests failed out of 76\n\nThe following tests FAILED:\n"
              "\t 12 - Backends/BackendTest.RandomizedFormsMatchFloat64Reference/cuda (Failed)")
        return 8
    print("worst relative L2 error 3.1e-07 (cuda)")
    print("\n100% tests passed, 0 tests failed out of 76")
    return 0


def compute_sanitizer():
    if "--version" in ARGS:
        print("NVIDIA (R) Compute Sanitizer 2025.1.0")
        return 0
    tool = arg("--tool")
    trace(f"ATTNSERVE_RANDOM_CASES={os.environ.get('ATTNSERVE_RANDOM_CASES', '')}")
    sleep_for(tool)
    if os.environ.get("FAKE_SANITIZER_REFUSES") == "1":
        # As on a host where it cannot attach: its own error, the application never started.
        print("========= Internal Sanitizer Error: Device not supported. Please refer to the "
              "\"Supported Devices\" section of the sanitizer documentation")
        return 1
    print("[  PASSED  ] 31 tests.")
    if fails(tool):
        print("========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error")
        return int(arg("--error-exitcode", "1"))
    print("========= ERROR SUMMARY: 0 errors" if tool != "racecheck" else
          "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    return 0


def forward_bench():
    trace()
    math = arg("--gpu-math", "fp32")
    step = "bench-tf32" if "--tf32" in ARGS else "bench-bf16" if math == "bf16" else \
        "bench-gemm-attention" if "--gemm-attention" in ARGS else "bench-graphs" if "--gpu-graphs" in ARGS \
        else "bench-fp32"
    sleep_for(step)
    device = arg("--device", "cpu")
    ceiling = ("cublas-tf32 8192x8192x8192" if "--tf32" in ARGS else "cublas 8192x8192x8192") \
        if device.startswith("cuda") else "eigen 2048x2048x2048"
    if math in ("bf16", "fp16"):
        ceiling += f", forwards in {math}"  # as forward_bench names a 16-bit run's source
    records = []
    for i, shape in enumerate(arg("--shapes").split(",")):
        for form, ms in (("factored", 0.5 + i), ("summed", 1.5 + i)):
            gflops, ceiling_gflops = 1000.0 / ms, 50000.0
            records.append({"shape": shape, "form": form, "device": device, "threads": 1, "ms": ms,
                            "gflops": gflops, "ceiling_gflops": ceiling_gflops,
                            "ratio_to_ceiling": gflops / ceiling_gflops, "ceiling_source": ceiling,
                            "isa": "avx512", "gemm": "cublas"})
            print(f"{shape:38s} {form:9s} {'cublas':20s} {1:7d} {ms:9.3f} {gflops:9.1f} {ceiling_gflops:9.1f}")
    if fails(step):
        print("forward_bench: CUDA error: an illegal memory access was encountered", file=sys.stderr)
        return 1
    with open(arg("--json"), "w") as f:
        json.dump(records, f)
    return 0


def plain(text, code=0):
    def run():
        if "--version" not in ARGS:
            trace()
        print(text)
        return code
    return run


FAKE_TORCH = {
    "torch/__init__.py": '''
import atexit, os, types
__version__ = "2.7.0+fake"
_seen = set()
float32, bfloat16 = "float32", "bfloat16"


class device:
    def __init__(self, spec):
        self.type = spec.split(":")[0]


class Tensor:
    def __init__(self, shape, dtype="float32"):
        self.shape = tuple(shape)
        self.dtype = dtype

    def __truediv__(self, other):
        return self

    __mul__ = __truediv__

    def to(self, *args, dtype=None, **kwargs):
        dtype = dtype or next((a for a in args if a in (float32, bfloat16)), None)
        return Tensor(self.shape, dtype or self.dtype)

    def float(self):
        return Tensor(self.shape, float32)

    def pin_memory(self):
        return self

    def cpu(self):
        return self

    def view(self, *shape):
        return Tensor(shape, self.dtype)

    reshape = view

    def transpose(self, a, b):
        s = list(self.shape)
        s[a], s[b] = s[b], s[a]
        return Tensor(s, self.dtype)


class Generator:
    def manual_seed(self, seed):
        return self


def randn(*shape, generator=None):
    return Tensor(shape)


def set_num_threads(n):
    pass


class inference_mode:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


cuda = types.SimpleNamespace(is_available=lambda: os.environ.get("FAKE_TORCH_CUDA", "1") == "1",
                             synchronize=lambda: None)
backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=True)),
                                 cudnn=types.SimpleNamespace(allow_tf32=True))


@atexit.register
def _record():
    with open(os.environ["FAKE_TRACE"], "a") as f:
        for matmul, cudnn, dtype in sorted(_seen):
            f.write(f"torch sdpa ran with matmul.allow_tf32={matmul} cudnn.allow_tf32={cudnn} in {dtype}\\n")
''',
    "torch/nn/__init__.py": "",
    "torch/nn/functional.py": '''
import torch


def linear(x, w, b):
    if len({x.dtype, w.dtype, b.dtype}) != 1:
        raise RuntimeError(f"linear: mixed dtypes {x.dtype}, {w.dtype}, {b.dtype}")
    return torch.Tensor(x.shape[:-1] + (w.shape[0],), x.dtype)


def scaled_dot_product_attention(q, k, v):
    torch._seen.add((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, q.dtype))
    return torch.Tensor(q.shape[:-1] + (v.shape[-1],), q.dtype)
''',
}


def write_torch(root):
    for rel, text in FAKE_TORCH.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text.lstrip())


TOOLS = {
    "nvidia-smi": nvidia_smi,
    "nvcc": plain("nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.8, V12.8.93"),
    "cmake": cmake,
    "c++": plain("c++ (Debian 12.2.0-14) 12.2.0"),
    "ninja": plain("1.11.1"),
    "ctest": ctest,
    "compute-sanitizer": compute_sanitizer,
    "forward_bench": forward_bench,
}

if __name__ == "__main__":
    if ARGS[:1] == ["--write-torch"]:
        write_torch(ARGS[1])
        sys.exit(0)
    tool = TOOLS.get(NAME, plain(f"[==========] {NAME}: fake test binary\n[  PASSED  ] 1 test."))
    sys.exit(tool())
