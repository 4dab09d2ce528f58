#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the core-only tree with the CUDA backend, run the unit
# tests with the CUDA backends required (a skip is a failure), compute-sanitizer (memcheck,
# racecheck, synccheck) over the CUDA backend tests at small shapes, benchmark both forms in FP32
# and in TF32 against a cuBLAS SGEMM ceiling (random data) measured in the same run, and run
# PyTorch's SDPA peer in FP32, TF32 and BF16 (where SDPA picks flash attention) when the
# interpreter has torch with CUDA, each paired with our run of the same precision in a table
# (BF16: forward_bench --gpu-math bf16, 16-bit weights and projections, and attention in the
# fused kernel's tensor-core twin, fused_attention_bf16.cu). The FP32 and TF32 runs take the fused
# attention kernel (the default); a third FP32 run takes the score GEMM, softmax and mix GEMM
# instead (--gemm-attention), for what the fused kernel buys. A failing step is
# reported and the later ones still run; the exit status says whether all passed. Every bench
# row first holds both forms to float64 on the device (forward_bench's accuracy check: 10 units of
# the row's math), so the BF16 row checks the tensor-core kernel and the epilogue's biases there,
# which the unit tests run only on the emulation. Everything it
# wrote under $OUT is also packed into one file, $OUT/gpu-check.tar.gz, at the end.
#
#   scripts/gpu-check.sh --prepare   # here: copy Eigen's headers and GoogleTest's sources into
#                                    # .gpu-carry/ for a machine without Debian's -dev packages
#   OUT=/some/dir scripts/gpu-check.sh
#                                    # there: build, test, sanitize, benchmark; everything it
#                                    # writes goes under $OUT (else build-gpu/out)
#
# Environment:
#   OUT                            the output folder (summary.txt, every step's log, the JSON,
#                                  and gpu-check.tar.gz holding all of them)
#   PYTHON                         the interpreter for the PyTorch peer and the tables (python3)
#   ATTNSERVE_GPU_CHECK_STEPS      a comma list of build,tests,sanitizer,bench,torch (default all;
#                                  a rerun can leave out what already passed: without `build` it
#                                  uses the build-gpu/ an earlier run left)
#   ATTNSERVE_GPU_CHECK_BUDGET_S   the time budget in seconds (default 570)
#   ATTNSERVE_GPU_CHECK_MIN_TIME_S forward_bench's and the peer's --min-time-s (default theirs, 0.5)
#   ATTNSERVE_GPU_CHECK_CARRIED=1  build from .gpu-carry/ even where Debian's packages are
#                                  installed, without oneDNN, as the bare GPU machine does (the
#                                  dry run of that configuration on a development machine)
#   ATTNSERVE_CUDA_ARCH            the CUDA architecture (default: the GPU's compute capability)
#   CUDA_HOME                      where nvcc and compute-sanitizer are looked for when they are
#                                  not on PATH (default /usr/local/cuda; its bin/)
#
# The tools: nvidia-smi (none: the machine is taken as one without a GPU), nvcc (on a GPU machine
# the build needs it: without it the script says so and stops), cmake and c++ (the build needs
# them), ninja (else CMake's default generator), ctest (the tests step), compute-sanitizer (else
# the sanitizer steps say they did not run; one that refuses to run on this host — no gtest
# output, its own error line — is "not run" too, not a failure), timeout (else the steps run
# without limits, and the summary says so), $PYTHON (else no PyTorch peer and no tables), tar
# (else no gpu-check.tar.gz: the files stay as they are). Each is checked before use, and the
# summary has a line for each one missing.
#
# The time plan. The GPU machine gives one command 10 minutes, hence the default budget of 570 s.
# The script keeps 5 % of the budget for its own work between steps and the grace after a step is
# stopped (5 s); the other 95 % is shared among the steps that will run, in proportion to these
# weights (seconds at the default budget with every step; a step left out gives its share to the
# others in proportion, so a rerun without the build gives every step 1.8 times as long):
#
#   step         GPU   no GPU   what it runs
#   configure     30       30   cmake (CUDA detection included)
#   build        165      300   ninja: first backend_test, the CUDA plugin and forward_bench,
#                               then everything else (all 43 objects on 16 cores; nvcc for one
#                               architecture; 57-61 s on the H200's 16 cores, 2026-12-04)
#   tests         80      200   ctest -L unit (on a GPU without the emulated suite)
#   memcheck      40        -   compute-sanitizer over backend_test's cuda instances,
#   racecheck     35        -     4 random cases, no long or large shapes
#   synccheck     25        -
#   bench-fp32    30       60   forward_bench, both forms (on a GPU: the large shape too, and
#                               4 MiB copy slices beside one copy each way, each packed by 1
#                               and by 4 host threads)
#   bench-tf32    25        -   forward_bench --tf32
#   bench-bf16    20        -   forward_bench --gpu-math bf16: both forms, the same shapes, the
#                               weights, projections and fused attention in BF16
#   bench-gemm-   20        -   forward_bench --gemm-attention: FP32 with the score GEMM, the
#     attention                 softmax kernel and the mix GEMM in place of the fused kernel
#   bench-graphs  10        -   forward_bench --gpu-graphs 1024: FP32, the shapes of at most
#                               1024 rows (all but the large one) replaying CUDA graphs
#   torch-fp32    30       60   torch_attention.py (PyTorch SDPA + linear projections)
#   torch-tf32    25        -   torch_attention.py --tf32
#   torch-bf16    25        -   torch_attention.py --bf16 (SDPA's flash kernel, BF16 weights)
#   table-fp32     5       10   compare.py: ours against torch, FP32
#   table-tf32     5        -   compare.py: ours against torch, TF32
#   table-bf16     5        -   compare.py: ours against torch, BF16
#   (sum)        575      660
#
# The BF16 rows (issue 48, item 2) took their 25 from the others in proportion: the build keeps
# over 2.5 times the H200's 57-61 s (158 s of the default budget), every other step about 96 %
# of its former share. The graphs row (bench-graphs) took its 10 the same way: the build keeps
# 155 s.
#
# A step may run for its own share plus whatever the steps before it left unused, never into the
# shares of the steps after it: its limit is the time left minus the shares of the steps still to
# come, so a slow build cannot starve the benchmark, and a build that finishes early gives the
# tests more time. A step cut at its limit says so; a cut build keeps what it compiled, so the
# same command again goes on from there (on a machine that keeps build-gpu/), and a rerun with
# ATTNSERVE_GPU_CHECK_STEPS=tests,sanitizer,bench,torch skips the build altogether. Without a GPU
# the 2-core development machine needs far more than 570 s for the build: set the budget to fit
# (ATTNSERVE_GPU_CHECK_BUDGET_S=3600).
#
# Without a GPU (no nvidia-smi, or it lists none) it runs the half that needs none: the same
# core-only build (with the CUDA backend when nvcc is present), the unit tests — the CUDA
# backend's sources run over the host emulation of CUDA (tests/cuda_emulation), the real-device
# instances skip —, and the benchmark and PyTorch peer (FP32) on the CPU.
#
# tests/deploy/gpu_check_test.py runs this script over stub tools (no GPU, no compiler): the order
# of the steps, the summary's lines, the budget, failures, missing tools, the TF32 peer.
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

