#!/usr/bin/env bash
# The serving overhead of one small request, measured in one run (docs/journal/benchmarks-journal.md, "Serving
# overhead"): for the 1×16×768 demo request at concurrency 1, factored form,
#   served     attnserve-cli bench's p50 against a real attnserve on loopback,
#   in-process forward_bench's median of the same forward, in a loop, same thread count,
#   floor      attnserve-cli bench's p50 against its in-process no-op server (gRPC and the
#              client, nothing computed),
# and overhead = served − in-process − floor: what the server adds beyond its compute and
# gRPC's own cost. Each round measures all three (each server variant, the in-process forward
# just before the first one's measured run, then the floor) within seconds of each other, and
# the figure is the median over ROUNDS rounds of each round's own difference: the machine is
# shared, and what it gives drifts by more than the target between minutes, so the three are
# compared where they were measured together.
# The best (lowest) p50 of each over the rounds is printed too, as earlier runs reported it.
# So is served − the server's own compute stage − floor: the serving path without the forward.
# The server's stage histogram (attnserve_stage_seconds, scraped before and after each
# measured run) gives the stage table of the median round: where a served call's time goes.
# A second client, Python grpcio (bench/serving_client.py), measures served and floor in each
# round too, against the first variant's server and `attnserve-cli noop-server`, in bursts that
# alternate between the two: its overhead is its cycles' served − floor less the round's
# in-process forward, and, free of that figure, its cycles' served − the answers' compute_us −
# floor (the serving path without the forward); the medians over the rounds of each.
#   The in-process forward is measured a second way too: with IDLE_US (default 300) of sleep
# before each timed call (forward_bench --idle-us), about the pause a server has between one
# lone client's requests. On a host whose L3 is shared, the weights (9.4 MB here) go cold in that
# pause; the difference between the two in-process figures is that cost, not the server's.
#   Then the three figures interleaved in bursts (bench/overhead_probe.cc, PROBES runs of
# PROBE_CYCLES cycles): each cycle a burst of calls to the first variant's server, the same
# forward in the probe's own process and `attnserve-cli noop-server`, milliseconds apart, so that
# the drift between moments cancels within a cycle. (The probe's own backend takes THREADS and
# WEIGHT_LAYOUT, the rest of the server's defaults: against a variant with other CPU flags its
# in-process figure is not that variant's.)
#   Then concurrency 32 against the first variant's server: achieved GFLOP/s (requests/s times
# the request's FLOPs) against the best SGEMM ceiling forward_bench measured before and after.
#
#   bench/serving_overhead.sh [BUILD_DIR] [ROUNDS]     (default build, 8; THREADS=2; PROBES=5,
#                                                       PROBE_CYCLES=80)
#   WEIGHT_LAYOUT=packed-bf16   the CPU backend's weight layout, in process and in every server
#   (--cpu-weight-layout; default auto)
#   VARIANTS="defaults: nospin:--worker-idle-spin-us,0"   server variants to compare (default:
#   "defaults:"); each NAME:FLAGS, the flags joined by commas, a VAR=VALUE among them set in
#   the server's environment instead
# Output: Markdown tables on stdout; the raw JSON under BUILD_DIR/serving-out.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-8}
THREADS=${THREADS:-2}
DURATION=${DURATION:-4s}
IDLE_US=${IDLE_US:-300}
VARIANTS=${VARIANTS:-"defaults:"}
WEIGHT_LAYOUT=${WEIGHT_LAYOUT:-auto}
OUT=$BUILD/serving-out
CLI=$BUILD/client/attnserve-cli
rm -rf "$OUT" && mkdir -p "$OUT"
PROBES=${PROBES:-5}
PROBE_CYCLES=${PROBE_CYCLES:-80}
for bin in "$BUILD/bench/forward_bench" "$BUILD/bench/overhead_probe" "$BUILD/server/attnserve" "$CLI"; do
  [[ -x $bin ]] || { echo "serving_overhead.sh: $bin is missing; build it first" >&2; exit 2; }
done

pid= noop=
stop_server() { [[ -n $pid ]] && { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; }; pid=; }
stop_noop() { [[ -n $noop ]] && { kill "$noop" 2>/dev/null; wait "$noop" 2>/dev/null || true; }; noop=; }
trap 'stop_server; stop_noop' EXIT

