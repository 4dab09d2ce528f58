"""Joins forward_bench's JSON with a peer's (torch_attention.py) into one table of ratios.

    python3 bench/peers/compare.py ours.json [peer.json]

Both files must be of one precision: forward_bench's is TF32 when its ceiling was measured with
TF32 (`ceiling_source` "cublas-tf32 ..."), BF16 or FP16 when its forwards ran so (the source ends
"..., forwards in bf16"), the peer's says it in `precision` (fp32 when absent,
as torch_attention.py wrote before it had --tf32). A TF32 run against an FP32 peer, or the other
way round, is refused (exit 1): its ratios would compare two different computations.
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


ours = load(sys.argv[1])
peer = {r["shape"]: r for r in load(sys.argv[2])} if len(sys.argv) > 2 else {}
sources = " ".join(r.get("ceiling_source", "") for r in ours)
our_precision = next((p for p in ("tf32", "bf16", "fp16") if p in sources), "fp32")
peer_precisions = {r.get("precision", "fp32") for r in peer.values()}
if peer_precisions - {our_precision}:
    print(f"compare.py: {sys.argv[1]} is {our_precision}, {sys.argv[2]} is {','.join(sorted(peer_precisions))}:"
          " not comparable", file=sys.stderr)
    sys.exit(1)
print(f"precision: {our_precision}" + (f" (both; torch {next(iter(peer.values())).get('torch', '?')})" if peer else ""))
# Where one run holds several variants of the backend (forward_bench's gemm label: a GEMM
# library, an association order, a copy slice), a column says which row is which.
variants = len({r.get("gemm", "") for r in ours}) > 1


def label(r):
    return f"{r['form']:9s}" + (f" {r.get('gemm', ''):22s}" if variants else "")


head = f"{'form':9s}" + (f" {'variant':22s}" if variants else "")
print(f"{'shape':14s} {head} {'device':7s} {'ms':>9s} {'TFLOP/s':>8s} {'ceiling':>8s} {'ratio':>6s}"
      f" {'torch ms':>9s} {'ours/torch':>10s}")
for r in ours:
    p = peer.get(r["shape"])
    torch_ms = f"{p['ms']:9.3f}" if p else f"{'-':>9s}"
    ratio = f"{r['ms'] / p['ms']:10.2f}" if p else f"{'-':>10s}"
    print(f"{r['shape']:14s} {label(r)} {r['device']:7s} {r['ms']:9.3f} {r['gflops'] / 1e3:8.2f}"
          f" {r['ceiling_gflops'] / 1e3:8.2f} {r['ratio_to_ceiling']:6.3f} {torch_ms} {ratio}")

# On a GPU, the compute alone (forward_bench's device_ms: between the inputs' arrival and the
# outputs' copy back) against PyTorch's device-only time (its input already on the device).
split = [r for r in ours if "device_ms" in r]
if split:
    print(f"\ndevice only (the copies in and out left out of both sides)")
    print(f"{'shape':14s} {head} {'ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s} {'torch ms':>9s} {'ours/torch':>10s}")
    for r in split:
        p = peer.get(r["shape"])
        has_peer = p is not None and "device_ms" in p
        torch_ms = f"{p['device_ms']:9.3f}" if has_peer else f"{'-':>9s}"
        ratio = f"{r['device_ms'] / p['device_ms']:10.2f}" if has_peer else f"{'-':>10s}"
        print(f"{r['shape']:14s} {label(r)} {r['device_ms']:9.3f} {r['device_gflops'] / 1e3:8.2f}"
              f" {r['device_ratio_to_ceiling']:6.3f} {torch_ms} {ratio}")
