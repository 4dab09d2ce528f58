#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the core-only tree with the CUDA backend, run the unit
# tests with the CUDA backends required (a skip is a failure), benchmark both forms against a
# cuBLAS SGEMM ceiling (random data) measured in the same run, and against PyTorch when python3
# has torch; compute-sanitizer (memcheck, racecheck, synccheck) over the CUDA backend tests when
# it is installed. A failing step is reported and the later ones still run; the exit status
# says whether all passed.
#
#   scripts/gpu-check.sh --prepare   # here: copy Eigen's headers and GoogleTest's sources into
#                                    # .gpu-carry/ for a machine without Debian's -dev packages
#   scripts/gpu-check.sh             # there: build, test, benchmark; results under $OUT or
#                                    # build-gpu/out
#
# Without a GPU (no nvidia-smi, or it lists none) it runs the half that needs none: the same
# core-only build (with the CUDA backend when nvcc is present), the unit tests — the CUDA
# backend's sources run over the host emulation of CUDA (tests/cuda_emulation), the real-device
# instances skip —, and the benchmark and PyTorch peer on the CPU. PYTHON picks the interpreter
# for the peer (one with torch, e.g. build-bench/peers-venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry

if [[ "${1:-}" == "--prepare" ]]; then
  rm -rf "$carry" && mkdir -p "$carry"
  cp -r /usr/include/eigen3 "$carry/eigen3"
  cp -r /usr/src/googletest "$carry/googletest"
  du -sh "$carry"
  exit 0
fi

out=${OUT:-build-gpu/out}
mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }

python=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$out/gpu.txt"
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_CUDA_ARCHITECTURES="${ATTNSERVE_CUDA_ARCH:-$cap}")
else
  gpu=0
  log "no NVIDIA GPU here: build, unit tests (CUDA emulated on the CPU) and the CPU benchmark only"
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=AUTO -DCMAKE_BUILD_TYPE=Release)
fi
if [[ ! -d /usr/include/eigen3 ]]; then
  args+=(-DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON -DATTNSERVE_EIGEN_INCLUDE_DIR="$PWD/$carry/eigen3")
fi
if [[ ! -d /usr/src/googletest && ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ]]; then
  args+=(-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DATTNSERVE_GTEST_SOURCE_DIR="$PWD/$carry/googletest")
fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)

log "build (${args[*]})"
cmake -S . -B build-gpu "${gen[@]}" "${args[@]}" > "$out/configure.txt" 2>&1 || { tail -30 "$out/configure.txt"; exit 1; }
cmake --build build-gpu -j"$(nproc)" > "$out/build.txt" 2>&1 || { grep -E "error" -A5 "$out/build.txt" | head -60; exit 1; }

status=0
if ((gpu)); then
  log "unit tests, CUDA backends required"
  ATTNSERVE_REQUIRE_BACKENDS=cuda,cuda-tf32 ctest --test-dir build-gpu -L unit -E '^emulated\.' --output-on-failure \
    > "$out/tests.txt" 2>&1 || status=1
else
  log "unit tests, the CUDA backend emulated"
  ctest --test-dir build-gpu -L unit -j"$(nproc)" --output-on-failure > "$out/tests.txt" 2>&1 || status=1
fi
grep -E "tests passed|tests failed|Failed|\(Failed\)" "$out/tests.txt" | tee -a "$out/summary.txt" || true
grep -E "worst relative" "$out/tests.txt" | tee -a "$out/summary.txt" || true

# compute-sanitizer sees what the emulation cannot: out-of-bounds device accesses, races between
# threads of a block, missing synchronisation. Over the CUDA instances of the backend tests at
# their own (small) shapes, bounded in time; a report fails the check.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if ((gpu)) && [[ -n "$sanitizer" ]]; then
  for tool in memcheck racecheck synccheck; do
    log "compute-sanitizer --tool $tool (backend_test, the cuda instances)"
    if ATTNSERVE_REQUIRE_BACKENDS=cuda timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 86 \
        build-gpu/tests/backend_test --gtest_filter='*/cuda:-*Randomized*:*LargeRagged*' \
        > "$out/sanitizer-$tool.txt" 2>&1; then
      tail -2 "$out/sanitizer-$tool.txt" | tee -a "$out/summary.txt"
    else
      rc=$?
      log "compute-sanitizer $tool: exit $rc ($( ((rc == 124)) && echo 'timed out' || echo 'errors or failures'))"
      grep -E "ERROR SUMMARY|Invalid|Race|FAILED" "$out/sanitizer-$tool.txt" | head -20 | tee -a "$out/summary.txt" || true
      ((rc == 124)) || status=1
    fi
  done
elif ((gpu)); then
  log "compute-sanitizer not found: memcheck/racecheck/synccheck not run"
fi

# On a GPU every shape, the large one included. On the CPU the large one would take minutes, and
# both sides use every core (the peer table pairs rows by shape, not by thread count).
device=cpu shapes=bert-base,gpt2-medium,small-request threads=(--threads "$(nproc)")
((gpu)) && device=cuda shapes=bert-base,gpt2-medium,small-request,large threads=()
log "benchmark fp32 ($device)"
build-gpu/bench/forward_bench --device "$device" --shapes "$shapes" "${threads[@]}" --json "$out/$device.json" |
  tee -a "$out/summary.txt" || status=1
if ((gpu)); then
  log "benchmark tf32"
  build-gpu/bench/forward_bench --device cuda --tf32 --shapes "$shapes" --json "$out/cuda-tf32.json" |
    tee -a "$out/summary.txt" || status=1
fi

peer=()
if ! command -v "$python" >/dev/null; then
  log "no $python: no PyTorch peer and no comparison table (the JSON files above hold the figures)"
  exit $status
fi
if "$python" -c "import torch, sys; sys.exit(0 if '$device' == 'cpu' or torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "PyTorch ($device)"
  "$python" bench/peers/torch_attention.py --device "$device" --shapes "$shapes" "${threads[@]}" \
    --json "$out/torch.json" |
    tee -a "$out/summary.txt"
  peer=("$out/torch.json")
else
  log "PyTorch ($device) not available to $python: no peer column"
fi
log "table (fp32, $device)"
"$python" bench/peers/compare.py "$out/$device.json" "${peer[@]}" | tee -a "$out/summary.txt" || status=1
exit $status
