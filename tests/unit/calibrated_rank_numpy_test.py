#!/usr/bin/python3
"""lowrank=divergence:EPS on a real checkpoint against an independent numpy computation.

Calibration rows for all-MiniLM-L6-v2's layer 0 are what that layer reads: token and position
embeddings through the embedding LayerNorm, for seeded random token ids (no tokenizer needed).
bench/lowrank_timing loads the layer through the real store with
lowrank=divergence:EPS,calibration=FILE and runs the low-rank and factored forms on the CPU
backend over the same rows; it prints the ranks it chose, the divergence the store computed on
the calibration rows (float64) and the one the backend's float32 forms give there.

numpy, sharing no code with attnserve, then whitens by the rows' second moment itself (Cholesky
of XᵀX plus the documented ridge), truncates each head's W_M_i at the store's ranks, and runs
attention in float64 over the same 128-row sequences. It must find: the layer's divergence at
most EPS and equal to the store's (to 1e-3 relative); weight-only truncation at the same ranks
further off; and the backend's measured divergence equal to it at float32 precision.

Usage: calibrated_rank_numpy_test.py LOWRANK_TIMING   (skips, saying why, without the model)
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from attention_reference import read_safetensors, softmax_scores  # noqa: E402

EPS = 0.1
SEQ = 128
RIDGE = 1e-6


def model_dir():
    root = os.environ.get("ATTNSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attnserve")
    return os.path.join(root, "all-minilm-l6-v2")


def read(path):
    """The checkpoint's float32 tensors, as float64."""
    return {name: t.astype(np.float64) for name, t in read_safetensors(path).items() if t.dtype == np.float32}


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-12) * w + b


def outputs(t, x, head_matrices, b_eff, heads=12):
    """Y = b_eff + Σ_i A_i X M_i over sequences of SEQ rows (non-causal self-attention)."""
    p = "encoder.layer.0.attention.self."
    wq, wk = t[p + "query.weight"].T, t[p + "key.weight"].T
    bq, bk = t[p + "query.bias"], t[p + "key.bias"]
    d = x.shape[1]
    dh = d // heads
    y = np.tile(b_eff, (x.shape[0], 1))
    for start in range(0, x.shape[0], SEQ):
        xs = x[start:start + SEQ]
        q, k = xs @ wq + bq, xs @ wk + bk
        for i in range(heads):
            c = slice(i * dh, (i + 1) * dh)
            a = softmax_scores(q[:, c], k[:, c], False, -1)
            y[start:start + SEQ] += a @ xs @ head_matrices[i]
    return y


def main():
    timing = sys.argv[1]
    model = os.path.join(model_dir(), "model.safetensors")
    if not os.path.exists(model):
        print(f"SKIP: {model} is missing (scripts/fetch-model puts it there)")
        return 0
    t = read(model)
    rng = np.random.default_rng(5)
    ids = rng.integers(1000, 30000, size=(8, SEQ))
    x = np.vstack([layer_norm(t["embeddings.word_embeddings.weight"][s] + t["embeddings.position_embeddings.weight"][:SEQ]
                              + t["embeddings.token_type_embeddings.weight"][0],
                              t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"]) for s in ids])
    x32 = x.astype(np.float32)
    x = x32.astype(np.float64)  # the server reads the float32 file
    with tempfile.TemporaryDirectory() as tmp:
        calib = os.path.join(tmp, "calib.npy")
        np.save(calib, x32)
        source = f"safetensors:{model},arch=bert,index=0"
        out = subprocess.run([timing, "--source", source, "--inputs", calib, "--repeats", "1",
                              "--selection", f"divergence:{EPS},calibration={calib}"],
                             check=True, capture_output=True, text=True).stdout
    served = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    ranks = served["ranks"]

    p = "encoder.layer.0.attention."
    wv, wo = t[p + "self.value.weight"].T, t[p + "output.dense.weight"].T
    bv, bo = t[p + "self.value.bias"], t[p + "output.dense.bias"]
    d, heads = x.shape[1], 12
    dh = d // heads
    b_eff = bo + bv @ wo
    g = x.T @ x
    g += RIDGE * np.trace(g) / d * np.eye(d)
    s_up = np.linalg.cholesky(g).T
    exact, aware, weight = [], [], []
    for i in range(heads):
        w_m = wv[:, i * dh:(i + 1) * dh] @ wo[i * dh:(i + 1) * dh]
        r = ranks[i]
        u, sv, vt = np.linalg.svd(s_up @ w_m)
        aware.append(np.linalg.solve(s_up, u[:, :r] * sv[:r]) @ vt[:r])
        u, sv, vt = np.linalg.svd(w_m)
        weight.append((u[:, :r] * sv[:r]) @ vt[:r])
        exact.append(w_m)
    y = outputs(t, x, exact, b_eff)
    rel = lambda m: float(np.linalg.norm(outputs(t, x, m, b_eff) - y) / np.linalg.norm(y))
    d_aware, d_weight = rel(aware), rel(weight)

    failures = []
    if not sum(ranks) < heads * dh:
        failures.append(f"EPS {EPS} kept every direction ({sum(ranks)})")
    if not d_aware <= EPS:
        failures.append(f"numpy's layer divergence {d_aware:.6g} > EPS {EPS}")
    if not abs(d_aware - served["calibration_divergence"]) <= 1e-3 * d_aware:
        failures.append(f"the store says {served['calibration_divergence']:.6g}, numpy {d_aware:.6g}")
    if not abs(served["divergence"] - d_aware) <= 1e-3 * d_aware + 1e-5:
        failures.append(f"the CPU backend's forms differ by {served['divergence']:.6g}, numpy {d_aware:.6g}")
    if not d_weight > d_aware:
        failures.append(f"weight-only truncation at the same ranks is not further off: {d_weight:.6g} <= {d_aware:.6g}")
    print(f"ranks {ranks} (R = {sum(ranks)} of {heads * dh}); divergence on the calibration rows: store "
          f"{served['calibration_divergence']:.6g}, numpy {d_aware:.6g}, CPU backend {served['divergence']:.6g}; "
          f"weight-only at the same ranks {d_weight:.6g}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
