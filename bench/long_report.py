"""The long-sequence sweep's report: a markdown table (time, GFLOP/s and peak RSS growth against n,
attnserve's two forms beside torch-sdpa, and torch-sdpa's time over the factored form's) and an
SVG of time and memory against n, log-log. Each side may come from several runs taken in turn
(bench/long_sweep.sh): the fastest time of each point is kept, as noise only ever adds.

    python3 bench/long_report.py --ours a1.json a2.json --peer s1.json s2.json --svg docs/long-sequences.svg
"""
import argparse
import json
import math
import sys

SERIES = [  # (source, form or peer, colour)
    ("attnserve", "factored", "#1f77b4"),
    ("attnserve", "summed", "#d62728"),
    ("torch", "torch-sdpa", "#2ca02c"),
]
LAYER_DASH = {"d768-h12": "", "llama-d2048-h16-kv4": "6,4"}
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 460, 340, 64, 16, 34, 46


def log_ticks(lo, hi):
    return [10**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def panel(x0, title, ylabel, points_by_series, xs_all, ys_all):
    xlo, xhi = min(xs_all), max(xs_all)
    if xhi <= xlo:  # one length (a quick sweep): an octave either side, not a zero-width axis
        xlo, xhi = xlo / 2, xhi * 2
    ylo, yhi = min(ys_all), max(ys_all)
    ylo, yhi = 10 ** math.floor(math.log10(ylo)), 10 ** math.ceil(math.log10(yhi))
    if yhi <= ylo:  # every value the same power of ten
        yhi = ylo * 10
    lx = lambda v: x0 + PAD_L + (math.log(v) - math.log(xlo)) / (math.log(xhi) - math.log(xlo)) * (W - PAD_L - PAD_R)
    ly = lambda v: PAD_T + (1 - (math.log(v) - math.log(ylo)) / (math.log(yhi) - math.log(ylo))) * (H - PAD_T - PAD_B)
    out = [f'<text x="{x0 + W / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>',
           f'<rect x="{x0 + PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" height="{H - PAD_T - PAD_B}" '
           'fill="none" stroke="#888"/>']
    for t in log_ticks(ylo, yhi):
        if ylo <= t <= yhi:
            out.append(f'<line x1="{x0 + PAD_L}" x2="{x0 + W - PAD_R}" y1="{ly(t):.1f}" y2="{ly(t):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{x0 + PAD_L - 4}" y="{ly(t) + 4:.1f}" text-anchor="end" font-size="11">{t:g}</text>')
    for n in sorted(set(xs_all)):
        out.append(f'<text x="{lx(n):.1f}" y="{H - PAD_B + 16}" text-anchor="middle" font-size="11">{n}</text>')
    out.append(f'<text x="{x0 + W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">n = L (tokens)</text>')
    out.append(f'<text x="{x0 + 14}" y="{PAD_T + (H - PAD_T - PAD_B) / 2}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 {x0 + 14} {PAD_T + (H - PAD_T - PAD_B) / 2})">{ylabel}</text>')
    for (layer, label, colour), pts in points_by_series.items():
        pts = sorted(pts)
        path = " ".join(f"{lx(x):.1f},{ly(y):.1f}" for x, y in pts)
        dash = LAYER_DASH.get(layer, "")
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"'
                   + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        for x, y in pts:
            out.append(f'<circle cx="{lx(x):.1f}" cy="{ly(y):.1f}" r="3" fill="{colour}"/>')
    return out


def best(records, key):
    out = {}
    for r in records:
        k = key(r)
        if k not in out or r["ms"] < out[k]["ms"]:
            out[k] = r
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", nargs="+", required=True)
    ap.add_argument("--peer", nargs="+", required=True)
    ap.add_argument("--svg")
    args = ap.parse_args()
    ours = [r for path in args.ours for r in json.load(open(path)) if r.get("order", "auto") == "auto"]
    theirs = [r for path in args.peer for r in json.load(open(path))]
    threads = max(r["threads"] for r in ours)
    ours = best([r for r in ours if r["threads"] == threads], lambda r: (r["layer"], r["n"], r["form"]))
    theirs = best([r for r in theirs if r["threads"] == threads], lambda r: (r["layer"], r["n"]))
    print(f"| layer | n | factored ms | summed ms | torch-sdpa ms | sdpa / factored | factored GFLOP/s | "
          f"RSS growth factored / summed / sdpa (MiB) | all heads' n·L scores (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for (layer, n, form), r in sorted(ours.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if form != "factored":
            continue
        s = ours.get((layer, n, "summed"))
        p = theirs.get((layer, n))
        print(f"| {layer} | {n} | {r['ms']:.1f} | {s['ms'] if s else float('nan'):.1f} | "
              f"{p['ms'] if p else float('nan'):.1f} | {p['ms'] / r['ms'] if p else float('nan'):.2f} | "
              f"{r['gflops']:.0f} | {r['rss_growth_mb']:.0f} / {s['rss_growth_mb'] if s else float('nan'):.0f} / "
              f"{p['rss_growth_mb'] if p else float('nan'):.0f} | {r['all_scores_mb']:.0f} |")
    if not args.svg:
        return
    rows = [("attnserve", r["form"], r) for r in ours.values()] + [("torch", r["peer"], r) for r in theirs.values()]
    colour = {label: c for _, label, c in SERIES}
    time_pts, mem_pts = {}, {}
    for _, label, r in rows:
        key = (r["layer"], label, colour[label])
        time_pts.setdefault(key, []).append((r["n"], r["ms"]))
        mem_pts.setdefault(key, []).append((r["n"], max(r["rss_growth_mb"], 0.1)))
    xs = [r["n"] for _, _, r in rows]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 40}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>']
    svg += panel(0, f"time per call, {threads} threads (ms)", "ms", time_pts, xs, [y for p in time_pts.values() for _, y in p])
    svg += panel(W, "peak RSS growth per call (MiB)", "MiB", mem_pts, xs, [y for p in mem_pts.values() for _, y in p])
    x = 20
    for _, label, c in SERIES:
        svg.append(f'<line x1="{x}" x2="{x + 24}" y1="{H + 24}" y2="{H + 24}" stroke="{c}" stroke-width="2"/>')
        svg.append(f'<text x="{x + 30}" y="{H + 28}" font-size="12">{"attnserve " + label if label != "torch-sdpa" else label}</text>')
        x += 170
    svg.append(f'<text x="{x}" y="{H + 28}" font-size="12">solid: d768 h12 · dashed: LLaMA-like d2048 h16 kv4 causal RoPE</text>')
    svg.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
