#!/usr/bin/env bash
# The long-sequence sweep against torch-sdpa, taken in turn so that both sides meet the same
# machine (docs/journal/benchmarks-journal.md, "Long sequences"): forward_bench --sweep long and
# bench/peers/long_sdpa.py alternate REPEATS times, then bench/long_report.py keeps each point's
# fastest time, prints the table and writes the SVG.
#
#   bench/long_sweep.sh [BUILD_DIR [REPEATS [LENGTHS]]]     (default: build 2 512,2048,8192,16384)
#
# torch comes from the venv bench/peers/run.sh makes (BUILD_DIR/peers-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
repeats=${2:-2}
lengths=${3:-512,2048,8192,16384}
python=$build/peers-venv/bin/python
[[ -x $python ]] || { echo "long_sweep: no $python (run bench/peers/run.sh $build once to make it)" >&2; exit 2; }
out=$build/long-sweep
mkdir -p "$out"
lscpu | grep -E 'Model name|^CPU family|^Model:' | sed 's/^/long_sweep: /'
ours=() peer=()
for ((r = 1; r <= repeats; r++)); do
  "$build/bench/forward_bench" --sweep long --threads 2 --lengths "$lengths" --json "$out/attnserve-$r.json"
  "$python" bench/peers/long_sdpa.py --threads 2 --lengths "$lengths" --json "$out/sdpa-$r.json"
  ours+=("$out/attnserve-$r.json") peer+=("$out/sdpa-$r.json")
done
python3 bench/long_report.py --ours "${ours[@]}" --peer "${peer[@]}" --svg "$out/long-sequences.svg"
echo "long_sweep: the SVG is $out/long-sequences.svg"
