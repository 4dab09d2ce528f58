#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the core-only tree with the CUDA backend, run the unit
# tests with the CUDA backends required (a skip is a failure), compute-sanitizer (memcheck,
# racecheck, synccheck) over the CUDA backend tests at small shapes, and benchmark both forms
# against a cuBLAS SGEMM ceiling (random data) measured in the same run and against PyTorch when
# the interpreter has torch. A failing step is reported and the later ones still run; the exit
# status says whether all passed. The whole check keeps within a time budget (570 s: the GPU
# machine gives one command 10 minutes); a step that would run past it is cut short or skipped,
# and says so.
#
#   scripts/gpu-check.sh --prepare   # here: copy Eigen's headers and GoogleTest's sources into
#                                    # .gpu-carry/ for a machine without Debian's -dev packages
#   scripts/gpu-check.sh             # there: build, test, sanitize, benchmark; everything it
#                                    # writes goes under $OUT (else build-gpu/out)
#
# Environment:
#   OUT                            the output folder (summary.txt, every step's log, the JSON)
#   PYTHON                         the interpreter for the PyTorch peer (default python3)
#   ATTNSERVE_GPU_CHECK_STEPS      a comma list of build,tests,sanitizer,bench,torch (default all;
#                                  a rerun after a fix can leave out what already passed)
#   ATTNSERVE_GPU_CHECK_BUDGET_S   the time budget in seconds (default 570)
#   ATTNSERVE_GPU_CHECK_CARRIED=1  build from .gpu-carry/ even where Debian's packages are
#                                  installed, without oneDNN, as the bare GPU machine does (the
#                                  dry run of that configuration on a development machine)
#   ATTNSERVE_CUDA_ARCH            the CUDA architecture (default: the GPU's compute capability)
#
# Without a GPU (no nvidia-smi, or it lists none) it runs the half that needs none: the same
# core-only build (with the CUDA backend when nvcc is present), the unit tests — the CUDA
# backend's sources run over the host emulation of CUDA (tests/cuda_emulation), the real-device
# instances skip —, and the benchmark and PyTorch peer on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry

if [[ "${1:-}" == "--prepare" ]]; then
  for dir in /usr/include/eigen3 /usr/src/googletest; do
    [[ -d $dir ]] || { echo "gpu-check.sh --prepare: $dir is missing (scripts/setup installs it)" >&2; exit 1; }
  done
  rm -rf "$carry" && mkdir -p "$carry"
  cp -r /usr/include/eigen3 "$carry/eigen3"
  cp -r /usr/src/googletest "$carry/googletest"
  du -sh "$carry"
  exit 0
fi
if (($#)); then
  echo "usage: scripts/gpu-check.sh [--prepare]" >&2
  exit 2
fi

out=${OUT:-build-gpu/out}
mkdir -p "$out"
: > "$out/summary.txt"
budget=${ATTNSERVE_GPU_CHECK_BUDGET_S:-570}
steps=",${ATTNSERVE_GPU_CHECK_STEPS:-build,tests,sanitizer,bench,torch},"
want() { [[ $steps == *",$1,"* ]]; }
log() { echo "== [${SECONDS}s] $*" | tee -a "$out/summary.txt"; }
left() { echo $((budget - SECONDS)); }
# bounded SECONDS COMMAND...: the command, stopped after SECONDS (exit 124) where `timeout`
# exists; without it the command runs unbounded, and the summary says so once.
have_timeout=1
command -v timeout >/dev/null || { have_timeout=0; log "no 'timeout' command: steps run without their time limits"; }
bounded() {
  local secs=$1
  shift
  if ((secs < 1)); then
    log "no time left in the budget for: $*"
    return 124
  fi
  if ((have_timeout)); then timeout --kill-after=10 "$secs" "$@"; else "$@"; fi
}
# A step's limit: `cap` seconds, or what the budget leaves after `reserve` seconds kept for the
# steps after it, whichever is less; 0 when there is no time left for it.
limit() {
  local cap=$1 reserve=$2 room
  room=$(($(left) - reserve))
  ((room > 0)) || room=0
  echo $((room < cap ? room : cap))
}

python=${PYTHON:-python3}
# nvidia-smi's output is read whole, not through `grep -q` or `head`: under pipefail the reader
# that stops early makes the writer's SIGPIPE the pipeline's status.
gpu_list=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null) || true)
if [[ $gpu_list == GPU* || $gpu_list == *$'\nGPU'* ]]; then
  gpu=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv > "$out/gpu.txt" 2>&1 || true
  cat "$out/gpu.txt"
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true)
  cap=${caps%%$'\n'*}
  cap=${cap//[. ]/}
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_CUDA_ARCHITECTURES="${ATTNSERVE_CUDA_ARCH:-${cap:-90}}")
else
  gpu=0
  log "no NVIDIA GPU here: build, unit tests (CUDA emulated on the CPU) and the CPU benchmark only"
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=AUTO -DCMAKE_BUILD_TYPE=Release)
fi
carried=${ATTNSERVE_GPU_CHECK_CARRIED:-0}
if [[ $carried == 1 || ! -d /usr/include/eigen3 ]]; then
  [[ -d $carry/eigen3 ]] || { log "no Eigen: neither /usr/include/eigen3 nor $carry/eigen3 (scripts/gpu-check.sh --prepare)"; exit 1; }
  args+=(-DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON -DATTNSERVE_EIGEN_INCLUDE_DIR="$PWD/$carry/eigen3")