budget=${ATTNSERVE_GPU_CHECK_BUDGET_S:-570}
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu-check.sh: ATTNSERVE_GPU_CHECK_BUDGET_S=$budget is not a number of seconds" >&2; exit 2; }
steps=",${ATTNSERVE_GPU_CHECK_STEPS:-build,tests,sanitizer,bench,torch},"
for step in ${steps//,/ }; do
  case $step in
    build | tests | sanitizer | bench | torch) ;;
    *) echo "gpu-check.sh: unknown step '$step' in ATTNSERVE_GPU_CHECK_STEPS (build,tests,sanitizer,bench,torch)" >&2; exit 2 ;;
  esac
done
want() { [[ $steps == *",$1,"* ]]; }
min_time=()
if [[ -n ${ATTNSERVE_GPU_CHECK_MIN_TIME_S:-} ]]; then min_time=(--min-time-s "$ATTNSERVE_GPU_CHECK_MIN_TIME_S"); fi

out=${OUT:-build-gpu/out}
mkdir -p "$out"
: > "$out/summary.txt"
log() { echo "== [${SECONDS}s] $*" | tee -a "$out/summary.txt"; }

status=0     # 1 once a step failed
cut=()       # the steps stopped at their time limit
finished=0
tarball="gpu-check.tar.gz"
# pack: every file under $out, this summary with its `done:` line included, into $out/$tarball:
# the one file to bring back from the machine.
pack() {
  if ! command -v tar >/dev/null 2>&1; then
    echo "gpu-check.sh: no tar: the outputs stay as files under $out" >&2
    return 0
  fi
  rm -f "$out/$tarball"
  (cd "$out" && tar -czf "$tarball.part" --exclude="$tarball.part" -- *) >/dev/null 2>&1 &&
    mv "$out/$tarball.part" "$out/$tarball" || echo "gpu-check.sh: could not pack $out into $tarball" >&2
}
# Whatever ends the script, the summary's last line says how it went, and the outputs are packed.
# shellcheck disable=SC2317  # run by the EXIT trap
on_exit() {
  local rc=$?
  if ((!finished)); then
    log "done: FAILED in ${SECONDS}s (budget ${budget}s): the script stopped early (exit $rc)"
    pack
  fi
}
trap on_exit EXIT
finish() {
  local verdict=passed
  ((status == 0)) || verdict=FAILED
  log "outputs: $out/$tarball (every file of $out, this summary included)"
  log "done: $verdict in ${SECONDS}s (budget ${budget}s)${cut[*]:+; cut short: ${cut[*]}}"
  finished=1
  pack
  exit "$status"
}
# stop MESSAGE: a condition no later step can run without (no compiler, no Eigen).
stop() {
  log "$*"
  status=1
  finish
}

