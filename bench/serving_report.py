"""The tables of one bench/serving_overhead.sh run (docs/journal/benchmarks-journal.md, "Serving overhead").

    python3 serving_report.py OUT_DIR ROUNDS PROBES NAME:FLAGS...

OUT_DIR holds inprocess.json and inprocess-after.json (forward_bench --json, small-request,
before the first round and after the last: the SGEMM ceiling), c32.json (concurrency 32 against
the first variant's server), and per round R: inprocess-R.json and inprocess-idle-R.json (the
factored forward in-process, back to back and after a pause before each call, --idle-us, timed
just before the round's first served run), floor-R.json (the no-op server), NAME-R.json (the
served bench of each server variant), NAME-R.before.prom / .after.prom (its scrapes) and
python-R.json (bench/serving_client.py against the first variant's server and the no-op
server, in alternating bursts); probe-P.json for each of the PROBES runs of bench/overhead_probe
(the three figures interleaved in bursts). Each round's overhead is its own served − in-process −
floor, and the headline is the median over the rounds; the stage table is the mean per call of
the round whose overhead was that median.
"""
import json
import re
import sys

STAGES = ["route", "decode", "admit", "queue", "compute", "encode", "send"]


def load(path):
    with open(path) as f:
        return json.load(f)


def factored(path):
    return next(r for r in load(path) if r["form"] == "factored")


