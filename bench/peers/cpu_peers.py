"""The CPU peers of attnserve's forward, on the same shapes and thread count as forward_bench.

  torch-mha      torch.nn.MultiheadAttention on its inference fast path (batch_first, eval,
                 inference_mode, need_weights=False, query is key is value)
  torch-sdpa     Q/K/V linears, F.scaled_dot_product_attention, output linear (torch_attention.py)
  ort-graph      ONNX Runtime running an ONNX graph of the same layer in standard operators
                 (fused QKV MatMul, Split, Reshape/Transpose, MatMul, Softmax, MatMul, output MatMul)
  ort-attention  ONNX Runtime's fused CPU attention kernel (com.microsoft Attention) + output MatMul

All four use the same weights (torch_attention.layer) and are checked against each other before
they are timed. Times are the median of runs lasting at least --min-time-s, in ms.

    python bench/peers/cpu_peers.py --threads 2 --json peers.json

With --bf16, PyTorch in bfloat16 on the CPU instead, beside its float32 SDPA (the peers of
forward_bench --weight-layout packed-bf16-dot, docs/benchmarks.md):

  torch-sdpa-fp32      torch-sdpa as above, float32
  torch-sdpa-autocast  the same float32 layer under torch.autocast("cpu", torch.bfloat16)
  torch-mha-autocast   torch-mha under autocast (autocast leaves MHA's fast path)
  torch-sdpa-bf16      weights, biases and input held in bfloat16, the answer as float32

Each record then says its divergence from float64 (`rel_l2`: ‖y − y64‖ / ‖y64‖ over the whole
batch, the measure forward_bench's accuracy check prints), the same input and weights for all.

    python bench/peers/cpu_peers.py --threads 2 --bf16 --json peers-bf16.json
"""
import argparse
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_attention import SHAPES, forward, layer, median_ms  # noqa: E402

CPU = torch.device("cpu")


def mha_module(d, heads, w, b):
    mha = torch.nn.MultiheadAttention(d, heads, batch_first=True, bias=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat(w[:3]))
        mha.in_proj_bias.copy_(torch.cat(b[:3]))
        mha.out_proj.weight.copy_(w[3])
        mha.out_proj.bias.copy_(b[3])
    return mha.eval()