# --- the tools -------------------------------------------------------------------------------
# `command -v` alone, and a tool's output read whole (never through `grep -q` or `head`, whose
# early exit would make the writer's SIGPIPE the pipeline's status under pipefail).
have() { command -v "$1" >/dev/null 2>&1; }
cuda_bin=${CUDA_HOME:-/usr/local/cuda}/bin
# find_cuda_tool NAME: its path on PATH or in $CUDA_HOME/bin, or nothing.
find_cuda_tool() {
  if have "$1"; then
    command -v "$1"
  elif [[ -x $cuda_bin/$1 ]]; then
    echo "$cuda_bin/$1"
  fi
}
have_timeout=1
if ! have timeout; then
  have_timeout=0
  log "no 'timeout' command: steps run without their time limits"
fi
python=${PYTHON:-python3}
have_python=1
if ! have "$python"; then
  have_python=0
  log "no $python: no PyTorch peer and no comparison tables (the JSON files hold the figures)"
fi

gpu=0
if have nvidia-smi; then
  gpu_list=$(nvidia-smi -L 2>/dev/null || true)
  if [[ $gpu_list == GPU* || $gpu_list == *$'\nGPU'* ]]; then
    gpu=1
  else
    log "nvidia-smi lists no GPU"
  fi
else
  log "no nvidia-smi on PATH: taken as a machine without a GPU"
fi
if ((gpu)); then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv > "$out/gpu.txt" 2>&1 || true
  gpus=$(tail -n +2 "$out/gpu.txt" || true)
  log "GPU: ${gpus//$'\n'/; }"
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true)
  cap=${caps%%$'\n'*}
  cap=${cap//[. ]/}
  [[ $cap =~ ^[0-9]+$ ]] || cap=90
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_CUDA_ARCHITECTURES="${ATTNSERVE_CUDA_ARCH:-$cap}")
else
  log "no NVIDIA GPU here: build, unit tests (CUDA emulated on the CPU) and the CPU benchmark only"
  args=(-DATTNSERVE_CORE_ONLY=ON -DATTNSERVE_CUDA=AUTO -DCMAKE_BUILD_TYPE=Release)
fi
nvcc=$(find_cuda_tool nvcc)
sanitizer=$(find_cuda_tool compute-sanitizer)
{
  for tool in nvidia-smi "$nvcc" cmake c++ ninja ctest "$sanitizer"; do
    [[ -n $tool ]] && have "$tool" && { echo "## $tool"; "$tool" --version 2>&1 || true; }
  done
  echo "## $python"
  "$python" --version 2>&1 || true
} > "$out/tools.txt" 2>&1 || true

