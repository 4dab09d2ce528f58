#!/usr/bin/env bash
# On any CPU: every CPU figure docs/benchmarks.md records, in one run, into OUT, with the CPU
# named first. It is the CPU's counterpart of scripts/gpu-check.sh, so that a machine of another
# kind (an Intel Xeon with AVX512_BF16 and AVX512_FP16, where issue 51's targets are set) is
# measured the way the AMD machines were, step by step, without assembling the commands by hand:
#
#   cpu       the CPU: vendor, family and model, the vector extensions the kernels choose among,
#             the cores the run may use (cpu.txt; every table below comes from this CPU)
#   peers     bench/peers/run.sh quiet and beside one busy process (COMPETE=1): the factored form
#             against PyTorch and ONNX Runtime at bert-base, gpt2-medium and 1×16, each ratio
#             within a round, and the GEMM ceiling (peers-quiet.txt, peers-busy.txt: the run and its tables)
#   threads   the 1×16 request on one thread and on two, quiet and busy: what a second thread
#             buys each implementation and what a neighbour costs it (threads.txt)
#   bf16      the weight layouts (packed, packed-bf16, packed-bf16-dot, packed-fp16), alternated
#             round by round with PyTorch in float32 and in bfloat16 (autocast and weights held
#             in bf16): time and divergence from float64 (bf16-R.log, bf16-R.json, torch-bf16-R.*)
#   long      bench/long_sweep.sh: the tiled attention against torch-sdpa to 16384 tokens
#   serving   bench/serving_overhead.sh: a lone served request over gRPC's floor
#
#   setsid bash -c 'echo -19 > /proc/self/autogroup; exec nice -n -19 bench/cpu_check.sh [BUILD_DIR]'
#
# (the session given the priority, as docs/benchmarks.md's runs were). BUILD_DIR (default build)
# must hold attnserve, attnserve-cli, forward_bench and overhead_probe; PyTorch and ONNX Runtime
# come from the venv bench/peers/run.sh makes there on first use.
#
# Environment:
#   OUT                 the output folder (default BUILD_DIR/cpu-check)
#   CPU_CHECK_STEPS     a comma list of cpu,peers,threads,bf16,long,serving (default all)
#   ROUNDS              rounds of the peer and bf16 comparisons (default 3)
#   MIN_TIME_S          seconds each point is measured a round (default 0.3)
#   LONG_LENGTHS        the long sweep's lengths (default the sweep's own)
#   SERVING_ROUNDS      bench/serving_overhead.sh's rounds (default 6)
# About 50 minutes on 2 vCPUs. A failing step is reported and the later ones still run; the exit
# status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BUILD=${1:-build}
OUT=${OUT:-$BUILD/cpu-check}
STEPS=,${CPU_CHECK_STEPS:-cpu,peers,threads,bf16,long,serving},
ROUNDS=${ROUNDS:-3}
MIN_TIME_S=${MIN_TIME_S:-0.3}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "cpu_check: ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 2; }
for step in ${STEPS//,/ }; do
  [[ ,cpu,peers,threads,bf16,long,serving, == *,$step,* ]] ||
    { echo "cpu_check: CPU_CHECK_STEPS: unknown step '$step' (cpu,peers,threads,bf16,long,serving)" >&2; exit 2; }
done
for bin in bench/forward_bench bench/overhead_probe server/attnserve client/attnserve-cli; do
  [[ -x $BUILD/$bin ]] || { echo "cpu_check: $BUILD/$bin is missing; build it first (scripts/build $BUILD)" >&2; exit 2; }
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
failed=()

wanted() { [[ $STEPS == *,$1,* ]]; }
# Runs step $1's command, its output into OUT/$1.log; a failure is counted, not fatal.
step() {
  local name=$1
  shift
  echo "cpu_check: $name ($(date -u +%H:%M:%S))"
  if ! "$@" >"$OUT/$name.log" 2>&1; then
    failed+=("$name")
    echo "cpu_check: $name FAILED (the end of $OUT/$name.log):" && tail -5 "$OUT/$name.log"
  fi
}

describe_cpu() {
  grep -m1 '^vendor_id' /proc/cpuinfo
  grep -m1 '^model name' /proc/cpuinfo
  grep -m1 '^cpu family' /proc/cpuinfo
  grep -m1 '^model[[:space:]]*:' /proc/cpuinfo
  echo "cores this run may use: $(nproc)"
  echo "vector extensions: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
    grep -E '^(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx512_fp16|amx_bf16|amx_tile)$' |
    tr '\n' ' ')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown), date: $(date -u +%Y-%m-%d)"
}