def onnx_graph(d, heads, w, b, fused):
    """The layer as an ONNX model; `fused` uses ORT's com.microsoft Attention for the core."""
    dh = d // heads
    # F.linear computes x W^T; ONNX MatMul computes x W, hence the transposes.
    wqkv = torch.cat(w[:3]).T.contiguous().numpy()
    bqkv = torch.cat(b[:3]).numpy()
    init = [numpy_helper.from_array(wqkv, "Wqkv"), numpy_helper.from_array(bqkv, "bqkv"),
            numpy_helper.from_array(w[3].T.contiguous().numpy(), "Wo"), numpy_helper.from_array(b[3].numpy(), "bo")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "N", d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "N", d])
    if fused:
        nodes = [helper.make_node("Attention", ["x", "Wqkv", "bqkv"], ["o"], domain="com.microsoft", num_heads=heads)]
    else:
        init += [numpy_helper.from_array(np.array([d, d, d], np.int64), "split"),
                 numpy_helper.from_array(np.array([0, 0, heads, dh], np.int64), "heads_shape"),
                 numpy_helper.from_array(np.array([0, 0, d], np.int64), "model_shape"),
                 numpy_helper.from_array(np.array(1.0 / dh ** 0.5, np.float32), "scale")]
        nodes = [
            helper.make_node("MatMul", ["x", "Wqkv"], ["qkv0"]),
            helper.make_node("Add", ["qkv0", "bqkv"], ["qkv"]),
            helper.make_node("Split", ["qkv", "split"], ["q0", "k0", "v0"], axis=2),
            helper.make_node("Reshape", ["q0", "heads_shape"], ["q1"]),
            helper.make_node("Reshape", ["k0", "heads_shape"], ["k1"]),
            helper.make_node("Reshape", ["v0", "heads_shape"], ["v1"]),
            helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
            helper.make_node("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
            helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
            helper.make_node("MatMul", ["q", "kt"], ["s0"]),
            helper.make_node("Mul", ["s0", "scale"], ["s"]),
            helper.make_node("Softmax", ["s"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["o0"]),
            helper.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["o1", "model_shape"], ["o"]),
        ]
    nodes += [helper.make_node("MatMul", ["o", "Wo"], ["y0"]), helper.make_node("Add", ["y0", "bo"], ["y"])]
    graph = helper.make_graph(nodes, "attention", [x], [y], init)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if fused else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    if not fused:
        onnx.checker.check_model(model)
    return model.SerializeToString()


def ort_session(model_bytes, threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def rel_l2(got, want64):
    """‖got − want64‖ / ‖want64‖, in float64."""
    diff = got.double() - want64
    return float(diff.norm() / want64.norm())


def bf16_peers(x, w, b, heads, mha):
    """PyTorch's float32 SDPA and its bfloat16 ways on the CPU: name -> fn returning float32."""
    w16 = [t.to(torch.bfloat16) for t in w]
    b16 = [t.to(torch.bfloat16) for t in b]

    def autocast(fn):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn().float()
        return run

    return {
        "torch-sdpa-fp32": lambda: forward(x, w, b, heads),
        "torch-sdpa-autocast": autocast(lambda: forward(x, w, b, heads)),
        "torch-mha-autocast": autocast(lambda: mha(x, x, x, need_weights=False)[0]),
        "torch-sdpa-bf16": lambda: forward(x.to(torch.bfloat16), w16, b16, heads).float(),
    }


def batches(shapes):
    """(name, heads, w, b, x) per shape: the layer (torch_attention.layer) and the input batch
    every peer of a shape shares."""
    for name in shapes.split(","):
        bsz, n, d, heads = SHAPES[name]
        w, b = layer(d, CPU, torch.float32)
        x = torch.randn(bsz, n, d, generator=torch.Generator().manual_seed(2))
        yield name, heads, w, b, x


def measure_bf16(args, versions):
    """--bf16: each peer's time and its divergence from float64 on the same batch."""
    records = []
    with torch.inference_mode():
        for name, heads, w, b, x in batches(args.shapes):
            d = x.shape[-1]
            want64 = forward(x.double(), [t.double() for t in w], [t.double() for t in b], heads)
            peers = bf16_peers(x, w, b, heads, mha_module(d, heads, w, b))
            for peer, fn in peers.items():
                err = rel_l2(fn(), want64)
                # A bfloat16 answer is ~1e-2 off at worst; far beyond is another computation.
                if err > 5e-2:
                    raise SystemExit(f"{name} {peer}: {err:.2e} from float64 (relative L2): not this layer")
                ms = median_ms(fn, CPU, args.min_time_s)
                precision = "fp32" if peer.endswith("fp32") else "bf16"
                records.append({"shape": name, "peer": peer, "device": "cpu", "threads": args.threads, "ms": ms,
                                "precision": precision, "rel_l2": err, **versions})
                print(f"{name:14s} {peer:20s} {ms:9.3f} ms   {err:.2e} from float64")
    return records


def measure_fp32(args, versions):
    """The four float32 peers (the docstring's first list), checked against each other."""
    records = []
    with torch.inference_mode():
        for name, heads, w, b, x in batches(args.shapes):
            d = x.shape[-1]
            xn = x.numpy()
            mha = mha_module(d, heads, w, b)
            graph = ort_session(onnx_graph(d, heads, w, b, fused=False), args.threads)
            fused = ort_session(onnx_graph(d, heads, w, b, fused=True), args.threads)
            peers = {
                "torch-mha": lambda: mha(x, x, x, need_weights=False)[0],
                "torch-sdpa": lambda: forward(x, w, b, heads),
                "ort-graph": lambda: graph.run(None, {"x": xn})[0],
                "ort-attention": lambda: fused.run(None, {"x": xn})[0],
            }
            # Same layer, same answer: a peer that computed something else would not be a peer.
            want = forward(x, w, b, heads).numpy()
            for peer, fn in peers.items():
                got = np.asarray(fn())
                err = float(np.abs(got - want).max() / np.abs(want).max())
                if err > 1e-4:
                    raise SystemExit(f"{name} {peer}: differs from torch-sdpa by {err:.2e} (relative max)")
            for peer, fn in peers.items():
                ms = median_ms(fn, CPU, args.min_time_s)
                records.append({"shape": name, "peer": peer, "device": "cpu", "threads": args.threads, "ms": ms,
                                **versions})
                print(f"{name:14s} {peer:14s} {ms:9.3f} ms")
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="bert-base,gpt2-medium,small-request")
    ap.add_argument("--min-time-s", type=float, default=0.5)
    ap.add_argument("--bf16", action="store_true", help="PyTorch in bfloat16 beside its float32 SDPA (docstring)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    versions = {"torch": torch.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__}
    print(f"peers on {args.threads} threads: " + ", ".join(f"{k} {v}" for k, v in versions.items()) +
          f"; mha fast path enabled: {torch.backends.mha.get_fastpath_enabled()}")
    records = (measure_bf16 if args.bf16 else measure_fp32)(args, versions)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