if want build; then
  for tool in cmake c++; do
    have "$tool" || stop "no $tool on PATH: nothing can be built"
  done
  if [[ -n $nvcc ]]; then
    # CMake looks for nvcc on PATH only: one found in $CUDA_HOME/bin is named to it.
    args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
    log "nvcc: $nvcc"
  elif ((gpu)); then
    stop "no nvcc (not on PATH, not in $cuda_bin): the CUDA backend cannot be built on this GPU machine"
  else
    log "no nvcc: the build leaves the CUDA backend out (the emulated one is built all the same)"
  fi
  gen=()
  if have ninja; then gen=(-G Ninja); else log "no ninja: CMake's default generator"; fi
  carried=${ATTNSERVE_GPU_CHECK_CARRIED:-0}
  if [[ $carried == 1 || ! -d /usr/include/eigen3 ]]; then
    [[ -d $carry/eigen3 ]] || stop "no Eigen: neither /usr/include/eigen3 nor $carry/eigen3 (scripts/gpu-check.sh --prepare)"
    args+=(-DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON -DATTNSERVE_EIGEN_INCLUDE_DIR="$PWD/$carry/eigen3")
  fi
  if [[ $carried == 1 || ( ! -d /usr/src/googletest && ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ) ]]; then
    [[ -d $carry/googletest ]] || stop "no GoogleTest: neither Debian's package nor $carry/googletest (--prepare)"
    args+=(-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DATTNSERVE_GTEST_SOURCE_DIR="$PWD/$carry/googletest")
  fi
  if [[ $carried == 1 ]]; then args+=(-DATTNSERVE_ONEDNN=OFF); fi
fi
if want sanitizer && ((gpu)) && [[ -z $sanitizer ]]; then
  log "compute-sanitizer not found (not on PATH, not in $cuda_bin): memcheck/racecheck/synccheck not run"
fi

# --- the plan --------------------------------------------------------------------------------
declare -A weight=() share=()
plan=()
plan_add() { plan+=("$1"); weight[$1]=$2; }
if ((gpu)); then
  if want build; then plan_add configure 30; plan_add build 165; fi
  if want tests; then plan_add tests 80; fi
  if want sanitizer && [[ -n $sanitizer ]]; then plan_add memcheck 40; plan_add racecheck 35; plan_add synccheck 25; fi
  if want bench; then
    plan_add bench-fp32 30; plan_add bench-tf32 25; plan_add bench-bf16 20; plan_add bench-gemm-attention 20
    plan_add bench-graphs 10
  fi
  if want torch && ((have_python)); then plan_add torch-fp32 30; plan_add torch-tf32 25; plan_add torch-bf16 25; fi
  if { want bench || want torch; } && ((have_python)); then
    plan_add table-fp32 5; plan_add table-tf32 5; plan_add table-bf16 5
  fi
else
  if want build; then plan_add configure 30; plan_add build 300; fi
  if want tests; then plan_add tests 200; fi
  if want bench; then plan_add bench-fp32 60; fi
  if want torch && ((have_python)); then plan_add torch-fp32 60; fi
  if { want bench || want torch; } && ((have_python)); then plan_add table-fp32 10; fi
fi
usable=$((budget * 95 / 100))
total=0
for step in "${plan[@]}"; do total=$((total + weight[$step])); done
line=""
for step in "${plan[@]}"; do
  share[$step]=$((usable * weight[$step] / (total > 0 ? total : 1)))
  line+=" $step ${share[$step]}s,"
done
log "plan (budget ${budget}s, ${usable}s shared):${line%,}"

