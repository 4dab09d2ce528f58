"""Joins one run of bench/peers/run.sh into Markdown tables (docs/journal/benchmarks-journal.md pastes them).

    python3 report.py --ours ours-1.json [ours-2.json ...] --peers peers-1.json [peers-2.json ...]
                      [--serving serving-defaults.json [serving-noop.json]]

--ours     forward_bench --json (attnserve's in-process forward, both forms), one file a round
--peers    cpu_peers.py --json (torch-mha, torch-sdpa, ort-graph, ort-attention), one file a round,
           in the same order: ours-R and peers-R were measured in turn, close in time
--serving  attnserve-cli bench --json, factored form, concurrency 1, at the small-request shape
           (serving-noop.json: against --noop-server, the bench's own cost)

Ratios are ours/theirs in time: below 1 means attnserve is faster. Each ratio is taken within a
round (ours in round R over the peer in round R, and over round R's best peer), then the median
over the rounds is printed, so that the machine's drift between rounds cancels; with several
rounds a last column gives the min-max of ours/best over the rounds. The forward time table is
the median over the rounds of each implementation's time. With one round the tables are those of
a single measurement.
"""
import argparse
import json
import statistics

PEERS = ["torch-mha", "torch-sdpa", "ort-graph", "ort-attention"]
SHAPE_LABELS = {"bert-base": "bert-base 8×128, d=768, h=12", "gpt2-medium": "gpt2-medium 4×256, d=1024, h=16",
                "small-request": "small-request 1×16, d=768, h=12"}


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description="Markdown tables of one bench/peers/run.sh run.")
    ap.add_argument("--ours", nargs="+", required=True, help="forward_bench --json files, one a round")
    ap.add_argument("--peers", nargs="+", required=True, help="cpu_peers.py --json files, one a round")
    ap.add_argument("--serving", nargs="*", default=[], help="attnserve-cli bench --json files")
    args = ap.parse_args()
    if len(args.ours) != len(args.peers):
        ap.error(f"{len(args.ours)} --ours files but {len(args.peers)} --peers files: one of each a round")

    # Per round: {(shape, form): ms} and {(shape, peer): ms}.
    ours_records = [load(p) for p in args.ours]
    ours_rounds = [{(r["shape"], r["form"]): r["ms"] for r in records} for records in ours_records]
    peers_rounds = [{(r["shape"], r["peer"]): r["ms"] for r in load(p)} for p in args.peers]
    rounds = len(ours_rounds)
    threads = sorted({r["threads"] for records in ours_records for r in records})
    shapes = [s for s in SHAPE_LABELS if any(k[0] == s for k in ours_rounds[0])]

    def median_ms(per_round, key):  # the median over the rounds that measured `key`, or None
        values = [t[key] for t in per_round if key in t]
        return statistics.median(values) if values else None

    ours = {k: median_ms(ours_rounds, k) for k in {k for t in ours_rounds for k in t}}
    peers = {k: median_ms(peers_rounds, k) for k in {k for t in peers_rounds for k in t}}

    over = f" over {rounds} rounds" if rounds > 1 else ""
    print(f"Forward time, ms (median{over}), {','.join(map(str, threads))} threads:\n")
    print("| shape | attnserve factored | attnserve summed | " + " | ".join(PEERS) + " |")
    print("|---|" + "---:|" * (2 + len(PEERS)))
    for s in shapes:
        cells = [f"{ours[(s, f)]:.3f}" for f in ("factored", "summed")]
        cells += [f"{peers[(s, p)]:.3f}" if (s, p) in peers else "–" for p in PEERS]
        print(f"| {SHAPE_LABELS[s]} | " + " | ".join(cells) + " |")

    if rounds > 1:
        print(f"\nours/theirs (time ratio; < 1: attnserve faster), and against the best peer; each the median over "
              f"the {rounds} rounds of the ratio within a round (ours/best: against that round's best peer):\n")
        print("| shape | form | " + " | ".join(PEERS) + " | best peer | ours/best | ours/best min–max |")
        print("|---|---|" + "---:|" * (len(PEERS) + 3))
    else:
        print("\nours/theirs (time ratio; < 1: attnserve faster), and against the best peer:\n")
        print("| shape | form | " + " | ".join(PEERS) + " | best peer | ours/best |")
        print("|---|---|" + "---:|" * (len(PEERS) + 2))
    for s in shapes:
        present = [p for p in PEERS if (s, p) in peers]
        # Each round's best peer; the column names the one fastest over the rounds (its median time).
        round_best = [min((p for p in PEERS if (s, p) in t), key=lambda p: t[(s, p)], default=None)
                      for t in peers_rounds]
        best = min(present, key=lambda p: peers[(s, p)])
        best_cell = f"{best} ({peers[(s, best)]:.3f} ms)"
        if rounds > 1 and any(b != best for b in round_best):
            best_cell += f", best in {sum(b == best for b in round_best)}/{rounds} rounds"
        for f in ("factored", "summed"):
            def ratios(peer_of_round):  # ours/peer within each round that measured both
                return [o[(s, f)] / t[(s, peer_of_round(i))] for i, (o, t) in enumerate(zip(ours_rounds, peers_rounds))
                        if (s, f) in o and peer_of_round(i) is not None and (s, peer_of_round(i)) in t]
            cells = []
            for p in PEERS:
                r = ratios(lambda i, p=p: p)
                cells.append(f"{statistics.median(r):.2f}" if r else "–")
            to_best = ratios(lambda i: round_best[i])
            line = f"| {s} | {f} | " + " | ".join(cells) + f" | {best_cell} | **{statistics.median(to_best):.2f}** |"
            if rounds > 1:
                line += f" {min(to_best):.2f}–{max(to_best):.2f} |"
            print(line)

    if args.serving:
        inproc = ours[("small-request", "factored")] * 1000
        print("\nServing overhead at small-request (1×16, d=768), factored, concurrency 1, loopback gRPC:\n")
        print("| server batching | client p50 µs | client p90 µs | server queue_us | server compute_us |"
              " in-process forward µs | overhead (p50 − in-process) µs |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for path in args.serving:
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
