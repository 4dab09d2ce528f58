#!/usr/bin/python3
"""scripts/gpu-check.sh's own logic, with no GPU and no compiler (label "deploy" in CTest).

The script is the one command the bare GPU machine runs, with one try in its 10 minutes: what it
does when a step fails, runs out of time or finds a tool missing has to be right before it gets
there. Each test copies the script (and bench/peers' torch_attention.py and compare.py) into a
fresh folder and runs it with a PATH of stand-ins (tests/deploy/gpu_check_stubs.py): nvidia-smi
listing an NVIDIA H200 of compute capability 9.0 (or none), nvcc, cmake that "builds" stub
binaries, ctest, compute-sanitizer, forward_bench writing plausible JSON, and a python whose
`torch` is a shapes-only fake (or that has none) under the real torch_attention.py and
compare.py. Each stand-in writes what it was called with to a trace; the tests read the trace,
the summary file and the JSON the run left under $OUT.

    /usr/bin/python3 tests/deploy/gpu_check_test.py [-k name]
"""
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import unittest

SRC = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
STUBS = os.path.join(SRC, "tests", "deploy", "gpu_check_stubs.py")
# What the script and the stand-ins need from the real machine; nothing else is on the PATH.
REAL = ["bash", "cat", "chmod", "cp", "date", "dirname", "du", "env", "grep", "gzip", "head", "ls", "mkdir", "mv",
        "nproc", "rm", "sed", "sleep", "tail", "tar", "tee", "timeout", "touch", "tr"]
FAKES = ["nvidia-smi", "nvcc", "cmake", "c++", "ninja", "ctest", "compute-sanitizer"]
STEPS = ["configure", "build", "tests", "memcheck", "racecheck", "synccheck", "bench-fp32", "bench-tf32",
         "bench-bf16", "bench-gemm-attention", "bench-graphs",
         "torch-fp32", "torch-tf32", "torch-bf16", "table-fp32", "table-tf32", "table-bf16"]
STEP_LINE = re.compile(r"^== \[(\d+)s\] ([a-z0-9-]+): (passed|FAILED|cut|not run|skipped)")


def read(path):
    with open(path) as f:
        return f.read()


class Run:
    def __init__(self, proc, out, trace_path, elapsed):
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.out = out
        self.elapsed = elapsed
        self.summary = read(os.path.join(out, "summary.txt")).splitlines()
        self.trace = read(trace_path).splitlines() if os.path.exists(trace_path) else []
        # The steps' last lines, in order: [(step, verdict)].
        self.verdicts = [(m[2], m[3]) for m in map(STEP_LINE.match, self.summary) if m and m[2] != "done"]

    def verdict(self, step):
        found = [v for s, v in self.verdicts if s == step]
        return found[-1] if found else None

    def calls(self, name):
        return [line for line in self.trace if line.split(" ", 1)[0] == name]

    def json(self, name):
        with open(os.path.join(self.out, name)) as f:
            return json.load(f)

    def line(self, pattern):
        found = [s for s in self.summary if re.search(pattern, s)]
        return found[0] if found else None

    def __str__(self):
        return "\n".join(["summary:", *self.summary, "trace:", *self.trace, f"stdout:\n{self.stdout}"])