fi
if [[ $carried == 1 || ( ! -d /usr/src/googletest && ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ) ]]; then
  [[ -d $carry/googletest ]] || { log "no GoogleTest: neither Debian's package nor $carry/googletest (--prepare)"; exit 1; }
  args+=(-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DATTNSERVE_GTEST_SOURCE_DIR="$PWD/$carry/googletest")
fi
((carried == 1)) && args+=(-DATTNSERVE_ONEDNN=OFF)
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { log "no $tool on PATH: nothing can be built"; exit 1; }
done

if want build; then
  log "configure and build (${args[*]})"
  cmake -S . -B build-gpu "${gen[@]}" "${args[@]}" > "$out/configure.txt" 2>&1 ||
    { tail -30 "$out/configure.txt" | tee -a "$out/summary.txt"; exit 1; }
  bounded "$(limit "$budget" 60)" cmake --build build-gpu -j"$(nproc)" > "$out/build.txt" 2>&1 ||
    { log "build failed (exit $?)"; grep -E "error|Error" -A5 "$out/build.txt" | head -60 | tee -a "$out/summary.txt" || true; exit 1; }
  log "built"
fi
[[ -x build-gpu/tests/backend_test ]] || { log "build-gpu has no backend_test: run the build step"; exit 1; }

status=0
# ctest's own limit per test, and the step's limit over all of them.
if want tests; then
  secs=$( ((gpu)) && limit 240 200 || limit "$budget" 60)
  if ((gpu)); then
    # The real-device instances are required: one that skips (no device, no plugin) fails.
    # The emulated tests are left out: they ran where the emulation is the only device.
    log "unit tests, CUDA backends required (limit ${secs}s)"
    ATTNSERVE_REQUIRE_BACKENDS=cuda,cuda-tf32 bounded "$secs" ctest --test-dir build-gpu -L unit -E '^emulated\.' \
      -j"$(nproc)" --timeout 200 --output-on-failure > "$out/tests.txt" 2>&1 || status=1
  else
    log "unit tests, the CUDA backend emulated (limit ${secs}s)"
    bounded "$secs" ctest --test-dir build-gpu -L unit -j"$(nproc)" --timeout 400 --output-on-failure \
      > "$out/tests.txt" 2>&1 || status=1
  fi
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run" "$out/tests.txt" | tee -a "$out/summary.txt" || true
  grep -E "worst relative" "$out/tests.txt" | tee -a "$out/summary.txt" || true
fi

