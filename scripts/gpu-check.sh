#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the core-only tree with the CUDA backend, run the unit
# tests with the CUDA backends required (a skip is a failure), benchmark both forms against a
# cuBLAS SGEMM ceiling measured in the same run, and against PyTorch when python3 has torch.
#
#   scripts/gpu-check.sh --prepare   # here: copy Eigen's headers and GoogleTest's sources into
#                                    # .gpu-carry/ for a machine without Debian's -dev packages
#   scripts/gpu-check.sh             # there: build, test, benchmark; results under $OUT or
#                                    # build-gpu/out
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

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$out/gpu.txt"
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release
      -DCMAKE_CUDA_ARCHITECTURES="${ATTNSERVE_CUDA_ARCH:-$cap}")
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

log "unit tests, CUDA backends required"
status=0
ATTNSERVE_REQUIRE_BACKENDS=cuda,cuda-tf32 ctest --test-dir build-gpu -L unit -E '^emulated\.' --output-on-failure \
  > "$out/tests.txt" 2>&1 || status=1
grep -E "tests passed|tests failed|Failed|\(Failed\)" "$out/tests.txt" | tee -a "$out/summary.txt"
grep -E "worst relative" "$out/tests.txt" | tee -a "$out/summary.txt" || true

log "benchmark fp32"
build-gpu/bench/forward_bench --device cuda --json "$out/cuda.json" | tee -a "$out/summary.txt"
log "benchmark tf32"
build-gpu/bench/forward_bench --device cuda --tf32 --json "$out/cuda-tf32.json" | tee -a "$out/summary.txt"

peer=()
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  log "PyTorch"
  python3 bench/peers/torch_attention.py --device cuda --json "$out/torch.json" | tee -a "$out/summary.txt"
  peer=("$out/torch.json")
else
  log "PyTorch with CUDA not available: no peer column"
fi
log "table (fp32)"
python3 bench/peers/compare.py "$out/cuda.json" "${peer[@]}" | tee -a "$out/summary.txt"
exit $status