# Starts attnserve with the demo layer and FLAGS (a VAR=VALUE among them goes to its
# environment instead, e.g. OMP_WAIT_POLICY=active); sets target and metrics.
start_server() {
  rm -f "$OUT/port" "$OUT/metrics-port"
  local env=() flags=()
  for f in "$@"; do [[ $f != -* && $f == *=* ]] && env+=("$f") || flags+=("$f"); done
  set -- "${flags[@]}"
  env "${env[@]}" "$BUILD/server/attnserve" --listen 127.0.0.1:0 --port-file "$OUT/port" --threads "$THREADS" \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$OUT/metrics-port" \
    --layer demo=random:d_model=768,heads=12,seed=1 --cpu-weight-layout "$WEIGHT_LAYOUT" --log-level warn \
    "$@" &
  pid=$!
  for _ in $(seq 1 300); do [[ -s $OUT/port && -s $OUT/metrics-port ]] && break; sleep 0.1; done
  target="127.0.0.1:$(cat "$OUT/port")"
  metrics="http://127.0.0.1:$(cat "$OUT/metrics-port")/metrics"
  for _ in $(seq 1 100); do "$CLI" --target "$target" health >/dev/null 2>&1 && break; sleep 0.1; done
}

scrape() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$metrics"; }

bench() {  # NAME CONCURRENCY [EXTRA...]: one measured bench run against $target
  local name=$1 concurrency=$2; shift 2
  "$CLI" --target "$target" bench --layer demo --forms factored --shape 1,16 --concurrency "$concurrency" \
    --duration "$DURATION" --warmup 1s --json "$OUT/$name.json" "$@" >/dev/null
}

echo "== machine: $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads, weights $WEIGHT_LAYOUT," \
  "$(date -u +%F)"
in_process() {
  "$BUILD/bench/forward_bench" --threads "$THREADS" --shapes small-request --weight-layout "$WEIGHT_LAYOUT" "$@"
}
in_process --json "$OUT/inprocess.json" >/dev/null
# `attnserve-cli noop-server`, the floor of the second client and of the probe, idle between
# their turns; long enough for every round; the EXIT trap stops it sooner.
rm -f "$OUT/noop-port"
"$CLI" noop-server --port-file "$OUT/noop-port" --duration "$((ROUNDS * 60 + 600))s" >/dev/null &
noop=$!
for _ in $(seq 1 100); do [[ -s $OUT/noop-port ]] && break; sleep 0.1; done
# The second, independent client (Python grpcio, stubs from our proto) runs in every round too,
# against the first variant's server and the no-op server.
python_client=0
if /usr/bin/python3 -c 'import grpc, google.protobuf, numpy' 2>/dev/null; then
  python_client=1
else
  echo "(no python3-grpcio: the second client's check is skipped)" >&2
fi
for round in $(seq 1 "$ROUNDS"); do
  first_of_round=1
  for variant in $VARIANTS; do
    name=${variant%%:*}
    IFS=, read -r -a flags <<< "${variant#*:}"
    start_server "${flags[@]}"
    # A short run first: the scrape after it is the baseline the measured run is taken from.
    "$CLI" --target "$target" bench --layer demo --forms factored --shape 1,16 --concurrency 1 \
      --duration 1s --warmup 0s >/dev/null
    if ((first_of_round)); then
      # This round's in-process figures, back to back and paused, a second before the served
      # run (the server idle meanwhile): each round's overhead is taken against the compute the
      # machine gave then, not in another minute. No ceiling here: the forwards alone.
      in_process --forms factored --no-ceiling --json "$OUT/inprocess-$round.json" >/dev/null
      in_process --forms factored --no-ceiling --idle-us "$IDLE_US" --json "$OUT/inprocess-idle-$round.json" >/dev/null
      first_of_round=0
    fi
    scrape > "$OUT/$name-$round.before.prom"
    bench "$name-$round" 1
    scrape > "$OUT/$name-$round.after.prom"
    if ((python_client)) && [[ $name == "${VARIANTS%%:*}" ]]; then
      /usr/bin/python3 bench/serving_client.py --target "floor=127.0.0.1:$(cat "$OUT/noop-port")" \
        --target "served=$target" --requests "${PY_REQUESTS:-600}" --warmup 100 \
        --json "$OUT/python-$round.json" >/dev/null
    fi
    stop_server
  done
  "$CLI" bench --noop-server --forms factored --shape 1,16 --concurrency 1 --duration "$DURATION" \
    --warmup 1s --json "$OUT/floor-$round.json" >/dev/null
done
# The probe, then concurrency 32, against the first variant's server.
first=${VARIANTS%% *}
IFS=, read -r -a flags <<< "${first#*:}"
start_server "${flags[@]}"
for probe in $(seq 1 "$PROBES"); do
  "$BUILD/bench/overhead_probe" --target "$target" --floor "127.0.0.1:$(cat "$OUT/noop-port")" --threads "$THREADS" \
    --weight-layout "$WEIGHT_LAYOUT" --cycles "$PROBE_CYCLES" --json "$OUT/probe-$probe.json" >/dev/null
done
bench "c32" 32
scrape > "$OUT/c32.after.prom"
stop_server
stop_noop
in_process --json "$OUT/inprocess-after.json" >/dev/null

python3 bench/serving_report.py "$OUT" "$ROUNDS" "$PROBES" $VARIANTS