# unplan STEP: a step that will not run after all gives its share to the others.
unplan() {
  local step kept=()
  for step in "${plan[@]}"; do
    if [[ $step != "$1" ]]; then kept+=("$step"); fi
  done
  plan=("${kept[@]}")
}
# limit STEP: the seconds STEP may run: the time left less the shares of the planned steps after it.
limit() {
  local step after=0 reserve=0 room
  for step in "${plan[@]}"; do
    if ((after)); then reserve=$((reserve + share[$step])); fi
    if [[ $step == "$1" ]]; then after=1; fi
  done
  room=$((budget - SECONDS - reserve))
  echo $((room > 0 ? room : 0))
}
# bounded SECONDS COMMAND...: the command, stopped after SECONDS (exit 124; 137 when it ignored
# SIGTERM for 5 s more) where `timeout` exists; without it the command runs unbounded. With no
# second left it does not start (`timeout 0` would mean no limit at all).
bounded() {
  local secs=$1
  shift
  if ((secs < 1)); then
    echo "gpu-check.sh: no time left in the budget for: $*"
    return 124
  fi
  if ((have_timeout)); then timeout --kill-after=5 "$secs" "$@"; else "$@"; fi
}
# begin STEP DESCRIPTION: the step's first line; its limit in $secs. False (and the step's line
# says it is skipped) when the budget has no second left for it.
begin() {
  step_start=$SECONDS
  secs=$(limit "$1")
  if ((secs < 1)); then
    log "$1: skipped, no time left in the budget (${secs}s)"
    status=1
    cut+=("$1")
    return 1
  fi
  log "$1: $2 (limit ${secs}s)"
}
# result STEP RC: the step's last line: passed, cut at its limit, or FAILED.
result() {
  local took=$((SECONDS - step_start))
  if (($2 == 0)); then
    log "$1: passed in ${took}s"
  elif (($2 == 124 || $2 == 137)); then
    log "$1: cut at its limit of ${secs}s (exit $2)"
    cut+=("$1")
    status=1
  else
    log "$1: FAILED (exit $2) in ${took}s"
    status=1
  fi
}
# notrun STEP WHY: a step that cannot run here; a failure unless `ok` follows.
notrun() {
  log "$1: not run, $2"
  if [[ ${3:-} != ok ]]; then status=1; fi
}

# --- configure and build ---------------------------------------------------------------------
if want build; then
  if begin configure "cmake ${gen[*]} ${args[*]}"; then
    rc=0
    bounded "$secs" cmake -S . -B build-gpu "${gen[@]}" "${args[@]}" > "$out/configure.txt" 2>&1 || rc=$?
    result configure "$rc"
    if ((rc)); then tail -30 "$out/configure.txt" | tee -a "$out/summary.txt" || true; fi
  fi
  if [[ ! -f build-gpu/CMakeCache.txt ]]; then
    notrun build "no configured build-gpu/"
  elif begin build "first backend_test, the CUDA plugin and forward_bench, then everything (-j$(nproc))"; then
    first=(backend_test forward_bench)
    if ((gpu)); then first+=(attnserve_cuda_plugin); fi
    rc=0
    {
      bounded "$secs" cmake --build build-gpu -j"$(nproc)" --target "${first[@]}" &&
        bounded "$(limit build)" cmake --build build-gpu -j"$(nproc)"
    } > "$out/build.txt" 2>&1 || rc=$?
    result build "$rc"
    if ((rc == 124 || rc == 137)); then
      log "build: what it compiled is kept in build-gpu/: the same command again goes on from there"
    elif ((rc)); then
      grep -E "error|Error" -A5 "$out/build.txt" > "$out/build-errors.txt" 2>&1 || true
      head -60 "$out/build-errors.txt" | tee -a "$out/summary.txt" || true
    fi
    if ((rc)); then log "the steps below run what build-gpu/ holds: binaries the build did not finish are missing or older"; fi
  fi
fi

