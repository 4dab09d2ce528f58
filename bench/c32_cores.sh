#!/usr/bin/env bash
# Concurrency 32 with the CPU each process used (docs/journal/benchmarks-journal.md, "Serving overhead"): a
# local attnserve (THREADS compute threads, default 2) under attnserve-cli bench, 1×16×768
# factored requests; over 5 s of the measured load, the cores the server and the load generator
# used (utime + stime from /proc), the server's compute per batch and how busy its compute was
# (batches/s × compute per batch), and the GFLOP/s served and while computing.
#
#   bench/c32_cores.sh [BUILD_DIR]      (default build; THREADS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=$BUILD/c32-out
rm -rf "$OUT" && mkdir -p "$OUT"
CLI=$BUILD/client/attnserve-cli

"$BUILD/server/attnserve" --listen 127.0.0.1:0 --port-file "$OUT/port" --threads "${THREADS:-2}" \
  --layer demo=random:d_model=768,heads=12,seed=1 --log-level warn &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do [[ -s $OUT/port ]] && break; sleep 0.1; done
target="127.0.0.1:$(cat "$OUT/port")"
for _ in $(seq 1 100); do "$CLI" --target "$target" health >/dev/null 2>&1 && break; sleep 0.1; done

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
"$CLI" --target "$target" bench --layer demo --forms factored --shape 1,16 --concurrency 32 --duration 8s \
  --warmup 2s --json "$OUT/c32.json" >/dev/null &
client=$!
sleep 3.5  # past the warmup
s0=$(ticks "$server") c0=$(ticks "$client") t0=$(date +%s.%N)
sleep 5
s1=$(ticks "$server") c1=$(ticks "$client") t1=$(date +%s.%N)
wait "$client"

python3 - "$s0" "$s1" "$c0" "$c1" "$t0" "$t1" "$(getconf CLK_TCK)" "$OUT/c32.json" <<'PY'
import json
import sys

s0, s1, c0, c1, t0, t1, hz = map(float, sys.argv[1:8])
wall = t1 - t0
r = next(x for x in json.load(open(sys.argv[8])) if x["form"] == "factored")
flops = 2 * 16 * 768 * (3 * 768) + 2 * 2 * 16 * 16 * 768 + 2 * 16 * 768 * 768  # one request, factored
batches = r["requests_per_s"] / r["batch_requests"]
print(f"server cores {(s1 - s0) / hz / wall:.2f}, load generator cores {(c1 - c0) / hz / wall:.2f}, "
      f"requests/s {r['requests_per_s']:.0f}, batch {r['batch_requests']:.1f} requests, "
      f"compute per batch {r['compute_us'] / 1e3:.2f} ms, compute busy {batches * r['compute_us'] / 1e6:.2f}, "
      f"{r['requests_per_s'] * flops / 1e9:.1f} GFLOP/s served, "
      f"{r['batch_requests'] * flops / r['compute_us'] / 1e3:.1f} GFLOP/s while computing")
PY