# compute-sanitizer sees what the emulation cannot: out-of-bounds device accesses, races between
# threads of a block, missing synchronisation. Over the `cuda` instances of the backend suite at
# small shapes (4 random cases, no long sequences, no large batch: instrumented kernels run
# 10–100 times slower), each tool within its share of the budget; a report fails the check.
sanitizer=$(command -v compute-sanitizer || { [[ -x /usr/local/cuda/bin/compute-sanitizer ]] &&
  echo /usr/local/cuda/bin/compute-sanitizer; } || true)
if want sanitizer && ((gpu)) && [[ -n $sanitizer ]]; then
  for tool in memcheck racecheck synccheck; do
    secs=$(limit 100 90)
    if ((secs < 20)); then
      log "compute-sanitizer $tool: skipped, the time budget is spent"
      continue
    fi
    log "compute-sanitizer --tool $tool (backend_test, the cuda instances, small shapes; limit ${secs}s)"
    if ATTNSERVE_REQUIRE_BACKENDS=cuda ATTNSERVE_RANDOM_CASES=4 bounded "$secs" "$sanitizer" --tool "$tool" \
        --error-exitcode 86 build-gpu/tests/backend_test \
        --gtest_filter='Backends/BackendTest.*/cuda:-*LargeRagged*:*LongSequences*' \
        > "$out/sanitizer-$tool.txt" 2>&1; then
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitizer-$tool.txt" | tail -3 |
        tee -a "$out/summary.txt" || true
    else
      rc=$?
      log "compute-sanitizer $tool: exit $rc ($( ((rc == 124)) && echo 'out of time: not a finding' || echo 'errors or failures'))"
      grep -E "ERROR SUMMARY|Invalid|Race|Hazard|FAILED" "$out/sanitizer-$tool.txt" | head -20 |
        tee -a "$out/summary.txt" || true
      ((rc == 124)) || status=1
    fi
  done
elif want sanitizer && ((gpu)); then
  log "compute-sanitizer not found: memcheck/racecheck/synccheck not run"
fi

# On a GPU every shape, the large one included. On the CPU the large one would take minutes, and
# both sides use every core (the peer table pairs rows by shape, not by thread count).
device=cpu shapes=bert-base,gpt2-medium,small-request threads=(--threads "$(nproc)")
((gpu)) && device=cuda shapes=bert-base,gpt2-medium,small-request,large threads=()
if want bench; then
  secs=$( ((gpu)) && limit 120 30 || limit "$budget" 30)
  log "benchmark fp32 ($device; limit ${secs}s)"
  bounded "$secs" build-gpu/bench/forward_bench --device "$device" --shapes "$shapes" "${threads[@]}" \
    --json "$out/$device.json" 2>&1 | tee -a "$out/summary.txt" || status=1
  if ((gpu)); then
    secs=$(limit 90 30)
    log "benchmark tf32 (limit ${secs}s)"
    bounded "$secs" build-gpu/bench/forward_bench --device cuda --tf32 --shapes "$shapes" \
      --json "$out/cuda-tf32.json" 2>&1 | tee -a "$out/summary.txt" || status=1
  fi
fi

if want torch; then
  peer=()
  if ! command -v "$python" >/dev/null; then
    log "no $python: no PyTorch peer and no comparison table (the JSON files above hold the figures)"
  else
    if "$python" -c "import torch, sys; sys.exit(0 if '$device' == 'cpu' or torch.cuda.is_available() else 1)" \
        2>/dev/null; then
      secs=$( ((gpu)) && limit 120 5 || limit "$budget" 5)
      log "PyTorch ($device; limit ${secs}s)"
      bounded "$secs" "$python" bench/peers/torch_attention.py --device "$device" --shapes "$shapes" "${threads[@]}" \
        --json "$out/torch.json" 2>&1 | tee -a "$out/summary.txt" && peer=("$out/torch.json") || status=1
    else
      log "PyTorch ($device) not available to $python: no peer column"
    fi
    if [[ -f $out/$device.json ]]; then
      log "table (fp32, $device)"
      "$python" bench/peers/compare.py "$out/$device.json" "${peer[@]}" 2>&1 | tee -a "$out/summary.txt" || status=1
    fi
  fi
fi
log "done: $( ((status == 0)) && echo passed || echo FAILED) in ${SECONDS}s (budget ${budget}s)"
exit $status
