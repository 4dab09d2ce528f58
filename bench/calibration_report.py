#!/usr/bin/python3
"""Ranks chosen by data on all-MiniLM-L6-v2: the tables and plot of docs/spectra.md.

  bench/calibration_report.py [--build build] [--out DIR] [--eps 0.02,0.05,0.1,0.2] [--repeats 15]

1. Real text (this repository's docs/*.md, prose only) is tokenised with the model's own
   WordPiece vocabulary (tokenizer.json, from scripts/fetch-model) into sequences of 128 tokens;
   files at even positions of the sorted list are the calibration text, the others held out.
2. A float64 numpy forward of the whole BERT encoder (embeddings + LayerNorm, then each layer's
   attention, residual, LayerNorm, GELU feed-forward, residual, LayerNorm) gives every layer's
   real input rows: the hidden states that enter it. They are written as OUT/calib-L.npy and
   OUT/heldout-L.npy (float32 [rows, 384]).
3. Per layer, on the held-out rows: the relative L2 of the attention output against the exact
   one, for every uniform per-head rank r = 1..32, with weight-only truncation (top singular
   directions of W_M_i) and activation-aware truncation (whitened by the calibration rows'
   XᵀX, as lowrank=divergence: does), in float64.
4. Per layer and EPS: the server's own lowrank=divergence:EPS form (build/bench/lowrank_timing,
   through the LayerStore and the CPU backend) — its ranks, calibration and held-out divergence
   and time against factored — and the weight-only form of equal held-out divergence
   (lowrank=budget:12·r for the smallest uniform weight-only r that reaches it), timed likewise.
Prints markdown; writes OUT/curves.json and docs-ready SVG OUT/minilm-calibrated-ranks.svg.
"""
import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import unicodedata

import numpy as np

# The checkpoint reader and softmax of the tests' float64 reference (tests/tools).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools"))
from attention_reference import read_safetensors as read_tensors, softmax_scores  # noqa: E402

SEQ = 128


def cache_dir():
    root = os.environ.get("ATTNSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attnserve")
    return os.path.join(root, "all-minilm-l6-v2")


def read_safetensors(path):
    """The checkpoint's float32 tensors, as float64."""
    return {name: t.astype(np.float64) for name, t in read_tensors(path).items() if t.dtype == np.float32}


class WordPiece:
    """BERT's uncased tokenizer: clean, lowercase, strip accents, split on whitespace and
    punctuation, then greedy longest-match word pieces."""

    def __init__(self, tokenizer_json):
        with open(tokenizer_json) as f:
            self.vocab = json.load(f)["model"]["vocab"]

    def words(self, text):
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        out = []
        for word in text.split():
            cur = ""
            for c in word:
                if unicodedata.category(c).startswith("P") or (33 <= ord(c) <= 47) or (58 <= ord(c) <= 64) or (
                        91 <= ord(c) <= 96) or (123 <= ord(c) <= 126):
                    if cur:
                        out.append(cur)
                    out.append(c)
                    cur = ""
                else:
                    cur += c
            if cur:
                out.append(cur)
        return out

    def ids(self, text):
        unk = self.vocab["[UNK]"]
        out = []
        for w in self.words(text):
            start, pieces = 0, []
            while start < len(w):
                end = len(w)
                while end > start:
                    piece = ("##" if start else "") + w[start:end]
                    if piece in self.vocab:
                        pieces.append(self.vocab[piece])
                        break
                    end -= 1
                if end == start:
                    pieces = [unk]
                    break
                start = end
            out.extend(pieces)
        return out


def prose(path):
    """The running text of a markdown file: no code blocks, tables, or markup characters."""
    lines, code = [], False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            code = not code
            continue
        if code or line.lstrip().startswith("|") or line.lstrip().startswith("!["):
            continue
        lines.append(re.sub(r"[`*#>\[\]]", " ", line))
    return " ".join(lines)


def sequences(tok, files):
    ids = []
    for path in files:
        ids.extend(tok.ids(prose(path)))
    cls, sep = tok.vocab["[CLS]"], tok.vocab["[SEP]"]
    body = SEQ - 2
    return [[cls] + ids[i:i + body] + [sep] for i in range(0, len(ids) - body + 1, body)]


def layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def attention(t, l, h, heads=12):
    p = f"encoder.layer.{l}.attention."
    q = h @ t[p + "self.query.weight"].T + t[p + "self.query.bias"]
    k = h @ t[p + "self.key.weight"].T + t[p + "self.key.bias"]
    v = h @ t[p + "self.value.weight"].T + t[p + "self.value.bias"]
    n, d = h.shape
    dh = d // heads
    out = np.zeros((n, d))
    for i in range(heads):
        c = slice(i * dh, (i + 1) * dh)
        a = softmax_scores(q[:, c], k[:, c], False, -1)
        out[:, c] = a @ v[:, c]
    return out @ t[p + "output.dense.weight"].T + t[p + "output.dense.bias"]


