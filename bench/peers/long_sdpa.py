"""PyTorch's scaled_dot_product_attention at the long-sequence sweep's shapes
(forward_bench --sweep long): the same layers, n = L, time and the peak RSS growth of one call.

The layer is the factored form's computation: Q/K/V linears, RoPE on the LLaMA-like layer,
F.scaled_dot_product_attention (its CPU flash-attention kernel: memory linear in n; causal and
grouped-query heads as the layer says), output linear, fp32. GFLOP/s count the visible scores
only, as forward_bench does.

    python bench/peers/long_sdpa.py --threads 2 --lengths 512,2048,8192,16384 --json sdpa-long.json
"""
import argparse
import json
import os
import sys
import time

# Large blocks from mmap and back to the system at free, as in forward_bench's sweep: a point's
# peak RSS is its own. glibc reads this at start-up, so the script restarts itself once with it.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_attention import median_ms  # noqa: E402

LAYERS = {  # the same table as bench/forward_bench.cc (kLongLayers)
    "d768-h12": dict(d=768, heads=12, kv_heads=12, causal=False, rope_theta=0.0, bias=True),
    "llama-d2048-h16-kv4": dict(d=2048, heads=16, kv_heads=4, causal=True, rope_theta=10000.0, bias=False),
}


def status_mb(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name):
                return int(line.split()[1]) / 1024.0
    return -1.0


def weights(cfg):
    g = torch.Generator().manual_seed(1)
    d, h, kv = cfg["d"], cfg["heads"], cfg["kv_heads"]
    dh = d // h
    shapes = [(h * dh, d), (kv * dh, d), (kv * dh, d), (d, h * dh)]
    w = [torch.randn(*s, generator=g) / d**0.5 for s in shapes]
    b = [torch.randn(s[0], generator=g) * 0.1 if cfg["bias"] else None for s in shapes]
    return w, b


def rope(x, theta):
    # Rotate-half pairing (t, t + d_h/2), positions 0..n-1: as attnserve's layers.
    n, dh = x.shape[-2], x.shape[-1]
    freq = theta ** (-torch.arange(0, dh // 2, dtype=torch.float64) * 2 / dh)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def forward(x, w, b, cfg):
    _, n, d = x.shape
    h, kv = cfg["heads"], cfg["kv_heads"]
    dh = d // h
    q = F.linear(x, w[0], b[0]).view(1, n, h, dh).transpose(1, 2)
    k = F.linear(x, w[1], b[1]).view(1, n, kv, dh).transpose(1, 2)
    v = F.linear(x, w[2], b[2]).view(1, n, kv, dh).transpose(1, 2)
    if cfg["rope_theta"] > 0:
        q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
    o = F.scaled_dot_product_attention(q, k, v, is_causal=cfg["causal"], enable_gqa=kv < h)
    return F.linear(o.transpose(1, 2).reshape(1, n, h * dh), w[3], b[3])


def useful_flops(cfg, n):
    d, h, kv = cfg["d"], cfg["heads"], cfg["kv_heads"]
    dh = d // h
    projections = 2 * n * d * (h * dh + 2 * kv * dh) + 2 * n * h * dh * d
    attention = 4 * n * n * h * dh
    if cfg["causal"]:
        attention *= (n + 1) / (2 * n)
    return projections + attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,2048,8192,16384")
    ap.add_argument("--min-time-s", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    records = []
    with torch.inference_mode():
        for name, cfg in LAYERS.items():
            w, b = weights(cfg)
            for n in (int(v) for v in args.lengths.split(",")):
                x = torch.randn(1, n, cfg["d"], generator=torch.Generator().manual_seed(3))
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                before = status_mb("VmRSS:")
                y = forward(x, w, b, cfg)
                growth = status_mb("VmHWM:") - before
                del y
                # Long points take seconds a call: one more, timed; short ones as forward_bench does.
                if n > 2048:
                    t0 = time.perf_counter()
                    forward(x, w, b, cfg)
                    ms = (time.perf_counter() - t0) * 1e3
                else:
                    ms = median_ms(lambda: forward(x, w, b, cfg), torch.device("cpu"), args.min_time_s)
                rec = {"sweep": "long", "layer": name, "peer": "torch-sdpa", "n": n, "threads": args.threads,
                       "ms": ms, "gflops": useful_flops(cfg, n) / ms * 1e-6, "rss_growth_mb": growth,
                       "torch": torch.__version__}
                records.append(rec)
                print(f"{name:22s} torch-sdpa {n:6d} {ms:10.1f} ms {rec['gflops']:8.1f} GFLOP/s "
                      f"RSS growth {growth:8.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