peers() {  # quiet, then beside one busy process
  for compete in 0 1; do
    local name=quiet
    ((compete)) && name=busy
    COMPETE=$compete ROUNDS=$ROUNDS MIN_TIME_S=$MIN_TIME_S THREADS=2 bench/peers/run.sh "$BUILD" >"$OUT/peers-$name.txt" ||
      return 1
    cp -r "$BUILD/peers-out" "$OUT/peers-out-$name"
  done
}

# The steps that run PyTorch take it from the venv the peers step (bench/peers/run.sh) makes.
have_torch() {
  [[ -x $BUILD/peers-venv/bin/python ]] ||
    { echo "cpu_check: $BUILD/peers-venv is missing: run the peers step (or bench/peers/run.sh) first"; return 1; }
}

threads() {  # the 1×16 request, 1 and 2 threads, quiet and beside a busy loop
  have_torch || return 1
  local busy=
  for load in quiet busy; do
    if [[ $load == busy ]]; then
      (while :; do :; done) &
      busy=$!
    fi
    for t in 1 2; do
      echo "== $load, $t thread(s)"
      "$BUILD/bench/forward_bench" --shapes small-request --forms factored --threads "$t" --no-ceiling \
        --min-time-s 1.5 || { [[ -n $busy ]] && kill "$busy"; return 1; }
      "$BUILD/peers-venv/bin/python" bench/peers/cpu_peers.py --threads "$t" --shapes small-request \
        --min-time-s 1.5 || { [[ -n $busy ]] && kill "$busy"; return 1; }
    done
  done
  kill "$busy"
}

bf16() {  # ours in each layout, then PyTorch in float32 and bf16, ROUNDS times in turn
  have_torch || return 1
  for r in $(seq 1 "$ROUNDS"); do
    "$BUILD/bench/forward_bench" --threads 2 --shapes bert-base,gpt2-medium,small-request --forms factored \
      --weight-layout packed,packed-bf16,packed-bf16-dot,packed-fp16 --min-time-s "$MIN_TIME_S" \
      --json "$OUT/bf16-$r.json" >"$OUT/bf16-$r.log" 2>&1 || return 1
    "$BUILD/peers-venv/bin/python" bench/peers/cpu_peers.py --threads 2 --bf16 --min-time-s "$MIN_TIME_S" \
      --json "$OUT/torch-bf16-$r.json" >"$OUT/torch-bf16-$r.log" 2>&1 || return 1
  done
}

long() {  # its JSON and SVG copied beside the other steps' output
  bench/long_sweep.sh "$BUILD" 1 ${LONG_LENGTHS:+"$LONG_LENGTHS"} && cp -r "$BUILD/long-sweep" "$OUT/long-sweep"
}
serving() { bench/serving_overhead.sh "$BUILD" "${SERVING_ROUNDS:-6}" && cp -r "$BUILD/serving-out" "$OUT/serving-out"; }

if wanted cpu; then
  describe_cpu | tee "$OUT/cpu.txt"
fi
wanted peers && step peers peers
wanted threads && step threads threads
wanted bf16 && step bf16 bf16
wanted long && step long long
wanted serving && step serving serving

{
  describe_cpu
  echo
  for name in peers threads bf16 long serving; do
    wanted "$name" || continue
    if [[ " ${failed[*]} " == *" $name "* ]]; then echo "$name: FAILED ($OUT/$name.log)"; else echo "$name: done"; fi
  done
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
((${#failed[@]} == 0))
