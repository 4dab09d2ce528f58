"""Joins forward_bench's JSON with a peer's (torch_attention.py) into one table of ratios.

    python3 bench/peers/compare.py ours.json [peer.json]
"""
import json
import sys

ours = json.load(open(sys.argv[1]))
peer = {r["shape"]: r for r in json.load(open(sys.argv[2]))} if len(sys.argv) > 2 else {}
print(f"{'shape':14s} {'form':9s} {'device':7s} {'ms':>9s} {'TFLOP/s':>8s} {'ceiling':>8s} {'ratio':>6s}"
      f" {'torch ms':>9s} {'ours/torch':>10s}")
for r in ours:
    p = peer.get(r["shape"])
    torch_ms = f"{p['ms']:9.3f}" if p else f"{'-':>9s}"
    ratio = f"{r['ms'] / p['ms']:10.2f}" if p else f"{'-':>10s}"
    print(f"{r['shape']:14s} {r['form']:9s} {r['device']:7s} {r['ms']:9.3f} {r['gflops'] / 1e3:8.2f}"
          f" {r['ceiling_gflops'] / 1e3:8.2f} {r['ratio_to_ceiling']:6.3f} {torch_ms} {ratio}")