def hidden_states(t, seqs, layers=6):
    """The rows entering each layer, stacked over the sequences: [layers][rows, d]."""
    states = [[] for _ in range(layers)]
    for ids in seqs:
        n = len(ids)
        h = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n] + \
            t["embeddings.token_type_embeddings.weight"][0]
        h = layer_norm(h, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])
        for l in range(layers):
            states[l].append(h)
            p = f"encoder.layer.{l}."
            h = layer_norm(h + attention(t, l, h), t[p + "attention.output.LayerNorm.weight"],
                           t[p + "attention.output.LayerNorm.bias"])
            inter = gelu(h @ t[p + "intermediate.dense.weight"].T + t[p + "intermediate.dense.bias"])
            h = layer_norm(h + inter @ t[p + "output.dense.weight"].T + t[p + "output.dense.bias"],
                           t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"])
    return [np.vstack(s) for s in states]


def curves(t, l, calib, held, heads=12):
    """Held-out divergence for every uniform per-head rank r, weight-only and activation-aware."""
    p = f"encoder.layer.{l}.attention."
    wq, wk = t[p + "self.query.weight"].T, t[p + "self.key.weight"].T
    wv, wo = t[p + "self.value.weight"].T, t[p + "output.dense.weight"].T
    bq, bk, bv, bo = (t[p + n] for n in ("self.query.bias", "self.key.bias", "self.value.bias", "output.dense.bias"))
    d = wq.shape[0]
    dh = d // heads
    g = calib.T @ calib
    g += 1e-6 * np.trace(g) / d * np.eye(d)
    s_up = np.linalg.cholesky(g).T  # SᵀS = XᵀX + ridge
    b_eff = bo + sum(bv[i * dh:(i + 1) * dh] @ wo[i * dh:(i + 1) * dh] for i in range(heads))
    # Z_i = A_i X over the held-out sequences.
    z = [np.zeros_like(held) for _ in range(heads)]
    for start in range(0, held.shape[0], SEQ):
        x = held[start:start + SEQ]
        q, k = x @ wq + bq, x @ wk + bk
        for i in range(heads):
            c = slice(i * dh, (i + 1) * dh)
            a = softmax_scores(q[:, c], k[:, c], False, -1)
            z[i][start:start + SEQ] = a @ x
    bases = {"weight": [], "aware": []}
    y = np.tile(b_eff, (held.shape[0], 1))
    for i in range(heads):
        w_m = wv[:, i * dh:(i + 1) * dh] @ wo[i * dh:(i + 1) * dh]
        y += z[i] @ w_m
        u, sv, vt = np.linalg.svd(w_m)
        bases["weight"].append((z[i] @ u[:, :dh], sv[:dh], vt[:dh]))
        u, sv, vt = np.linalg.svd(s_up @ w_m)
        bases["aware"].append((z[i] @ np.linalg.solve(s_up, u[:, :dh]), sv[:dh], vt[:dh]))
    norm = np.linalg.norm(y)
    out = {}
    for method, heads_basis in bases.items():
        out[method] = []
        for r in range(0, dh + 1):
            err = sum(zu[:, r:] @ (sv[r:, None] * vt[r:]) for zu, sv, vt in heads_basis)
            out[method].append(float(np.linalg.norm(err) / norm))
    return out


def run_timing(build, layer, held_path, selections, repeats):
    source = f"safetensors:{cache_dir()}/model.safetensors,arch=bert,index={layer}"
    cmd = [os.path.join(build, "bench", "lowrank_timing"), "--source", source, "--inputs", held_path,
           "--repeats", str(repeats)]
    for s in selections:
        cmd += ["--selection", s]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def svg(all_curves, served, path):
    """Six panels, one per layer: held-out divergence (log y) against total rank R = 12·r."""
    w, h, cols = 300, 220, 3
    left, top = 50, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * w + 20}" height="{2 * h + 70}" '
             f'font-family="Helvetica, Arial, sans-serif">',
             '<title>all-MiniLM-L6-v2: divergence against rank, weight-only and activation-aware</title>',
             '<rect width="100%" height="100%" fill="#ffffff"/>',
             '<text x="20" y="22" font-size="15" font-weight="bold">all-MiniLM-L6-v2: held-out output divergence '
             'against total rank R (uniform per head)</text>',
             '<text x="20" y="40" font-size="11" fill="#444444">blue: weight-only truncation; orange: '
             'activation-aware (whitened by the calibration rows); dots: lowrank=divergence:EPS as served</text>']
    ymin, ymax = 1e-3, 1.0

    def ypix(v, oy):
        v = min(max(v, ymin), ymax)
        return oy + (h - 60) * (math.log10(ymax) - math.log10(v)) / (math.log10(ymax) - math.log10(ymin))

    for l, c in enumerate(all_curves):
        ox, oy = 20 + (l % cols) * w + left - 20, 60 + (l // cols) * h + top - 20
        pw = w - left - 10
        parts.append(f'<text x="{ox}" y="{oy - 6}" font-size="12" font-weight="bold">layer {l}</text>')
        parts.append(f'<rect x="{ox}" y="{oy}" width="{pw}" height="{h - 60}" fill="none" stroke="#888888"/>')
        for v in (1e-3, 1e-2, 1e-1, 1):
            y = ypix(v, oy)
            parts.append(f'<line x1="{ox}" y1="{y:.1f}" x2="{ox + pw}" y2="{y:.1f}" stroke="#dddddd"/>')
            parts.append(f'<text x="{ox - 4}" y="{y + 4:.1f}" font-size="9" text-anchor="end">{v:g}</text>')
        for r in (0, 96, 192, 288, 384):
            x = ox + pw * r / 384
            parts.append(f'<text x="{x:.1f}" y="{oy + h - 46}" font-size="9" text-anchor="middle">{r}</text>')
        parts.append(f'<text x="{ox + pw / 2:.1f}" y="{oy + h - 34}" font-size="10" text-anchor="middle">'
                     'total rank R = Σ r_i</text>')
        parts.append(f'<text x="{ox - 36}" y="{oy + (h - 60) / 2:.1f}" font-size="10" text-anchor="middle" '
                     f'transform="rotate(-90 {ox - 36} {oy + (h - 60) / 2:.1f})">rel L2 vs factored</text>')
        for method, color in (("weight", "#1f77b4"), ("aware", "#ff7f0e")):
            pts = " ".join(f"{ox + pw * 12 * r / 384:.1f},{ypix(v, oy):.1f}" for r, v in enumerate(c[method]) if r > 0)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{pts}"/>')
        for s in served[l]:
            if s["selection"].startswith("divergence:"):
                x, y = ox + pw * s["total_rank"] / 384, ypix(s["divergence"], oy)
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#d62728"><title>{s["selection"]}: '
                             f'R={s["total_rank"]}, held-out {s["divergence"]:.3g}</title></circle>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", default="calibration-report")
    ap.add_argument("--eps", default="0.02,0.05,0.1,0.2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-seqs", type=int, default=24)
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tok_path = os.path.join(cache_dir(), "tokenizer.json")
    if not os.path.exists(tok_path):
        sys.exit(f"calibration_report: {tok_path} is missing: run scripts/fetch-model")
    os.makedirs(args.out, exist_ok=True)
    t = read_safetensors(os.path.join(cache_dir(), "model.safetensors"))
    tok = WordPiece(tok_path)
    files = sorted(glob.glob(os.path.join(repo, "docs", "*.md")))
    calib_seqs = sequences(tok, files[0::2])[:args.max_seqs]
    held_seqs = sequences(tok, files[1::2])[:args.max_seqs]
    print(f"<!-- bench/calibration_report.py: {len(calib_seqs)} calibration and {len(held_seqs)} held-out "
          f"sequences of {SEQ} tokens -->\n")
    calib, held = hidden_states(t, calib_seqs), hidden_states(t, held_seqs)
    eps = [float(e) for e in args.eps.split(",")]
    all_curves, served = [], []
    for l in range(6):
        cp, hp = os.path.join(args.out, f"calib-{l}.npy"), os.path.join(args.out, f"heldout-{l}.npy")
        np.save(cp, calib[l].astype(np.float32))
        np.save(hp, held[l].astype(np.float32))
        c = curves(t, l, calib[l], held[l])
        all_curves.append(c)
        first = run_timing(args.build, l, hp, [f"divergence:{e:g},calibration={os.path.abspath(cp)}" for e in eps],
                           args.repeats)
        # The weight-only form of equal held-out divergence: the smallest uniform r that reaches it.
        budgets = []
        for s in first:
            r = next((r for r, v in enumerate(c["weight"]) if v <= s["divergence"]), 32)
            budgets.append(f"budget:{12 * max(r, 1)}")
        second = run_timing(args.build, l, hp, budgets, args.repeats)
        served.append(first + second)
        for s, b in zip(first, second):
            print(json.dumps({"layer": l, "aware": s, "weight_only": b}))
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump({"curves": all_curves, "served": served}, f)
    svg(all_curves, served, os.path.join(args.out, "minilm-calibrated-ranks.svg"))


if __name__ == "__main__":
    main()
