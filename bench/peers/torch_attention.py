"""PyTorch's multi-head attention at attnserve's benchmark shapes, for side-by-side ratios.

The layer is the same computation as attnserve's factored form: Q/K/V projections, scaled dot
product attention, output projection, fp32. Times include moving the input from host memory to
the device and the output back (attnserve's Forward does the same); `device_ms` is without.

    python3 bench/peers/torch_attention.py --device cuda --json torch.json
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (batch, n, d_model, heads) — the same table as bench/forward_bench.cc
    "bert-base": (8, 128, 768, 12),
    "gpt2-medium": (4, 256, 1024, 16),
    "small-request": (1, 16, 768, 12),
    "large": (32, 512, 1024, 16),
}


def layer(d, dev):
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(4)]
    b = [torch.randn(d, generator=g) * 0.1 for _ in range(4)]
    return [t.to(dev) for t in w], [t.to(dev) for t in b]


def forward(x, w, b, heads):
    bsz, n, d = x.shape
    q, k, v = (F.linear(x, w[i], b[i]).view(bsz, n, heads, d // heads).transpose(1, 2) for i in range(3))
    o = F.scaled_dot_product_attention(q, k, v)
    return F.linear(o.transpose(1, 2).reshape(bsz, n, d), w[3], b[3])


def median_ms(fn, dev, min_time_s):
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_time_s:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--min-time-s", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    records = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            bsz, n, d, heads = SHAPES[name]
            w, b = layer(d, dev)
            x_host = torch.randn(bsz, n, d).pin_memory() if dev.type == "cuda" else torch.randn(bsz, n, d)
            x_dev = x_host.to(dev)
            end_to_end = median_ms(lambda: forward(x_host.to(dev, non_blocking=True), w, b, heads).cpu(), dev,
                                   args.min_time_s)
            device_only = median_ms(lambda: forward(x_dev, w, b, heads), dev, args.min_time_s)
            records.append({"shape": name, "peer": "torch-sdpa", "device": args.device, "ms": end_to_end,
                            "device_ms": device_only, "torch": torch.__version__})
            print(f"{name:14s} torch sdpa+linear  {end_to_end:9.3f} ms (device only {device_only:.3f} ms)")
    if args.json:
        json.dump(records, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