class Sandbox:
    """A copy of the script and its Python peers, with a PATH of stand-ins."""

    def __init__(self, test, missing=(), python="torch"):
        self.test = test
        self.tmp = tempfile.mkdtemp(prefix="gpu-check-test-")
        test.addCleanup(shutil.rmtree, self.tmp, True)
        self.repo = os.path.join(self.tmp, "repo")
        for rel in ("scripts/gpu-check.sh", "bench/peers/torch_attention.py", "bench/peers/compare.py"):
            os.makedirs(os.path.join(self.repo, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(os.path.join(SRC, rel), os.path.join(self.repo, rel))
        # What `--prepare` carries (the carried build is the GPU machine's).
        for rel in (".gpu-carry/eigen3/Eigen", ".gpu-carry/googletest"):
            os.makedirs(os.path.join(self.repo, rel))
        self.bin = os.path.join(self.tmp, "bin")
        os.makedirs(self.bin)
        for name in REAL:
            if name not in missing:
                os.symlink(shutil.which(name), os.path.join(self.bin, name))
        for name in FAKES:
            if name not in missing:
                os.symlink(STUBS, os.path.join(self.bin, name))
        self.cuda_home = os.path.join(self.tmp, "cuda")  # empty unless a test puts tools there
        self.trace = os.path.join(self.tmp, "trace.log")
        # The interpreter: Debian's, without site-packages (no real torch whatever is installed),
        # with the fake torch on its path or none.
        self.python = os.path.join(self.bin, "python3")
        torch_path = ""
        if python == "torch":
            torch_path = os.path.join(self.tmp, "fake-torch")
            subprocess.run(["/usr/bin/python3", STUBS, "--write-torch", torch_path], check=True)
        if python is not None:
            self.script(self.python, f'echo "python $*" >> "$FAKE_TRACE"\n'
                                     f'PYTHONPATH={torch_path} exec /usr/bin/python3 -S "$@"\n')

    def prebuild(self):
        """build-gpu/ as an earlier run's build left it, for runs without the build step."""
        env = {"PATH": self.bin, "FAKE_TRACE": os.path.join(self.tmp, "prebuild.log")}
        for args in (["-S", ".", "-B", "build-gpu"], ["--build", "build-gpu"]):
            subprocess.run([os.path.join(self.bin, "cmake"), *args], cwd=self.repo, env=env, check=True,
                           stdout=subprocess.DEVNULL)
        return self

    def script(self, path, body):
        with open(path, "w") as f:
            f.write("#!/bin/bash\n" + body)
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)

    def run(self, **env):
        out = os.path.join(self.tmp, "out")
        full = {"PATH": self.bin, "HOME": self.tmp, "LANG": "C", "FAKE_TRACE": self.trace, "OUT": out,
                "CUDA_HOME": self.cuda_home, "PYTHON": self.python, "ATTNSERVE_GPU_CHECK_CARRIED": "1",
                "ATTNSERVE_GPU_CHECK_MIN_TIME_S": "0.01"}
        full.update({k: str(v) for k, v in env.items() if v is not None})
        for k in [k for k, v in env.items() if v is None]:
            full.pop(k, None)
        if os.path.exists(self.trace):
            os.remove(self.trace)
        start = time.monotonic()
        proc = subprocess.run(["/bin/bash", os.path.join(self.repo, "scripts", "gpu-check.sh")], env=full,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        return Run(proc, out, self.trace, time.monotonic() - start)


class GpuCheckTest(unittest.TestCase):
    def assertInOrder(self, run, steps):
        order = [s for s, _ in run.verdicts]
        positions = [order.index(s) for s in steps]
        self.assertEqual(positions, sorted(positions), f"steps out of order: {order}\n{run}")

    def test_every_step_in_order_on_the_gpu(self):
        box = Sandbox(self)
        run = box.run()
        self.assertEqual(run.rc, 0, run)
        self.assertEqual(run.verdicts, [(s, "passed") for s in STEPS], run)
        self.assertRegex(run.summary[-1], r"done: passed in \d+s \(budget 570s\)$")
        # The GPU as nvidia-smi named it; the CUDA architecture from its compute capability.
        self.assertTrue(run.line(r"GPU: .*NVIDIA H200, .*9\.0"), run)
        configure = run.calls("cmake")[0]
        for flag in ("-DATTNSERVE_CORE_ONLY=ON", "-DATTNSERVE_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                     "-DATTNSERVE_ONEDNN=OFF", "-G Ninja", f"-DCMAKE_CUDA_COMPILER={box.bin}/nvcc"):
            self.assertIn(flag, configure)
        self.assertIn("ATTNSERVE_EIGEN_INCLUDE_DIR=", configure)
        self.assertIn("ATTNSERVE_GTEST_SOURCE_DIR=", configure)
        # The build: first what the later steps need, then everything.
        builds = run.calls("cmake")[1:]
        self.assertEqual(len(builds), 2, run)
        self.assertRegex(builds[0], r"--target backend_test forward_bench attnserve_cuda_plugin$")
        self.assertNotIn("--target", builds[1])
        # The unit tests with the CUDA backends required and without the emulated suite.
        (tests,) = [c for c in run.calls("ctest") if "-L unit" in c]
        self.assertIn("-E ^emulated\\.", tests)
        self.assertTrue(tests.endswith("ATTNSERVE_REQUIRE_BACKENDS=cuda,cuda-tf32"), tests)
        self.assertTrue(run.line(r"100% tests passed"), run)
        # Each sanitizer tool over backend_test's cuda instances at 4 random cases.
        sanitizers = run.calls("compute-sanitizer")
        self.assertEqual([re.search(r"--tool (\w+)", c)[1] for c in sanitizers], ["memcheck", "racecheck", "synccheck"])
        for call in sanitizers:
            self.assertIn("--gtest_filter=Backends/BackendTest.*/cuda:-", call)
            self.assertTrue(call.endswith("ATTNSERVE_RANDOM_CASES=4"), call)
        # Both benchmarks on the device, every shape, FP32 then TF32.
        benches = run.calls("forward_bench")
        self.assertEqual(len(benches), 5, run)
        self.assertNotIn("--tf32", benches[0])
        self.assertIn("--tf32", benches[1])
        # The third: the weights and projections in BF16 (--gpu-math bf16), attention in FP32.
        self.assertIn("--gpu-math bf16", benches[2])
        self.assertNotIn("--gpu-math", benches[0] + benches[1] + benches[3] + benches[4])
        # The fourth run: FP32 on the score GEMM, softmax and mix GEMM, beside the fused kernel.
        self.assertNotIn("--tf32", benches[3])
        self.assertIn("--gemm-attention", benches[3])
        self.assertNotIn("--gemm-attention", benches[0] + benches[1] + benches[2] + benches[4])
        # The fifth: FP32 fused, the shapes of at most 1024 rows replaying CUDA graphs (the large
        # one, which has none, left out).
        self.assertIn("--gpu-graphs 1024", benches[4])
        self.assertIn("--shapes bert-base,gpt2-medium,small-request ", benches[4])
        self.assertNotIn("--gpu-graphs", benches[0] + benches[1] + benches[2] + benches[3])
        # The FP32 run sets the 4 MiB copy slices beside one copy each way, 1 and 4 packing threads.
        self.assertIn("--staging-slice-kib 4096,1048576 --staging-threads 1,4", benches[0])
        self.assertNotIn("--staging-slice-kib", benches[1])
        for call in benches:
            self.assertIn("--device cuda", call)
        for call in benches[:4]:
            self.assertIn("--shapes bert-base,gpt2-medium,small-request,large", call)
        self.assertEqual({r["ceiling_source"] for r in run.json("cuda-tf32.json")}, {"cublas-tf32 8192x8192x8192"})
        self.check_torch_fp32_and_tf32(run)
        # The BF16 rows: our run against PyTorch's BF16 peer in a table of their own.
        self.assertFalse(run.line(r"TODO"), run)
        for step in ("bench-bf16", "table-bf16", "bench-gemm-attention", "bench-graphs"):
            self.assertEqual(run.verdict(step), "passed", f"{step}\n{run}")
        self.assertFalse(run.line(r"bench-fused"), run)
        self.check_tarball(run)

    def check_tarball(self, run):
        """Every output in one file, the summary with its done line included."""
        self.assertTrue(run.line(r"outputs: \S+/gpu-check\.tar\.gz"), run)
        with tarfile.open(os.path.join(run.out, "gpu-check.tar.gz")) as tar:
            names = {os.path.normpath(n) for n in tar.getnames()}
            packed = set(os.listdir(run.out)) - {"gpu-check.tar.gz"}
            self.assertEqual(names, packed)
            summary = tar.extractfile("summary.txt").read().decode().splitlines()
        self.assertEqual(summary, run.summary)
        self.assertRegex(summary[-1], r"done: \w+ in \d+s")

    def check_torch_fp32_and_tf32(self, run):
        peers = [c for c in run.calls("python") if "torch_attention.py" in c]
        self.assertEqual(len(peers), 3, run)
        self.assertNotIn("--tf32", peers[0])
        self.assertIn("--tf32", peers[1])
        self.assertIn("--bf16", peers[2])
        # The BF16 peer's SDPA ran on bfloat16 tensors (the fake's linear refuses mixed dtypes), TF32 off.
        self.assertIn("torch sdpa ran with matmul.allow_tf32=False cudnn.allow_tf32=False in bfloat16", run.trace)
        self.assertIn("torch sdpa ran with matmul.allow_tf32=True cudnn.allow_tf32=True in float32", run.trace)
        bf16 = run.json("torch-bf16.json")
        self.assertEqual({r["precision"] for r in bf16}, {"bf16"})
        self.assertEqual([r["shape"] for r in bf16], ["bert-base", "gpt2-medium", "small-request", "large"])
        # The real torch_attention.py set both switches, each way, whatever torch's defaults.
        self.assertIn("torch sdpa ran with matmul.allow_tf32=False cudnn.allow_tf32=False in float32", run.trace)
        fp32, tf32 = run.json("torch.json"), run.json("torch-tf32.json")
        self.assertEqual({r["precision"] for r in fp32}, {"fp32"})
        self.assertEqual({r["precision"] for r in tf32}, {"tf32"})
        self.assertEqual([r["shape"] for r in tf32], ["bert-base", "gpt2-medium", "small-request", "large"])
        # Each table pairs our run with the peer of its precision: every row has a torch ratio.
        tables = [c for c in run.calls("python") if "compare.py" in c]
        self.assertEqual(len(tables), 3, run)
        self.assertRegex(tables[0], r"/cuda\.json \S+/torch\.json$")
        self.assertRegex(tables[1], r"/cuda-tf32\.json \S+/torch-tf32\.json$")
        self.assertRegex(tables[2], r"/cuda-bf16\.json \S+/torch-bf16\.json$")
        with open(os.path.join(run.out, "table-bf16.txt")) as f:
            self.assertTrue(f.readline().startswith("precision: bf16 (both; torch 2.7.0+fake)"))
        with open(os.path.join(run.out, "table-tf32.txt")) as f:
            table = f.read().splitlines()
        self.assertTrue(table[0].startswith("precision: tf32 (both; torch 2.7.0+fake)"), table)
        rows = [r for r in table[2:] if r.strip()]
        self.assertEqual(len(rows), 8, table)
        for row in rows:
            self.assertRegex(row, r"\d+\.\d\d$")  # ours/torch, not "-"

    def test_a_failing_step_is_reported_and_the_later_ones_run(self):
        run = Sandbox(self).run(FAKE_FAIL="tests,racecheck,bench-fp32")
        self.assertNotEqual(run.rc, 0, run)
        self.assertEqual(run.verdict("tests"), "FAILED", run)
        self.assertEqual(run.verdict("racecheck"), "FAILED", run)
        self.assertTrue(run.line(r"racecheck: FAILED \(exit 86\)"), run)
        self.assertEqual(run.verdict("bench-fp32"), "FAILED", run)
        for step in ("memcheck", "synccheck", "bench-tf32", "torch-fp32", "torch-tf32", "table-tf32"):
            self.assertEqual(run.verdict(step), "passed", f"{step}\n{run}")
        self.assertEqual(run.verdict("table-fp32"), "not run", run)  # no cuda.json to join
        self.assertTrue(run.line(r"table-fp32: not run, no cuda\.json"), run)
        self.assertTrue(run.line(r"Backends/BackendTest.RandomizedFormsMatchFloat64Reference/cuda \(Failed\)"), run)
        self.assertRegex(run.summary[-1], r"done: FAILED in \d+s")
        self.assertInOrder(run, STEPS[2:])

    def test_a_failed_build_still_runs_what_it_made(self):
        # The targets the later steps need come first: with the rest of the build failing, the
        # sanitizers and the benchmark run, and the tests step names the binaries not built.
        run = Sandbox(self).run(FAKE_FAIL="build")
        self.assertNotEqual(run.rc, 0, run)
        self.assertEqual(run.verdict("build"), "FAILED", run)
        self.assertTrue(run.line(r"error: a fake compile error"), run)
        self.assertEqual(run.verdict("tests"), "FAILED", run)
        missing = run.line(r"tests: not built, so not run: ")
        self.assertTrue(missing, run)
        self.assertIn("core_test", missing)
        self.assertNotIn("backend_test", missing)
        self.assertNotIn("cuda_emulated_test", missing)  # not run on a GPU anyway
        for step in ("memcheck", "racecheck", "synccheck", "bench-fp32", "bench-tf32", "torch-tf32", "table-tf32"):
            self.assertEqual(run.verdict(step), "passed", f"{step}\n{run}")

    def test_the_budget_is_honoured(self):
        # 8 s for bench-fp32, bench-tf32, bench-bf16, bench-gemm-attention, bench-graphs and the
        # three tables (shares 1, 1, 1, 1, 0, 0, 0, 0 of 7 s): the first
        # benchmark hangs and is cut when only the later steps' shares are left; those still run.
        # (The script counts whole seconds from its start; on a loaded machine starting takes one
        # or two, which the first step's limit gives up.)
        run = Sandbox(self).prebuild().run(ATTNSERVE_GPU_CHECK_BUDGET_S=8, ATTNSERVE_GPU_CHECK_STEPS="bench",
                                           FAKE_SLEEP="bench-fp32:60")
        self.assertNotEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"plan \(budget 8s, 7s shared\): bench-fp32 1s, bench-tf32 1s, bench-bf16 1s, "
                                 r"bench-gemm-attention 1s, bench-graphs 0s, table-fp32 0s, table-tf32 0s, "
                                 r"table-bf16 0s$"), run)
        start, limit = map(int, re.search(r"\[(\d+)s\] bench-fp32: .*\(limit (\d+)s\)$", "\n".join(run.summary),
                                          re.M).groups())
        # All but the shares of bench-tf32, bench-bf16, bench-gemm-attention and bench-graphs.
        self.assertIn(limit, (8 - 3 - start, 8 - 3 - start + 1), run)
        self.assertTrue(run.line(rf"bench-fp32: cut at its limit of {limit}s \(exit 124\)"), run)
        self.assertEqual(run.verdict("bench-tf32"), "passed", run)
        self.assertTrue(run.line(r"table-fp32: not run, no cuda\.json"), run)
        self.assertEqual(run.verdict("table-tf32"), "passed", run)
        self.assertRegex(run.summary[-1], r"done: FAILED in \ds \(budget 8s\); cut short: bench-fp32$")
        self.assertLess(run.elapsed, 8 + 1, run)
        self.assertEqual(run.calls("cmake"), [], run)  # no build asked for

    def test_the_plan_fits_the_budget(self):
        run = Sandbox(self).prebuild().run(ATTNSERVE_GPU_CHECK_STEPS="bench,torch")
        full = Sandbox(self).run()
        for r, budget in ((run, 570), (full, 570)):
            plan = r.line(r"plan \(budget")
            shares = {m[1]: int(m[2]) for m in re.finditer(r" ([a-z0-9-]+) (\d+)s", plan.split(":", 1)[1])}
            self.assertLessEqual(sum(shares.values()), budget * 95 // 100, plan)
            self.assertGreater(sum(shares.values()), budget * 90 // 100, plan)
        full_shares = dict(re.findall(r" ([a-z0-9-]+) (\d+)s", full.line(r"plan \(").split(":", 1)[1]))
        self.assertEqual(list(full_shares), STEPS)
        # Over 2.5 times the H200 machine's 57-61 s build (2026-12-04).
        self.assertGreaterEqual(int(full_shares["build"]), 155)

    def test_a_rerun_without_the_build_gives_the_others_its_time(self):
        box = Sandbox(self)
        first = box.run()
        self.assertEqual(first.rc, 0, first)
        rerun = box.run(ATTNSERVE_GPU_CHECK_STEPS="tests,sanitizer,bench,torch")
        self.assertEqual(rerun.rc, 0, rerun)
        self.assertEqual(rerun.calls("cmake"), [], rerun)
        self.assertEqual(rerun.verdicts, [(s, "passed") for s in STEPS[2:]], rerun)
        share = lambda r, step: int(re.search(rf" {step} (\d+)s", r.line(r"plan \("))[1])  # noqa: E731
        self.assertGreater(share(rerun, "tests"), 1.5 * share(first, "tests"))

    def test_no_nvcc_on_a_gpu_machine_stops_before_configuring(self):
        run = Sandbox(self, missing=["nvcc"]).run()
        self.assertEqual(run.rc, 1, run)
        self.assertTrue(run.line(r"no nvcc \(not on PATH, not in \S+/cuda/bin\): the CUDA backend cannot be built"),
                        run)
        self.assertRegex(run.summary[-1], r"done: FAILED")
        self.assertEqual(run.calls("cmake"), [], run)

    def test_nvcc_is_found_in_cuda_home(self):
        box = Sandbox(self, missing=["nvcc", "compute-sanitizer"])
        os.makedirs(os.path.join(box.cuda_home, "bin"))
        for name in ("nvcc", "compute-sanitizer"):
            os.symlink(STUBS, os.path.join(box.cuda_home, "bin", name))
        run = box.run()
        self.assertEqual(run.rc, 0, run)
        self.assertIn(f"-DCMAKE_CUDA_COMPILER={box.cuda_home}/bin/nvcc", run.calls("cmake")[0])
        self.assertEqual(len(run.calls("compute-sanitizer")), 3, run)

    def test_no_compute_sanitizer(self):
        run = Sandbox(self, missing=["compute-sanitizer"]).run()
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"compute-sanitizer not found \(not on PATH, not in \S+\): "
                                 r"memcheck/racecheck/synccheck not run"), run)
        self.assertEqual([s for s, _ in run.verdicts if "check" in s], [], run)
        self.assertEqual(run.verdict("bench-tf32"), "passed", run)

    def test_a_compute_sanitizer_that_refuses_to_run_is_not_run_not_failed(self):
        run = Sandbox(self).run(FAKE_SANITIZER_REFUSES=1)
        self.assertEqual(run.rc, 0, run)
        for tool in ("memcheck", "racecheck", "synccheck"):
            self.assertEqual(run.verdict(tool), "not run", f"{tool}\n{run}")
        self.assertTrue(run.line(r"memcheck: not run, compute-sanitizer refused to run on this host "
                                 r"\(Internal Sanitizer Error: Device not supported.*, exit 1\)"), run)
        # Tried once: the later tools would refuse alike, and their time goes to the steps after.
        self.assertEqual(len(run.calls("compute-sanitizer")), 1, run)
        self.assertEqual(run.verdict("bench-tf32"), "passed", run)
        self.assertRegex(run.summary[-1], r"done: passed in \d+s")
        # A real finding is still a failure (exit 86 with the test's output).
        found = Sandbox(self).run(FAKE_FAIL="memcheck")
        self.assertEqual(found.verdict("memcheck"), "FAILED", found)

    def test_a_script_that_stops_early_still_packs_its_outputs(self):
        run = Sandbox(self, missing=["cmake"]).run()
        self.assertNotEqual(run.rc, 0, run)
        self.check_tarball(run)

    def test_no_python(self):
        run = Sandbox(self, python=None).run()
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"no \S+/python3: no PyTorch peer and no comparison tables"), run)
        self.assertEqual(run.verdict("bench-tf32"), "passed", run)
        self.assertEqual([s for s, _ in run.verdicts if s.startswith(("torch", "table"))], [], run)

    def test_python_without_torch(self):
        run = Sandbox(self, python="none").run()
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"torch-fp32: not run, PyTorch \(cuda\) not available to \S+python3: no peer column"),
                        run)
        self.assertTrue(run.line(r"no torch in /usr/bin/python3"), run)
        self.assertEqual(len([c for c in run.calls("python") if "torch_attention.py" in c]), 1, run)
        self.assertEqual(run.verdict("torch-tf32"), "not run", run)
        # The tables still run, without the peer column.
        self.assertEqual(run.verdict("table-tf32"), "passed", run)
        self.assertTrue(run.line(r"compare.py cuda-tf32.json \(no peer\)"), run)

    def test_torch_without_cuda(self):
        run = Sandbox(self).run(FAKE_TORCH_CUDA=0)
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"has no usable CUDA device"), run)
        self.assertEqual(run.verdict("torch-tf32"), "not run", run)

    def test_no_timeout_command(self):
        run = Sandbox(self, missing=["timeout"]).run()
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"no 'timeout' command: steps run without their time limits"), run)

    def test_no_cmake(self):
        run = Sandbox(self, missing=["cmake"]).run()
        self.assertEqual(run.rc, 1, run)
        self.assertTrue(run.line(r"no cmake on PATH: nothing can be built"), run)
        self.assertRegex(run.summary[-1], r"done: FAILED")

    def test_no_ninja(self):
        run = Sandbox(self, missing=["ninja"]).run()
        self.assertEqual(run.rc, 0, run)
        self.assertTrue(run.line(r"no ninja: CMake's default generator"), run)
        self.assertNotIn("-G Ninja", run.calls("cmake")[0])

    def test_without_a_gpu(self):
        for label, box, env in (("no nvidia-smi", Sandbox(self, missing=["nvidia-smi"]), {}),
                                ("nvidia-smi lists none", Sandbox(self), {"FAKE_GPU": 0})):
            with self.subTest(label):
                run = box.run(**env)
                self.assertEqual(run.rc, 0, run)
                self.assertTrue(run.line(r"no nvidia-smi on PATH: taken as a machine without a GPU"
                                         if label == "no nvidia-smi" else r"nvidia-smi lists no GPU"), run)
                self.assertTrue(run.line(r"no NVIDIA GPU here"), run)
                self.assertEqual(run.verdicts, [("configure", "passed"), ("build", "passed"), ("tests", "passed"),
                                                ("sanitizer", "not run"), ("bench-fp32", "passed"),
                                                ("torch-fp32", "passed"), ("table-fp32", "passed")], run)
                self.assertIn("-DATTNSERVE_CUDA=AUTO", run.calls("cmake")[0])
                self.assertRegex(run.calls("cmake")[1], r"--target backend_test forward_bench$")
                (tests,) = [c for c in run.calls("ctest") if "-L unit" in c]
                self.assertNotIn("-E", tests)
                self.assertTrue(tests.endswith("ATTNSERVE_REQUIRE_BACKENDS="), tests)
                self.assertTrue(run.line(r"sanitizer: not run, no GPU"), run)
                self.assertEqual(run.calls("compute-sanitizer"), [])
                (bench,) = run.calls("forward_bench")
                self.assertIn("--device cpu", bench)
                self.assertIn(f"--threads {len(os.sched_getaffinity(0))}", bench)
                peers = [c for c in run.calls("python") if "torch_attention.py" in c]
                self.assertEqual(len(peers), 1, run)
                self.assertIn("--device cpu", peers[0])
                self.assertNotIn("--tf32", peers[0])
                self.assertEqual({r["precision"] for r in run.json("torch.json")}, {"fp32"})

    def test_compare_refuses_mixed_precisions(self):
        box = Sandbox(self).prebuild()
        run = box.run(ATTNSERVE_GPU_CHECK_STEPS="bench,torch")
        self.assertEqual(run.rc, 0, run)
        proc = subprocess.run([box.python, os.path.join(box.repo, "bench/peers/compare.py"),
                               os.path.join(run.out, "cuda-tf32.json"), os.path.join(run.out, "torch.json")],
                              env={"FAKE_TRACE": box.trace}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        self.assertEqual(proc.returncode, 1, proc.stdout)
        self.assertIn("is tf32", proc.stdout)
        self.assertIn("not comparable", proc.stdout)

    def test_shellcheck(self):
        shellcheck = shutil.which("shellcheck")
        if shellcheck is None:
            self.skipTest("no shellcheck (scripts/setup installs it)")
        proc = subprocess.run([shellcheck, os.path.join(SRC, "scripts", "gpu-check.sh")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        self.assertEqual(proc.returncode, 0, proc.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
