#!/usr/bin/env bash
# The dynamic batcher's load benchmark: batch-1, n = m = 16 requests to the 12-head, d = 768 demo
# layer at concurrency 1, 8 and 32, against the real server over loopback with batching on
# (the defaults) and off (--max-batch-requests 1), in one run. Prints requests/s and client
# p50/p99 per setting and the on/off ratios.
#
#   bench/batching.sh [BUILD_DIR] [DURATION]     (defaults: build, 5s)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
duration=${2:-5s}
server_bin=$build/server/attnserve
cli=${ATTNSERVE_CLI:-$build/client/attnserve-cli}
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

run_mode() {  # NAME FLAGS...
  local name=$1; shift
  "$server_bin" --listen 127.0.0.1:0 --port-file "$out/$name.port" --log-level warn "$@" &
  local pid=$!
  for _ in $(seq 100); do [[ -s "$out/$name.port" ]] && break; sleep 0.1; done
  local target="127.0.0.1:$(cat "$out/$name.port")"
  "$cli" --target "$target" bench --layer demo --forms factored --shape 1,16 --concurrency 1,8,32 \
    --duration "$duration" --warmup 1s --json "$out/$name.json" > "$out/$name.txt"
  kill -TERM "$pid"; wait "$pid" || true
}

run_mode on ${ATTNSERVE_BATCH_FLAGS:-}
run_mode off --max-batch-requests 1

python3 - "$out/on.json" "$out/off.json" <<'PY'
import json, sys
on = {r["concurrency"]: r for r in json.load(open(sys.argv[1]))}
off = {r["concurrency"]: r for r in json.load(open(sys.argv[2]))}
print(f"{'C':>3} {'batching':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'avg batch':>9}")
for c in sorted(on):
    for name, r in (("on", on[c]), ("off", off[c])):
        print(f"{c:>3} {name:>9} {r['requests_per_s']:9.1f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['batch_requests']:9.2f}")
for c in sorted(on):
    print(f"C={c}: throughput on/off = {on[c]['requests_per_s'] / off[c]['requests_per_s']:.2f}x, "
          f"p50 on/off = {on[c]['p50_ms'] / off[c]['p50_ms']:.2f}x")
PY
