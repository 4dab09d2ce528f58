"""PyTorch's multi-head attention at attnserve's benchmark shapes, for side-by-side ratios.

The layer is the same computation as attnserve's factored form: Q/K/V projections, scaled dot
product attention, output projection, fp32. Times include moving the input from host memory to
the device and the output back (attnserve's Forward does the same); `device_ms` is without.

    python3 bench/peers/torch_attention.py --device cuda --json torch.json
    python3 bench/peers/torch_attention.py --device cuda --tf32 --json torch-tf32.json
    python3 bench/peers/torch_attention.py --device cuda --bf16 --json torch-bf16.json

FP32 is the default: TF32 is off for both cuBLAS's matmuls and cuDNN, whatever torch's own
default. `--tf32` allows it for both (torch.backends.cuda.matmul.allow_tf32 and
torch.backends.cudnn.allow_tf32), the peer of `forward_bench --tf32`; every record says which
(`precision`: fp32 or tf32). TF32 is a CUDA mode: `--tf32` with `--device cpu` is refused.

`--bf16` is what production attention on a GPU runs: the weights and biases held in bfloat16 on
the device, the input converted there after its copy, the projections in BF16 (cuBLAS, FP32
accumulation) and SDPA in BF16, for which PyTorch picks its flash-attention kernel; the answer
comes back as float32, as attnserve's does (`precision`: bf16; the peer of `--gpu-math bf16`,
issue 48). Also CUDA only.

Exit status 3, with one line on stderr, when the interpreter has no torch or the device asked
for is not available to it (scripts/gpu-check.sh then leaves the peer column out).
"""
import argparse
import json
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print(f"torch_attention.py: no torch in {sys.executable} ({e})", file=sys.stderr)
    sys.exit(3)

SHAPES = {  # name: (batch, n, d_model, heads) — the same table as bench/forward_bench.cc
    "bert-base": (8, 128, 768, 12),
    "gpt2-medium": (4, 256, 1024, 16),
    "small-request": (1, 16, 768, 12),
    "large": (32, 512, 1024, 16),
}


def layer(d, dev, dtype):
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(4)]
    b = [torch.randn(d, generator=g) * 0.1 for _ in range(4)]
    return [t.to(dev, dtype=dtype) for t in w], [t.to(dev, dtype=dtype) for t in b]


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
    ap.add_argument("--tf32", action="store_true",
                    help="allow TF32 in cuBLAS matmuls and cuDNN (default: FP32, TF32 off)")
    ap.add_argument("--bf16", action="store_true",
                    help="weights, projections and SDPA in bfloat16 (flash attention), the answer as float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.tf32 and args.bf16:
        ap.error("--tf32 and --bf16 are two precisions: choose one")
    if args.tf32 and dev.type != "cuda":
        ap.error("--tf32 is a CUDA mode: use it with --device cuda")
    if args.bf16 and dev.type != "cuda":
        ap.error("--bf16 is a CUDA mode: use it with --device cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"torch_attention.py: torch {torch.__version__} in {sys.executable} has no usable CUDA device",
              file=sys.stderr)
        sys.exit(3)
    # Both switches, both ways: what the run measures never depends on torch's defaults.
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    precision = "tf32" if args.tf32 else ("bf16" if args.bf16 else "fp32")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            bsz, n, d, heads = SHAPES[name]
            w, b = layer(d, dev, dtype)
            x_host = torch.randn(bsz, n, d).pin_memory() if dev.type == "cuda" else torch.randn(bsz, n, d)
            x_dev = x_host.to(dev).to(dtype)
            # Float32 in from host memory and out to it, as a client of attnserve sends and reads.
            end_to_end = median_ms(
                lambda: forward(x_host.to(dev, non_blocking=True).to(dtype), w, b, heads).float().cpu(), dev,
                args.min_time_s)
            device_only = median_ms(lambda: forward(x_dev, w, b, heads), dev, args.min_time_s)
            records.append({"shape": name, "peer": "torch-sdpa", "device": args.device, "precision": precision,
                            "ms": end_to_end, "device_ms": device_only, "torch": torch.__version__})
            print(f"{name:14s} torch sdpa+linear {precision}  {end_to_end:9.3f} ms (device only {device_only:.3f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
