#!/usr/bin/python3
"""An independent float64 computation of a BERT checkpoint's attention layers, for
tests/unit/real_model_test.cc.

It shares no code with attnserve: it reads the safetensors file itself (8-byte little-endian
header length, JSON header, raw little-endian data), takes the weights in nn.Linear's [out, in]
layout, and computes with numpy in float64:

  exact    Y = concat_i(A_i (C W_V_i + b_V_i)) W_O + b_O,  A_i = softmax(Q_i K_i^T / sqrt(d_h) + mask)
  lowrank  each head's W_M_i = W_V_i W_O_i truncated to the fewest singular directions that keep
           a share E of its squared Frobenius norm (numpy's SVD of the d×d matrix), then
           Y = sum_i A_i C W_M_i^(r_i) + b_O + sum_i b_V_i W_O_i
  spectra  the singular values of W_M_i (OV) and of W_Q_i W_K_i^T (QK), from the full d×d SVD

Usage: attention_reference.py MODEL.safetensors CASES.json INPUTS.safetensors OUT.safetensors
CASES.json: {"heads": H, "layers": [0, ...], "energies": [E, ...],
             "cases": [{"name": N, "causal": bool, "key_length": K or -1, "cross": bool}]}
INPUTS holds N.input [n, d] and, for cross-attention, N.context [m, d] (F32).
OUT gets F64 tensors L{i}.{N}.exact [n, d], L{i}.ov_sv, L{i}.qk_sv [h, d_h], and per energy
E = energies[k]: L{i}.{N}.lowrank.{k} [n, d] and L{i}.ranks.{k} [h] (whole numbers).
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")
        tensors[name] = np.frombuffer(data[base + begin : base + end], dtype=dtype).reshape(info["shape"])
    return tensors


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = {np.dtype(np.float64): "F64"}[array.dtype]
        blob = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def torch_mha_forward(weights, heads, x, context=None, causal=False, key_lengths=None):
    """nn.MultiheadAttention in float64 from its state_dict (`weights`: in_proj_weight,
    in_proj_bias, out_proj.weight, out_proj.bias): [Q|K|V] = [x|c|c] in_proj_weightᵀ + in_proj_bias,
    per head softmax(Q Kᵀ/√d_h + mask) V, concatenated, then out_proj. x: [batch, n, d]; context:
    [batch, m, d] or None (self-attention); masks: causal (key j > query i) and key padding (j >=
    key_lengths[row])."""
    w, b = np.asarray(weights["in_proj_weight"], np.float64), np.asarray(weights["in_proj_bias"], np.float64)
    wo = np.asarray(weights["out_proj.weight"], np.float64)
    bo = np.asarray(weights["out_proj.bias"], np.float64)
    d = w.shape[1]
    dh = d // heads
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        c = x[r] if context is None else np.asarray(context[r], np.float64)
        q, k, v = x[r] @ w[:d].T + b[:d], c @ w[d:2 * d].T + b[d:2 * d], c @ w[2 * d:].T + b[2 * d:]
        n, m = q.shape[0], k.shape[0]
        visible = np.ones((n, m), bool)
        if causal:
            visible &= np.arange(m)[None, :] <= np.arange(n)[:, None]
        if key_lengths is not None:
            visible &= np.arange(m)[None, :] < key_lengths[r]
        mixed = []
        for h in range(heads):
            s = np.where(visible, q[:, h * dh:(h + 1) * dh] @ k[:, h * dh:(h + 1) * dh].T / np.sqrt(dh), -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            mixed.append((s / s.sum(axis=1, keepdims=True)) @ v[:, h * dh:(h + 1) * dh])
        out[r] = np.concatenate(mixed, axis=1) @ wo.T + bo
    return out


def rel_l2(got, want):
    """||got - want|| / ||want||, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def rank_for_energy(s, energy):
    power = s * s
    total = power.sum()
    if total == 0:
        return 0
    kept = np.cumsum(power)
    return int(np.argmax(kept >= energy * total)) + 1


def softmax_scores(q, k, causal, key_length):
    """A = softmax(q k^T / sqrt(d_h)) over the visible keys; q [n, d_h], k [m, d_h]."""
    n, m = q.shape[0], k.shape[0]
    scores = q @ k.T / np.sqrt(q.shape[1])
    visible = np.ones((n, m), dtype=bool)
    if key_length >= 0:
        visible[:, key_length:] = False
    if causal:
        visible &= np.tril(np.ones((n, m), dtype=bool))
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=1, keepdims=True)


def main():
    model_path, cases_path, inputs_path, out_path = sys.argv[1:5]
    weights = read_safetensors(model_path)
    with open(cases_path) as f:
        spec = json.load(f)
    inputs = read_safetensors(inputs_path)
    heads, energies = spec["heads"], spec["energies"]
    out = {}
    for layer in spec["layers"]:
        p = f"encoder.layer.{layer}.attention."
        get = lambda name: weights[p + name].astype(np.float64)
        # nn.Linear: y = x W^T + b, W stored [out, in].
        w_q, w_k, w_v, w_o = get("self.query.weight").T, get("self.key.weight").T, get("self.value.weight").T, get(
            "output.dense.weight").T
        b_q, b_k, b_v, b_o = get("self.query.bias"), get("self.key.bias"), get("self.value.bias"), get(
            "output.dense.bias")
        d = w_q.shape[0]
        dh = w_q.shape[1] // heads
        cols = lambda i: slice(i * dh, (i + 1) * dh)

        ov_sv, qk_sv = [], []
        ranks = [[] for _ in energies]
        truncated = [[] for _ in energies]  # [energy][head]: W_M_i^(r_i)
        for i in range(heads):
            w_m = w_v[:, cols(i)] @ w_o[cols(i), :]
            u, s, vt = np.linalg.svd(w_m)
            ov_sv.append(s[:dh])
            for k, energy in enumerate(energies):
                r = rank_for_energy(s, energy)
                ranks[k].append(r)
                truncated[k].append((u[:, :r] * s[:r]) @ vt[:r, :])
            qk_sv.append(np.linalg.svd(w_q[:, cols(i)] @ w_k[:, cols(i)].T, compute_uv=False)[:dh])
        b_eff = b_o + sum(b_v[cols(i)] @ w_o[cols(i), :] for i in range(heads))
        out[f"L{layer}.ov_sv"] = np.array(ov_sv)
        out[f"L{layer}.qk_sv"] = np.array(qk_sv)
        for k in range(len(energies)):
            out[f"L{layer}.ranks.{k}"] = np.array(ranks[k], dtype=np.float64)  # F64: the test reads floats only

        for case in spec["cases"]:
            name = case["name"]
            x = inputs[name + ".input"].astype(np.float64)
            c = inputs[name + ".context"].astype(np.float64) if case["cross"] else x
            q, k, v = x @ w_q + b_q, c @ w_k + b_k, c @ w_v + b_v
            concat = np.zeros((x.shape[0], heads * dh))
            lowrank = [np.tile(b_eff, (x.shape[0], 1)) for _ in energies]
            for i in range(heads):
                a = softmax_scores(q[:, cols(i)], k[:, cols(i)], case["causal"], case["key_length"])
                concat[:, cols(i)] = a @ v[:, cols(i)]
                for e in range(len(energies)):
                    lowrank[e] += a @ (c @ truncated[e][i])
            out[f"L{layer}.{name}.exact"] = concat @ w_o + b_o
            for e in range(len(energies)):
                out[f"L{layer}.{name}.lowrank.{e}"] = lowrank[e]
    write_safetensors(out_path, out)


if __name__ == "__main__":
    main()