def stage_sums(path):
    """{stage: (sum_seconds, count)} from one scrape."""
    sums, counts = {}, {}
    pattern = re.compile(r'^attnserve_stage_seconds_(sum|count)\{stage="([a-z]+)"\} ([0-9.e+-]+)$')
    with open(path) as f:
        for line in f:
            m = pattern.match(line.strip())
            if m:
                (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
    return {s: (sums.get(s, 0.0), counts.get(s, 0.0)) for s in STAGES}


def stage_means_us(out, name):
    before, after = stage_sums(f"{out}/{name}.before.prom"), stage_sums(f"{out}/{name}.after.prom")
    means = {}
    for s in STAGES:
        calls = after[s][1] - before[s][1]
        means[s] = (after[s][0] - before[s][0]) / calls * 1e6 if calls > 0 else float("nan")
    return means


def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def median_round(by_round):
    """The round whose value is the median (the lower middle one of an even count)."""
    ordered = sorted(by_round, key=by_round.get)
    return ordered[(len(ordered) - 1) // 2]


def spread(values):
    return f"{min(values):.0f} to {max(values):.0f}"


def main():
    out, rounds, probes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variants = [v.split(":", 1)[0] for v in sys.argv[4:]]
    inproc = factored(f"{out}/inprocess.json")
    inproc_after = factored(f"{out}/inprocess-after.json")
    numbers = range(1, rounds + 1)
    # Per round: the in-process forward (back to back, and after a pause), the floor, each
    # variant's served call; all µs, all measured within seconds of each other.
    inproc_r = {r: factored(f"{out}/inprocess-{r}.json")["ms"] * 1000 for r in numbers}
    idle_r = {r: factored(f"{out}/inprocess-idle-{r}.json")["ms"] * 1000 for r in numbers}
    floor_r = {r: factored(f"{out}/floor-{r}.json")["p50_ms"] * 1000 for r in numbers}
    runs = {v: {r: factored(f"{out}/{v}-{r}.json") for r in numbers} for v in variants}
    served_r = {v: {r: runs[v][r]["p50_ms"] * 1000 for r in numbers} for v in variants}
    over_r = {v: {r: served_r[v][r] - inproc_r[r] - floor_r[r] for r in numbers} for v in variants}
    over_idle_r = {v: {r: served_r[v][r] - idle_r[r] - floor_r[r] for r in numbers} for v in variants}
    inproc_us = median(inproc_r.values())

    print(f"\nServing overhead, 1×16×768 demo layer, factored, concurrency 1, {rounds} rounds (each: the "
          f"in-process forward then the first server, the other servers, the no-op floor; the overhead is "
          f"each round's own served − in-process − floor, and the figure its median over the rounds; the "
          f"other columns are medians too):\n")
    print("| server | served p50 µs | in-process forward µs | no-op floor p50 µs | overhead over the floor µs "
          "(rounds' range) | server compute_us | server queue_us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        print(f"| {v} | {median(served_r[v].values()):.0f} | {inproc_us:.0f} | {median(floor_r.values()):.0f} | "
              f"**{median(over_r[v].values()):.0f}** ({spread(over_r[v].values())}) | "
              f"{median(runs[v][r]['compute_us'] for r in numbers):.0f} | "
              f"{median(runs[v][r]['queue_us'] for r in numbers):.0f} |")

    print("\nPer round, µs (over: served − in-process − floor of that round):\n")
    print("| round | in-process | after a pause | floor | " +
          " | ".join(f"{v} served | {v} over" for v in variants) + " |")
    print("|---:|---:|---:|---:|" + "---:|---:|" * len(variants))
    for r in numbers:
        print(f"| {r} | {inproc_r[r]:.0f} | {idle_r[r]:.0f} | {floor_r[r]:.0f} | " +
              " | ".join(f"{served_r[v][r]:.0f} | {over_r[v][r]:.0f}" for v in variants) + " |")

    best_inproc = min(inproc_r.values())
    best_floor = min(floor_r.values())
    print(f"\nAs earlier runs reported it, the best p50 of each over the rounds: in-process {best_inproc:.0f} µs, "
          f"floor {best_floor:.0f} µs; " +
          "; ".join(f"{v} served {min(served_r[v].values()):.0f} µs, over the floor "
                    f"{min(served_r[v].values()) - best_inproc - best_floor:.0f} µs" for v in variants) + ".")

    idle_us = median(idle_r.values())
    print(f"\nThe same forward in-process after an idle pause before each call (forward_bench --idle-us): "
          f"{idle_us:.0f} µs, against {inproc_us:.0f} µs back to back (medians of the rounds): the difference "
          f"is the pause's own cost (cores gone idle, cold caches, a sleeping team), not the server's. "
          f"Served p50 − paused in-process − floor, median of the rounds: " +
          "; ".join(f"{v} **{median(over_idle_r[v].values()):.0f} µs** ({spread(over_idle_r[v].values())})"
                    for v in variants) + ".")
    # The serving path alone: the server's own compute stage in place of the in-process forward,
    # so the forward running slower in the server than in a loop is left out. compute_us is the
    # mean over the answers, which a slow tail lifts above their median: this leans low by that.
    path_r = {v: {r: served_r[v][r] - runs[v][r]["compute_us"] - floor_r[r] for r in numbers} for v in variants}
    print("\nServed p50 − the server's own compute_us (the answers' mean) − floor (the serving path without the "
          "forward), median of "
          "the rounds: " + "; ".join(f"{v} **{median(path_r[v].values()):.0f} µs** ({spread(path_r[v].values())})"
                                     for v in variants) + ".")
    median_round_of = {v: median_round(over_r[v]) for v in variants}
    print("\nWhere a served call's time goes (attnserve_stage_seconds, mean µs per call, the round whose "
          "overhead was the median):\n")
    print("| stage | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    means = {v: stage_means_us(out, f"{v}-{median_round_of[v]}") for v in variants}
    for s in STAGES:
        print(f"| {s} | " + " | ".join(f"{means[v][s]:.1f}" for v in variants) + " |")
    print("| total in the server | " + " | ".join(f"{sum(means[v].values()):.1f}" for v in variants) + " |")

    try:
        py = {r: {t["target"]: t for t in load(f"{out}/python-{r}.json")} for r in numbers}
        py_served = {r: py[r]["served"]["p50_us"] for r in numbers}
        py_floor = {r: py[r]["floor"]["p50_us"] for r in numbers}
        # Its bursts alternate with the floor's: the gap is the median of the cycles' own.
        py_over = {r: py[r]["gap"]["gap_us"] - inproc_r[r] for r in numbers}
        py_path = {r: py[r]["gap"]["path_us"] for r in numbers}
        print(f"\nSecond client (Python grpcio, {py[1]['served']['requests']} timed requests a target a round, in "
              f"bursts alternating with the no-op floor's; {variants[0]}'s server): served p50 "
              f"{median(py_served.values()):.0f} µs, no-op floor p50 {median(py_floor.values()):.0f} µs, the "
              f"server's compute_us {median(py[r]['served']['compute_us'] for r in numbers):.0f} µs under it "
              f"(medians of the rounds); overhead over the floor (its cycles' served − floor, less the round's "
              f"in-process forward), "
              f"the median of the rounds: **{median(py_over.values()):.0f} µs** ({spread(py_over.values())}); "
              f"without the forward (its cycles' served − the answers' compute_us − floor, no in-process figure): "
              f"**{median(py_path.values()):.0f} µs** ({spread(py_path.values())})")
    except FileNotFoundError:
        print("\n(no second-client figures: python3-grpcio missing)")

    probe = [load(f"{out}/probe-{p}.json") for p in range(1, probes + 1)]
    if probe:
        print(f"\nInterleaved in bursts (bench/overhead_probe, {variants[0]}'s server, `attnserve-cli noop-server` "
              f"as the floor, the probe's own synchronous client and in-process forward): {probe[0]['cycles']} "
              f"cycles a run, each a burst of {probe[0]['burst']} calls to each of the three in an order that "
              f"rotates, the first {probe[0]['warm']} of each burst left out; the overhead is the median of the "
              f"cycles' own served − in-process − floor:\n")
        print("| probe run | served p50 µs | in-process p50 µs | floor p50 µs | overhead µs (cycles' p25 to p75) |")
        print("|---:|---:|---:|---:|---:|")
        for p, r in enumerate(probe, 1):
            print(f"| {p} | {r['served_p50_us']:.0f} | {r['in_process_p50_us']:.0f} | {r['floor_p50_us']:.0f} | "
                  f"**{r['overhead_us']:.0f}** ({r['overhead_p25_us']:.0f} to {r['overhead_p75_us']:.0f}) |")
        print(f"\nInterleaved overhead over the floor, median of the {probes} runs: "
              f"**{median(r['overhead_us'] for r in probe):.0f} µs** "
              f"({spread([r['overhead_us'] for r in probe])})")

    c32 = factored(f"{out}/c32.json")
    flops_per_request = inproc["gflops"] * inproc["ms"] * 1e6  # GFLOP/s × ms = FLOP
    served_gflops = c32["requests_per_s"] * flops_per_request / 1e9
    # The ceiling was measured just before the first round and just after the concurrency-32 run;
    # the higher of the two is the one the machine reached.
    ceiling = max(inproc, inproc_after, key=lambda r: r["ceiling_gflops"])
    print(f"\nConcurrency 32 (first variant's server): {c32['requests_per_s']:.0f} requests/s, mean batch "
          f"{c32['batch_requests']:.1f} requests, {served_gflops:.1f} GFLOP/s = "
          f"**{served_gflops / ceiling['ceiling_gflops']:.2f}** of the SGEMM ceiling "
          f"({ceiling['ceiling_gflops']:.1f} GFLOP/s, {ceiling['ceiling_source']}; the other measurement "
          f"{min(inproc['ceiling_gflops'], inproc_after['ceiling_gflops']):.1f}); p50 {c32['p50_ms']:.2f} ms")


if __name__ == "__main__":
    main()