# --- unit tests ------------------------------------------------------------------------------
if want tests; then
  if ! have ctest; then
    notrun tests "no ctest on PATH"
  elif [[ ! -f build-gpu/CTestTestfile.cmake ]]; then
    notrun tests "build-gpu/ has no tests (run the build step)"
  elif begin tests "ctest -L unit$( ((gpu)) && echo ', CUDA backends required, the emulated suite left out' || echo ', the CUDA backend emulated')"; then
    # A binary the build did not make shows in ctest as NAME_NOT_BUILT, without the unit label:
    # -L unit alone would pass over it in silence. (On a GPU the emulated suite is not run.)
    listing=$(ctest --test-dir build-gpu -N 2>/dev/null || true)
    missing=()
    while read -r word; do
      if [[ -n $word && ! ( $gpu == 1 && $word == cuda_emulated_test_NOT_BUILT ) ]]; then
        missing+=("${word%_NOT_BUILT}")
      fi
    done < <(grep -oE '[A-Za-z0-9_.]+_NOT_BUILT' <<< "$listing" || true)
    rc=0
    if ((gpu)); then
      # The real-device instances are required: one that skips (no device, no plugin) fails.
      # The emulated tests are left out: they ran where the emulation is the only device.
      ATTNSERVE_REQUIRE_BACKENDS=cuda,cuda-tf32 bounded "$secs" ctest --test-dir build-gpu -L unit -E '^emulated\.' \
        -j"$(nproc)" --timeout $((secs < 200 ? secs : 200)) --output-on-failure > "$out/tests.txt" 2>&1 || rc=$?
    else
      bounded "$secs" ctest --test-dir build-gpu -L unit -j"$(nproc)" --timeout $((secs < 400 ? secs : 400)) \
        --output-on-failure > "$out/tests.txt" 2>&1 || rc=$?
    fi
    grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run" "$out/tests.txt" | tee -a "$out/summary.txt" || true
    grep -E "worst relative" "$out/tests.txt" | tee -a "$out/summary.txt" || true
    if ((${#missing[@]})); then
      log "tests: not built, so not run: ${missing[*]}"
      if ((rc == 0)); then rc=1; fi
    fi
    result tests "$rc"
  fi
fi

# --- compute-sanitizer -----------------------------------------------------------------------
# compute-sanitizer sees what the emulation cannot: out-of-bounds device accesses, races between
# threads of a block, missing synchronisation. Over the `cuda` instances of the backend suite at
# small shapes (4 random cases, no long sequences, no large batch: instrumented kernels run
# 10–100 times slower), each tool within its share of the budget; a report fails the check, a
# tool cut at its limit is not a finding (the summary says it was cut).
# compute-sanitizer that refuses to run on this host (no gtest output at all, and its own
# error line: a device it does not support, no permission for its injection, a driver it does not
# match) did not test anything: that tool and the ones after it are "not run", not FAILED.
refused=""
if want sanitizer && ((gpu)) && [[ -n $sanitizer ]]; then
  for tool in memcheck racecheck synccheck; do
    if [[ ! -x build-gpu/tests/backend_test ]]; then
      notrun "$tool" "build-gpu/ has no tests/backend_test"
      continue
    fi
    if [[ -n $refused ]]; then
      notrun "$tool" "compute-sanitizer refused to run on this host ($refused)" ok
      unplan "$tool"
      continue
    fi
    begin "$tool" "compute-sanitizer --tool $tool, backend_test's cuda instances at small shapes" || continue
    rc=0
    ATTNSERVE_REQUIRE_BACKENDS=cuda ATTNSERVE_RANDOM_CASES=4 bounded "$secs" "$sanitizer" --tool "$tool" \
      --error-exitcode 86 build-gpu/tests/backend_test \
      --gtest_filter='Backends/BackendTest.*/cuda:-*LargeRagged*:*LongSequences*' \
      > "$out/sanitizer-$tool.txt" 2>&1 || rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|Hazard|PASSED|FAILED" "$out/sanitizer-$tool.txt" \
      > "$out/sanitizer-$tool-lines.txt" 2>&1 || true
    tail -20 "$out/sanitizer-$tool-lines.txt" | tee -a "$out/summary.txt" || true
    why=""
    if ((rc != 0 && rc != 86 && rc != 124 && rc != 137)) && ! grep -q -F '[==========]' "$out/sanitizer-$tool.txt"; then
      why=$(grep -m1 -E '^========= (Internal Sanitizer Error|Error)' "$out/sanitizer-$tool.txt" || true)
    fi
    if [[ -n $why ]]; then
      refused="${why#========= }, exit $rc"
      notrun "$tool" "compute-sanitizer refused to run on this host ($refused)" ok
    elif ((rc == 124 || rc == 137)); then
      log "$tool: cut at its limit of ${secs}s (exit $rc): not a finding, but not a full run either"
      cut+=("$tool")
    else
      result "$tool" "$rc"
    fi
  done
elif want sanitizer && ((!gpu)); then
  log "sanitizer: not run, no GPU (compute-sanitizer needs a device)"
fi

# --- benchmark -------------------------------------------------------------------------------
# On a GPU every shape, the large one included. On the CPU the large one would take minutes, and
# both sides use every core (the peer table pairs rows by shape, not by thread count).
device=cpu shapes=bert-base,gpt2-medium,small-request threads=(--threads "$(nproc)")
if ((gpu)); then device=cuda shapes=bert-base,gpt2-medium,small-request,large threads=(); fi
# bench STEP JSON [--tf32]: forward_bench, both forms, into $out/JSON.
bench() {
  local step=$1 json=$2 rc=0
  shift 2
  if [[ ! -x build-gpu/bench/forward_bench ]]; then
    notrun "$step" "build-gpu/ has no bench/forward_bench"
    return 0
  fi
  begin "$step" "forward_bench --device $device${*:+ $*} ($shapes)" || return 0
  rm -f "$out/$json" "$out/$step.txt"
  bounded "$secs" build-gpu/bench/forward_bench --device "$device" "$@" --shapes "$shapes" "${threads[@]}" \
    "${min_time[@]}" --json "$out/$json" 2>&1 | tee -a "$out/summary.txt" "$out/$step.txt" || rc=$?
  result "$step" "$rc"
}
# On a GPU the FP32 run sets the backend's 4 MiB copy slices beside one copy each way (a slice
# past every batch), each packed by 1 and by 4 host threads, in one run: forward_bench's split
# table shows what each buys.
if want bench; then
  if ((gpu)); then
    bench bench-fp32 "$device.json" --staging-slice-kib 4096,1048576 --staging-threads 1,4
    bench bench-tf32 cuda-tf32.json --tf32
    bench bench-bf16 cuda-bf16.json --gpu-math bf16
    bench bench-gemm-attention cuda-gemm-attention.json --gemm-attention
    # The large shape (16384 rows) has no graph: left out, the row fits its share.
    shapes=bert-base,gpt2-medium,small-request bench bench-graphs cuda-graphs.json --gpu-graphs 1024
  else
    bench bench-fp32 "$device.json"
  fi
fi

# --- PyTorch ---------------------------------------------------------------------------------
# peer STEP JSON [--tf32]: torch_attention.py into $out/JSON. Exit 3 from it: no torch, or no
# CUDA in this interpreter: no peer column (not a failure of attnserve's), and no TF32 run.
torch_missing=0
peer() {
  local step=$1 json=$2 rc=0
  shift 2
  if ((torch_missing)); then
    notrun "$step" "PyTorch not available to $python" ok
    return 0
  fi
  begin "$step" "torch_attention.py --device $device${*:+ $*} ($shapes)" || return 0
  rm -f "$out/$json" "$out/$step.txt"
  bounded "$secs" "$python" bench/peers/torch_attention.py --device "$device" "$@" --shapes "$shapes" \
    "${threads[@]}" "${min_time[@]}" --json "$out/$json" 2>&1 | tee -a "$out/summary.txt" "$out/$step.txt" || rc=$?
  if ((rc == 3)); then
    torch_missing=1
    unplan torch-tf32
    unplan torch-bf16
    log "$step: not run, PyTorch ($device) not available to $python: no peer column"
    rm -f "$out/$json"
  else
    result "$step" "$rc"
  fi
}
if want torch && ((have_python)); then
  peer torch-fp32 torch.json
  if ((gpu)); then
    peer torch-tf32 torch-tf32.json --tf32
    peer torch-bf16 torch-bf16.json --bf16
  fi
fi

# --- tables ----------------------------------------------------------------------------------
# table NAME OURS PEER: compare.py's table of our JSON against the peer's of the same precision
# (the peer column empty where there is no peer JSON).
table() {
  local name=$1 ours=$2 theirs=$3 rc=0 peer_json=()
  [[ -f $out/$ours ]] || { log "$name: not run, no $ours"; return 0; }
  if [[ -f $out/$theirs ]]; then peer_json=("$out/$theirs"); fi
  begin "$name" "compare.py $ours ${peer_json[*]:-(no peer)}" || return 0
  rm -f "$out/$name.txt"
  bounded "$secs" "$python" bench/peers/compare.py "$out/$ours" "${peer_json[@]}" 2>&1 |
    tee -a "$out/summary.txt" "$out/$name.txt" || rc=$?
  result "$name" "$rc"
}
if { want bench || want torch; } && ((have_python)); then
  table table-fp32 "$device.json" torch.json
  if ((gpu)); then
    table table-tf32 cuda-tf32.json torch-tf32.json
    table table-bf16 cuda-bf16.json torch-bf16.json
  fi
fi

finish
