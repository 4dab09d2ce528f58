"""The tables of one bench/serving_overhead.sh run (docs/benchmarks.md, "Serving overhead").

    python3 serving_report.py OUT_DIR ROUNDS NAME:FLAGS...

OUT_DIR holds inprocess.json (forward_bench --json, small-request), inprocess-idle.json (the
same after a pause before each call, --idle-us), per round NAME-R.json (the
served bench of each server variant), NAME-R.before.prom / .after.prom (its scrapes),
floor-R.json (the no-op server), and c32.json (concurrency 32 against the default server).
Each figure is the best p50 over the rounds; the stage table is the mean per call of the round
whose served p50 was that best.
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


def main():
    out, rounds, variants = sys.argv[1], int(sys.argv[2]), [v.split(":", 1)[0] for v in sys.argv[3:]]
    inproc = factored(f"{out}/inprocess.json")
    inproc_after = factored(f"{out}/inprocess-after.json")
    inproc_us = min(inproc["ms"], inproc_after["ms"]) * 1000
    floors = [factored(f"{out}/floor-{r}.json")["p50_ms"] * 1000 for r in range(1, rounds + 1)]
    floor_us = min(floors)

    print(f"\nServing overhead, 1×16×768 demo layer, factored, concurrency 1, best p50 of {rounds} "
          f"alternating rounds:\n")
    print("| server | served p50 µs | in-process forward µs | no-op floor p50 µs | overhead over the floor µs |"
          " server compute_us | server queue_us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    best_round = {}
    for v in variants:
        runs = [(factored(f"{out}/{v}-{r}.json"), r) for r in range(1, rounds + 1)]
        best, r = min(runs, key=lambda x: x[0]["p50_ms"])
        best_round[v] = r
        p50 = best["p50_ms"] * 1000
        print(f"| {v} | {p50:.0f} | {inproc_us:.0f} | {floor_us:.0f} | **{p50 - inproc_us - floor_us:.0f}** |"
              f" {best['compute_us']:.0f} | {best['queue_us']:.0f} |")
    print(f"\n(in-process: the lower of forward_bench's medians before and after the runs, "
          f"{inproc['ms'] * 1000:.0f} and {inproc_after['ms'] * 1000:.0f} µs; floors per round: "
          f"{', '.join(f'{f:.0f}' for f in floors)} µs)")

    try:
        idle = factored(f"{out}/inprocess-idle.json")
        idle_us = idle["ms"] * 1000
        best_p50 = min(factored(f"{out}/{v}-{best_round[v]}.json")["p50_ms"] * 1000 for v in variants)
        print(f"\nThe same forward in-process after an idle pause before each call (forward_bench --idle-us): "
              f"{idle_us:.0f} µs, against {inproc_us:.0f} µs back to back: {idle_us - inproc_us:.0f} µs is the "
              f"pause's own cost (cores gone idle, cold caches, a sleeping team), not the server's. "
              f"Served p50 − idle in-process − floor: **{best_p50 - idle_us - floor_us:.0f} µs**.")
    except FileNotFoundError:
        pass

    print("\nWhere a served call's time goes (attnserve_stage_seconds, mean µs per call, the best round):\n")
    print("| stage | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    means = {v: stage_means_us(out, f"{v}-{best_round[v]}") for v in variants}
    for s in STAGES:
        print(f"| {s} | " + " | ".join(f"{means[v][s]:.1f}" for v in variants) + " |")
    print("| total in the server | " + " | ".join(f"{sum(means[v].values()):.1f}" for v in variants) + " |")

    try:
        py = {r["target"]: r for r in load(f"{out}/python-client.json")}
        served, floor = py["served"]["p50_us"], py["floor"]["p50_us"]
        print(f"\nSecond client (Python grpcio, {py['served']['requests']} requests a target, alternating): "
              f"served p50 {served:.0f} µs, no-op floor p50 {floor:.0f} µs, overhead over the floor "
              f"**{served - inproc_us - floor:.0f} µs** ({variants[0]}'s server)")
    except FileNotFoundError:
        print("\n(no second-client figures: python3-grpcio missing)")

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
