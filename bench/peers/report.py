"""Joins one run of bench/peers/run.sh into Markdown tables (docs/benchmarks.md pastes them).

    python3 report.py ours.json peers.json serving.json [serving-batching.json]

ours.json     forward_bench --json (attnserve's in-process forward, both forms)
peers.json    cpu_peers.py --json (torch-mha, torch-sdpa, ort-graph, ort-attention)
serving*.json attnserve-cli bench --json, factored form, concurrency 1, at the small-request shape
              (serving-noop.json: against --noop-server, the bench's own cost)
Ratios are ours/theirs in time: below 1 means attnserve is faster.
"""
import json
import sys

PEERS = ["torch-mha", "torch-sdpa", "ort-graph", "ort-attention"]
SHAPE_LABELS = {"bert-base": "bert-base 8×128, d=768, h=12", "gpt2-medium": "gpt2-medium 4×256, d=1024, h=16",
                "small-request": "small-request 1×16, d=768, h=12"}


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    ours = {(r["shape"], r["form"]): r for r in load(sys.argv[1])}
    peers = {(r["shape"], r["peer"]): r for r in load(sys.argv[2])}
    shapes = [s for s in SHAPE_LABELS if any(k[0] == s for k in ours)]
    threads = sorted({r["threads"] for r in ours.values()})

    print(f"Forward time, ms (median), {','.join(map(str, threads))} threads:\n")
    print("| shape | attnserve factored | attnserve summed | " + " | ".join(PEERS) + " |")
    print("|---|" + "---:|" * (2 + len(PEERS)))
    for s in shapes:
        cells = [f"{ours[(s, f)]['ms']:.3f}" for f in ("factored", "summed")]
        cells += [f"{peers[(s, p)]['ms']:.3f}" if (s, p) in peers else "–" for p in PEERS]
        print(f"| {SHAPE_LABELS[s]} | " + " | ".join(cells) + " |")

    print("\nours/theirs (time ratio; < 1: attnserve faster), and against the best peer:\n")
    print("| shape | form | " + " | ".join(PEERS) + " | best peer | ours/best |")
    print("|---|---|" + "---:|" * (len(PEERS) + 2))
    for s in shapes:
        present = [p for p in PEERS if (s, p) in peers]
        best = min(present, key=lambda p: peers[(s, p)]["ms"])
        for f in ("factored", "summed"):
            mine = ours[(s, f)]["ms"]
            cells = [f"{mine / peers[(s, p)]['ms']:.2f}" if (s, p) in peers else "–" for p in PEERS]
            print(f"| {s} | {f} | " + " | ".join(cells) +
                  f" | {best} ({peers[(s, best)]['ms']:.3f} ms) | **{mine / peers[(s, best)]['ms']:.2f}** |")

    if len(sys.argv) > 3:
        inproc = ours[("small-request", "factored")]["ms"] * 1000
        print("\nServing overhead at small-request (1×16, d=768), factored, concurrency 1, loopback gRPC:\n")
        print("| server batching | client p50 µs | client p90 µs | server queue_us | server compute_us |"
              " in-process forward µs | overhead (p50 − in-process) µs |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for path in sys.argv[3:]:
            recs = [r for r in load(path) if r["form"] == "factored" and r["concurrency"] == 1]
            if not recs:
                continue
            r = recs[0]
            label = path.rsplit("/", 1)[-1].removesuffix(".json").removeprefix("serving-")
            # The no-op server computes nothing: its whole p50 is the client's and gRPC's cost.
            base = 0 if label == "noop" else inproc
            if label == "noop":
                label = "no-op server (the bench's own cost)"
            p50 = r["p50_ms"] * 1000
            print(f"| {label} | {p50:.0f} | {r['p90_ms'] * 1000:.0f} | {r['queue_us']:.0f} | {r['compute_us']:.0f} |"
                  f" {base:.0f} | **{p50 - base:.0f}** |")


if __name__ == "__main__":
    main()
