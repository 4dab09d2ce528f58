"""Reference vectors from Hugging Face transformers' own LlamaAttention and PyTorch's SDPA (oracles
this project did not write): grouped-query heads, rotary embedding, causal masks, cross-attention
with a position offset, a custom d_head and a custom softmax scale.

For each layer, a randomly initialised LlamaAttention is built offline from a LlamaConfig (nothing
is downloaded) and written as a LLaMA checkpoint: LAYER/model.safetensors with the tensor names of
a LlamaForCausalLM (model.layers.0.self_attn.{q,k,v,o}_proj.{weight,bias}) and LAYER/config.json
as LlamaConfig.save_pretrained writes it. LAYER/cases.safetensors holds the cases (inputs, optional
context, expected outputs); manifest.json says what each case is.

Outputs are computed in float64 (the module and inputs cast to double; HF's rotary embedding still
forms its angles in float32, which at the positions used here, < 64, costs < 1e-7) and stored as
float32. Each case is also run in float32 (eager attention) and the manifest records how far that is
from the float64 answer: the noise floor a float32 implementation can be held to.

Further cases (manifest's long_cases and lowrank, files of their own so the cases above keep their
bytes): the grouped-query layer past the CPU backend's query blocks and key tiles at positions above
4096, with the rotary angles formed in float64; and attnserve's low-rank form at truncating ranks,
from its definition with numpy's SVD. Their inputs are float16 values, stored as F16.

Run with an interpreter that has torch, transformers and numpy:  python3 generate.py
"""
import json, os, struct
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

HERE = os.path.dirname(os.path.abspath(__file__))


def write_safetensors(path, tensors):
    """float16 arrays as F16, everything else as F32."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        half = isinstance(a, np.ndarray) and a.dtype == np.float16
        a = np.ascontiguousarray(a if half else np.asarray(a, dtype=np.float32))
        header[name] = {"dtype": "F16" if half else "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes()); off += a.nbytes
    h = json.dumps(header, sort_keys=True).encode(); h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Layer:
    """One LlamaAttention in float64 and the same weights in float32 (eager), with its rotary embedding."""

    def __init__(self, config, seed, std):
        torch.manual_seed(seed)
        config._attn_implementation = "sdpa"
        self.attn64 = LlamaAttention(config, layer_idx=0).eval()
        with torch.no_grad():
            for p in self.attn64.parameters(): p.copy_(torch.randn_like(p) * std)
        self.state = {k: v.detach().clone() for k, v in self.attn64.state_dict().items()}  # float32 values
        self.attn64 = self.attn64.double()
        cfg32 = LlamaConfig(**config.to_dict()); cfg32._attn_implementation = "eager"
        self.attn32 = LlamaAttention(cfg32, layer_idx=0).eval()
        self.attn32.load_state_dict(self.state)
        self.rope = LlamaRotaryEmbedding(config)
        self.config = config

    def attns(self):
        return [(self.attn64, torch.float64), (self.attn32, torch.float32)]

    def rotary(self, x, first, count, batch):
        pos = (first + torch.arange(count))[None, :].expand(batch, count)
        return self.rope(x, pos)

    def rotary64(self, x, first, count, batch):
        """cos and sin as LlamaRotaryEmbedding lays them out ([batch, count, d_head], the angles of
        pair t repeated at t and t + d_head/2), with the angles p · θ^(−2t/d_head) formed in
        float64: HF forms them in float32, which at positions past a few thousand is off by
        ~p · 2⁻²⁴ radians."""
        hd, theta = self.config.head_dim, self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = (first + torch.arange(count, dtype=torch.float64))[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)[None].expand(batch, count, hd)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def additive_mask(batch, n, m, causal, key_lengths, dtype, bottom_right=False):
    """[batch, 1, n, m]: 0 where query q may see key j, -inf elsewhere."""
    q = torch.arange(n)[:, None]; j = torch.arange(m)[None, :]
    allowed = torch.ones(batch, 1, n, m, dtype=torch.bool)
    if causal: allowed &= (j <= q + (m - n if bottom_right else 0))
    if key_lengths: allowed &= (torch.arange(m)[None, None, None, :] < torch.tensor(key_lengths)[:, None, None, None])
    return torch.zeros(batch, 1, n, m, dtype=dtype).masked_fill(~allowed, float("-inf"))


def run_self(layer, x, causal, offset, key_lengths, scale, rotary=None):
    """LlamaAttention.forward itself: the path a LlamaForCausalLM takes on a prompt. `rotary`:
    Layer.rotary (HF's LlamaRotaryEmbedding, the default) or Layer.rotary64."""
    outs = []
    for attn, dt in layer.attns():
        xx = x.to(dt)
        cos, sin = (rotary or layer.rotary)(xx, offset, x.shape[1], x.shape[0])
        saved_scaling, saved_causal = attn.scaling, attn.is_causal
        if scale is not None: attn.scaling = scale
        mask = None
        if key_lengths:
            mask = additive_mask(x.shape[0], x.shape[1], x.shape[1], causal, key_lengths, dt)
        else:
            attn.is_causal = causal
            if dt == torch.float32:  # eager ignores is_causal: give it the mask
                mask = additive_mask(x.shape[0], x.shape[1], x.shape[1], causal, None, dt)
        with torch.no_grad():
            y = attn(xx, position_embeddings=(cos, sin), attention_mask=mask)[0]
        attn.scaling, attn.is_causal = saved_scaling, saved_causal
        outs.append(y)
    return outs


def run_cross(layer, x, c, causal, offset, scale, key_lengths=None, rotary=None):
    """Cross-attention from LlamaAttention's own projections and rotary embedding, and PyTorch's
    SDPA (is_causal: top-left aligned; enable_gqa: contiguous groups). Queries at offset + q, keys at j;
    with key_lengths, SDPA is given the same top-left causal cut and the padding as a mask."""
    outs = []
    for attn, dt in layer.attns():
        xx, cc = x.to(dt), c.to(dt)
        b, n, m, hd = x.shape[0], x.shape[1], c.shape[1], attn.head_dim
        q = attn.q_proj(xx).view(b, n, -1, hd).transpose(1, 2)
        k = attn.k_proj(cc).view(b, m, -1, hd).transpose(1, 2)
        v = attn.v_proj(cc).view(b, m, -1, hd).transpose(1, 2)
        cq, sq = (rotary or layer.rotary)(xx, offset, n, b)
        ck, sk = (rotary or layer.rotary)(cc, 0, m, b)
        q, _ = apply_rotary_pos_emb(q, q, cq, sq)
        k, _ = apply_rotary_pos_emb(k, k, ck, sk)
        mask = additive_mask(b, n, m, causal, key_lengths, dt) if key_lengths else None
        with torch.no_grad():
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                               scale=scale, enable_gqa=True)
            y = attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
        outs.append(y)
    return outs


def run_decode(layer, prefix, x):
    """Generation with a KV cache, as LlamaForCausalLM.generate does it: the prefix at positions
    0..P-1 fills the cache, then the new tokens at P..P+n-1 attend to the cache and to themselves
    under the bottom-right aligned causal mask HF builds for a cache."""
    outs = []
    for attn, dt in layer.attns():
        pp, xx = prefix.to(dt), x.to(dt)
        b, P, n = x.shape[0], prefix.shape[1], x.shape[1]
        cache = DynamicCache(config=layer.config)
        with torch.no_grad():
            attn(pp, position_embeddings=layer.rotary(pp, 0, P, b),
                 attention_mask=additive_mask(b, P, P, True, None, dt), cache=cache)
            y = attn(xx, position_embeddings=layer.rotary(xx, P, n, b),
                     attention_mask=additive_mask(b, n, P + n, True, None, dt, bottom_right=True), cache=cache)[0]
        outs.append(y)
    return outs


LAYERS = [
    # name, LlamaConfig arguments, seed, weight std
    ("gqa", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0), 21, 0.15),
    ("gqa-bias-head-dim", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                               attention_bias=True, rope_theta=500000.0), 22, 0.15),
    ("mqa", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0), 23, 0.2),
]

# kind, batch, n, m, causal, position_offset, key_lengths, scale
CASES = [
    ("self", 2, 5, None, False, 0, None, None),
    ("self", 1, 9, None, True, 0, None, None),
    ("self", 2, 6, None, True, 37, None, None),
    ("self", 2, 6, None, False, 5, [6, 3], None),
    ("cross", 2, 3, 7, False, 0, None, None),
    ("cross", 1, 5, 9, True, 0, None, None),
    ("cross", 1, 6, 4, True, 0, None, None),
    ("cross", 2, 4, 6, False, 29, None, None),
    ("cross", 1, 5, 8, True, 11, None, None),
    ("self", 1, 7, None, True, 3, None, 0.05),
    ("cross", 2, 4, 9, True, 7, None, 0.3),
    ("decode", 2, 1, 8, False, 7, None, None),  # one new token after a prefix of 7
    ("decode", 1, 3, 8, True, 5, None, None),   # three new tokens after a prefix of 5 (bottom-right causal)
]

built = {}  # name: Layer, for the long and low-rank cases below
manifest = {"generator": "transformers LlamaAttention (random init from LlamaConfig, offline) and "
                         "torch.nn.functional.scaled_dot_product_attention; float64 on the CPU, stored as float32",
            "torch_version": torch.__version__, "transformers_version": transformers.__version__, "layers": {}}
for lname, args, seed, std in LAYERS:
    config = LlamaConfig(**args)
    layer = built[lname] = Layer(config, seed, std)
    d, hd = config.hidden_size, config.head_dim
    os.makedirs(os.path.join(HERE, lname), exist_ok=True)
    p = "model.layers.0.self_attn."
    write_safetensors(os.path.join(HERE, lname, "model.safetensors"), {p + k: v.numpy() for k, v in layer.state.items()})
    config.save_pretrained(os.path.join(HERE, lname))
    g = torch.Generator().manual_seed(seed + 100)
    cases, tensors = [], {}
    for i, (kind, b, n, m, causal, offset, kl, scale) in enumerate(CASES):
        x = torch.randn(b, n, d, generator=g)
        key = f"case{i}"
        info = {"name": key, "kind": kind, "causal": causal, "position_offset": offset, "key_lengths": kl,
                "scale": scale, "has_context": kind != "self", "causal_alignment": "top-left"}
        if kind == "self":
            y64, y32 = run_self(layer, x, causal, offset, kl, scale)
            info["oracle"] = "LlamaAttention.forward (sdpa; float32 run: eager)"
        elif kind == "cross":
            c = torch.randn(b, m, d, generator=g)
            y64, y32 = run_cross(layer, x, c, causal, offset, scale)
            info["oracle"] = "LlamaAttention projections + apply_rotary_pos_emb + scaled_dot_product_attention"
            tensors[key + ".context"] = c.numpy()
        else:
            prefix = torch.randn(b, offset, d, generator=g)
            c = torch.cat([prefix, x], dim=1)  # the keys: the cached prefix, then the new tokens
            assert c.shape[1] == m
            y64, y32 = run_decode(layer, prefix, x)
            info["oracle"] = "LlamaAttention.forward with a DynamicCache (generation)"
            info["causal_alignment"] = "bottom-right" if causal else "none"
            tensors[key + ".context"] = c.numpy()
        tensors[key + ".input"] = x.numpy()
        tensors[key + ".output"] = y64.to(torch.float32).numpy()
        info["float32_rel_l2"] = rel_l2(y32.detach().numpy(), y64.detach().numpy())
        cases.append(info)
    write_safetensors(os.path.join(HERE, lname, "cases.safetensors"), tensors)
    manifest["layers"][lname] = {"d_model": d, "heads": config.num_attention_heads,
                                 "kv_heads": config.num_key_value_heads, "d_head": hd,
                                 "rope_theta": config.rope_parameters["rope_theta"], "bias": config.attention_bias,
                                 "seed": seed, "weight_std": std, "cases": cases,
                                 "files": {"checkpoint": f"{lname}/model.safetensors", "config": f"{lname}/config.json",
                                           "cases": f"{lname}/cases.safetensors"}}
# Plain multi-head attention (no RoPE, bias on) in the three layouts of tests/data/torch-mha, for
# what those vectors lack: causal cross-attention (SDPA's top-left is_causal, m > n and m < n, with
# key padding) and a custom scale, from nn.MultiheadAttention's weights and PyTorch's SDPA.
manifest["mha_layers"] = {}
for lname, d, h, seed in [("mha", 48, 4, 31)]:
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(d, h, bias=True, batch_first=True).eval()
    with torch.no_grad():
        for prm in mha.parameters(): prm.copy_(torch.randn_like(prm) * 0.15)
    sd = {k: v.detach().numpy() for k, v in mha.state_dict().items()}
    W, b, Wo, bo = sd["in_proj_weight"], sd["in_proj_bias"], sd["out_proj.weight"], sd["out_proj.bias"]
    os.makedirs(os.path.join(HERE, lname), exist_ok=True)
    write_safetensors(os.path.join(HERE, lname, "torch-mha.safetensors"),
                      {"in_proj_weight": W, "in_proj_bias": b, "out_proj.weight": Wo, "out_proj.bias": bo})
    write_safetensors(os.path.join(HERE, lname, "gpt2.safetensors"),
                      {"h.0.attn.c_attn.weight": W.T, "h.0.attn.c_attn.bias": b, "h.0.attn.c_proj.weight": Wo.T,
                       "h.0.attn.c_proj.bias": bo})
    pb = "encoder.layer.0.attention."
    write_safetensors(os.path.join(HERE, lname, "bert.safetensors"),
                      {pb + "self.query.weight": W[:d], pb + "self.query.bias": b[:d], pb + "self.key.weight": W[d:2*d],
                       pb + "self.key.bias": b[d:2*d], pb + "self.value.weight": W[2*d:], pb + "self.value.bias": b[2*d:],
                       pb + "output.dense.weight": Wo, pb + "output.dense.bias": bo})
    Wd, bd, Wod, bod = (torch.tensor(a, dtype=torch.float64) for a in (W, b, Wo, bo))
    g = torch.Generator().manual_seed(seed + 100)
    cases, tensors = [], {}
    # batch, n, m, causal, key_lengths, scale
    for i, (bt, n, m, causal, kl, scale) in enumerate([(2, 4, 9, True, None, None), (1, 7, 3, True, None, None),
                                                        (2, 5, 8, True, [8, 6], None), (2, 3, 6, False, None, 0.7),
                                                        (1, 6, 10, True, None, 0.05)]):
        x = torch.randn(bt, n, d, generator=g); c = torch.randn(bt, m, d, generator=g)
        outs = []
        for dt in (torch.float64, torch.float32):
            Wt, bt_, Wot, bot = (t.to(dt) for t in (Wd, bd, Wod, bod))
            q = (x.to(dt) @ Wt[:d].T + bt_[:d]).view(bt, n, h, -1).transpose(1, 2)
            k = (c.to(dt) @ Wt[d:2*d].T + bt_[d:2*d]).view(bt, m, h, -1).transpose(1, 2)
            v = (c.to(dt) @ Wt[2*d:].T + bt_[2*d:]).view(bt, m, h, -1).transpose(1, 2)
            mask = None
            if kl:  # SDPA takes is_causal or a mask, not both: the same top-left causal mask, padded
                qi = torch.arange(n)[:, None]; kj = torch.arange(m)[None, :]
                mask = ((kj <= qi)[None, None] & (kj[None, None] < torch.tensor(kl)[:, None, None, None]))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and not kl, scale=scale)
            outs.append(o.transpose(1, 2).reshape(bt, n, d) @ Wot.T + bot)
        key = f"case{i}"
        tensors[key + ".input"] = x.numpy(); tensors[key + ".context"] = c.numpy()
        tensors[key + ".output"] = outs[0].to(torch.float32).numpy()
        cases.append({"name": key, "kind": "cross", "causal": causal, "causal_alignment": "top-left",
                      "position_offset": 0, "key_lengths": kl, "scale": scale, "has_context": True,
                      "oracle": "nn.MultiheadAttention weights + scaled_dot_product_attention",
                      "float32_rel_l2": rel_l2(outs[1].numpy(), outs[0].numpy())})
    write_safetensors(os.path.join(HERE, lname, "cases.safetensors"), tensors)
    manifest["mha_layers"][lname] = {"d_model": d, "heads": h, "kv_heads": h, "d_head": d // h, "rope_theta": 0,
                                     "bias": True, "seed": seed, "weight_std": 0.15, "cases": cases,
                                     "files": {"torch-mha": f"{lname}/torch-mha.safetensors",
                                               "gpt2": f"{lname}/gpt2.safetensors (index 0)",
                                               "bert": f"{lname}/bert.safetensors (index 0)",
                                               "cases": f"{lname}/cases.safetensors"}}


# ---- The low-rank form, from its definition, with numpy's SVD ---------------------------------
# attnserve's `lowrank` form (docs/sources.md, server/core/spectrum.h): per query head i, the OV
# product W_M_i = W_V_g(i) W_O_i (d × d; W_V = v_proj.weight^T, W_O_i = rows i·d_h.. of
# o_proj.weight^T) truncated to rank r_i, the value bias folded into the output bias as in the
# summed form (b_eff = b_O + Σ_i b_V_g(i) W_O_i: softmax rows sum to 1), so
#   Y = Σ_i softmax(scale · q_i k_g(i)^T + mask) C W_M_i^(r_i) + b_eff
# with q and k from the layer's own q_proj/k_proj and rotary embedding. Here each W_M_i^(r) is
# U_r S_r V_r^T from numpy's SVD in float64 and the attention is SDPA's, one head at a time.

def ov_products(layer):
    """The float64 W_M_i of every query head, from the stored (float32) weights."""
    cfg, st = layer.config, {k: v.double().numpy() for k, v in layer.state.items()}
    hd, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    w_v, w_o = st["v_proj.weight"].T, st["o_proj.weight"].T  # [d, hkv·hd], [h·hd, d]
    group = h // hkv
    return [w_v[:, (i // group) * hd:(i // group + 1) * hd] @ w_o[i * hd:(i + 1) * hd] for i in range(h)]


def select_ranks(sigmas, selection):
    """The ranks attnserve's SelectRanks picks, from numpy's singular values, and how far the pick is
    from flipping (the smallest gap, relative, between a threshold and the values around it)."""
    kind, value = selection.split(":")
    if kind == "energy":
        e, ranks, margin = float(value), [], 1.0
        for s in sigmas:
            share = np.cumsum(s ** 2) / np.sum(s ** 2)
            r = int(np.argmax(share >= e * (1 - 1e-12))) + 1
            ranks.append(r)
            margin = min(margin, share[r - 1] - e, e - share[r - 2] if r > 1 else 1.0)
        return ranks, margin
    budget = int(value)
    flat = sorted(((v, i) for i, s in enumerate(sigmas) for v in s), reverse=True)
    ranks = [0] * len(sigmas)
    for _, i in flat[:budget]: ranks[i] += 1
    return ranks, (flat[budget - 1][0] - flat[budget][0]) / flat[0][0]


def lowrank_forms(layer, selection):
    """The truncated W_M_i, b_eff, and what the manifest says of them: numpy's singular values, the
    ranks, the kept share of Σ_i Σ_j σ_ij² and the selection's margin."""
    cfg, st = layer.config, {k: v.double().numpy() for k, v in layer.state.items()}
    hd, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    svds = [np.linalg.svd(m) for m in ov_products(layer)]
    sigmas = [s[:min(cfg.hidden_size, hd)] for _, s, _ in svds]
    ranks, margin = select_ranks(sigmas, selection)
    assert margin > 1e-4, f"{selection}: a singular value lies too close to the threshold ({margin})"
    truncated = [(u[:, :r] * s[:r]) @ vt[:r] for (u, s, vt), r in zip(svds, ranks)]
    b_eff = np.zeros(cfg.hidden_size)
    if cfg.attention_bias:
        w_o, group = st["o_proj.weight"].T, h // hkv
        b_eff = st["o_proj.bias"] + sum(st["v_proj.bias"][(i // group) * hd:(i // group + 1) * hd] @
                                        w_o[i * hd:(i + 1) * hd] for i in range(h))
    kept = sum(float(np.sum(s[:r] ** 2)) for s, r in zip(sigmas, ranks)) / sum(float(np.sum(s ** 2)) for s in sigmas)
    info = {"selection": selection, "ranks": ranks, "kept_energy": kept, "selection_margin": float(margin),
            "ov_singular_values": [[float(v) for v in s] for s in sigmas]}
    return truncated, b_eff, info


def run_lowrank(layer, mats, b_eff, x, c, causal, offset, key_lengths):
    """Y above, in float64 and float32 (the same float64 matrices rounded). c: None for
    self-attention (keys: the input, at the queries' positions), else the context (keys from 0)."""
    outs = []
    for attn, dt in layer.attns():
        xx = x.to(dt); cc = xx if c is None else c.to(dt)
        b, n, m, hd, h = x.shape[0], x.shape[1], cc.shape[1], attn.head_dim, layer.config.num_attention_heads
        with torch.no_grad():
            q = attn.q_proj(xx).view(b, n, -1, hd).transpose(1, 2)
            k = attn.k_proj(cc).view(b, m, -1, hd).transpose(1, 2)
            cq, sq = layer.rotary64(xx, offset, n, b)
            ck, sk = layer.rotary64(cc, offset if c is None else 0, m, b)
            q, _ = apply_rotary_pos_emb(q, q, cq, sq)
            k, _ = apply_rotary_pos_emb(k, k, ck, sk)
            k = k.repeat_interleave(h // k.shape[1], dim=1)  # contiguous groups, as repeat_kv
            v = torch.stack([cc @ torch.tensor(mat, dtype=dt) for mat in mats], dim=1)  # [b, h, m, d]
            mask = additive_mask(b, n, m, causal, key_lengths, dt) if key_lengths else None
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
            outs.append(o.sum(dim=1) + torch.tensor(b_eff, dtype=dt))
    return outs


def half_randn(shape, g):
    """N(0, 1) draws rounded to float16 (stored as F16 without loss), as float32."""
    return torch.randn(*shape, generator=g).half().float()


def case_info(name, kind, causal, offset, key_lengths, oracle):
    return {"name": name, "kind": kind, "causal": causal, "causal_alignment": "top-left", "position_offset": offset,
            "key_lengths": key_lengths, "scale": None, "has_context": kind == "cross", "oracle": oracle}


# ---- Past the CPU backend's tiles, at positions above 4096 ------------------------------------
# The grouped-query layer `gqa` on sequences longer than a query block and a key tile of the CPU
# backend's tiled attention (server/core/forms.h: kQueryTile 256 stacked rows, i.e. 64 query rows
# when the 4 heads of a group stack, 256 for the low-rank form; kKeyTile 512 keys), queries at
# positions past 4096. At those positions HF's own float32 angles are off by ~1e-4 relative in the
# output (the manifest's hf_float32_angles_rel_l2), so the rotary embedding's cos and sin are
# formed from float64 angles (Layer.rotary64) and handed to LlamaAttention.forward and
# apply_rotary_pos_emb as their position_embeddings. Inputs are float16 values (stored as F16),
# outputs float32. The first case also holds the low-rank form's answer at a budget that truncates.
LONG_LOWRANK = "budget:20"
# name, kind, batch, n, m, causal, position_offset, key_lengths, with the low-rank answer
LONG_CASES = [
    ("long0", "self", 1, 600, None, True, 4500, None, True),
    ("long1", "cross", 2, 320, 700, False, 6000, [700, 517], False),
]
manifest["long_cases"], manifest["lowrank"] = {}, {}
layer = built["gqa"]
mats, b_eff, lr_info = lowrank_forms(layer, LONG_LOWRANK)
g = torch.Generator().manual_seed(21 + 200)
cases, tensors = [], {}
for name, kind, b, n, m, causal, offset, kl, with_lowrank in LONG_CASES:
    x = half_randn((b, n, layer.config.hidden_size), g)
    c = half_randn((b, m, layer.config.hidden_size), g) if kind == "cross" else None
    if kind == "self":
        y64, y32 = run_self(layer, x, causal, offset, kl, None, rotary=layer.rotary64)
        hf_angles = run_self(layer, x, causal, offset, kl, None)[0]
        info = case_info(name, kind, causal, offset, kl, "LlamaAttention.forward (sdpa; float32 run: eager), "
                                                         "cos and sin from float64 angles")
    else:
        y64, y32 = run_cross(layer, x, c, causal, offset, None, key_lengths=kl, rotary=layer.rotary64)
        hf_angles = run_cross(layer, x, c, causal, offset, None, key_lengths=kl)[0]
        info = case_info(name, kind, causal, offset, kl, "LlamaAttention projections + apply_rotary_pos_emb + "
                                                         "scaled_dot_product_attention, cos and sin from float64 angles")
        tensors[name + ".context"] = c.numpy().astype(np.float16)
    tensors[name + ".input"] = x.numpy().astype(np.float16)
    tensors[name + ".output"] = y64.to(torch.float32).numpy()
    info.update(batch=b, n=n, m=m or n, float32_rel_l2=rel_l2(y32.numpy(), y64.numpy()),
                hf_float32_angles_rel_l2=rel_l2(hf_angles.numpy(), y64.numpy()))
    # The low-rank answer at full rank is the layer's own: the definition above is HF's attention.
    full = run_lowrank(layer, ov_products(layer), b_eff, x, c, causal, offset, kl)[0]
    assert rel_l2(full.numpy(), y64.numpy()) < 1e-12, name
    if with_lowrank:
        l64, l32 = run_lowrank(layer, mats, b_eff, x, c, causal, offset, kl)
        tensors[name + ".lowrank_output"] = l64.to(torch.float32).numpy()
        info.update(lowrank=True, lowrank_float32_rel_l2=rel_l2(l32.numpy(), l64.numpy()),
                    lowrank_vs_full_rel_l2=rel_l2(l64.numpy(), y64.numpy()))
    cases.append(info)
write_safetensors(os.path.join(HERE, "gqa", "long.safetensors"), tensors)
manifest["long_cases"]["gqa"] = {"cases": sorted(cases, key=lambda c: c["name"]), "file": "gqa/long.safetensors",
                                 "rope_angles": "float64"}
manifest["lowrank"]["gqa"] = dict(lr_info, file="gqa/long.safetensors", cases=[c for c in cases if c.get("lowrank")])

# ---- The low-rank form on a layer with biases and d_head ≠ d_model / heads ----------------------
# `gqa-bias-head-dim` at an energy that truncates every head: causal self-attention past position
# 4096, padded self-attention, cross-attention with key lengths (causal and not).
LOWRANK_SELECTION = "energy:0.9"
# name, kind, batch, n, m, causal, position_offset, key_lengths
LOWRANK_CASES = [
    ("lowrank0", "self", 2, 9, None, True, 4100, None),
    ("lowrank1", "self", 2, 6, None, False, 3, [6, 4]),
    ("lowrank2", "cross", 2, 5, 12, False, 9, [12, 7]),
    ("lowrank3", "cross", 1, 6, 10, True, 0, [8]),
]
layer = built["gqa-bias-head-dim"]
mats, b_eff, lr_info = lowrank_forms(layer, LOWRANK_SELECTION)
g = torch.Generator().manual_seed(22 + 200)
cases, tensors = [], {}
for name, kind, b, n, m, causal, offset, kl in LOWRANK_CASES:
    x = half_randn((b, n, layer.config.hidden_size), g)
    c = half_randn((b, m, layer.config.hidden_size), g) if kind == "cross" else None
    l64, l32 = run_lowrank(layer, mats, b_eff, x, c, causal, offset, kl)
    if kind == "self":
        y64 = run_self(layer, x, causal, offset, kl, None, rotary=layer.rotary64)[0]
    else:
        y64 = run_cross(layer, x, c, causal, offset, None, key_lengths=kl, rotary=layer.rotary64)[0]
    full = run_lowrank(layer, ov_products(layer), b_eff, x, c, causal, offset, kl)[0]
    assert rel_l2(full.numpy(), y64.numpy()) < 1e-12, name
    info = case_info(name, kind, causal, offset, kl, "W_M_i truncated by numpy's SVD, LlamaAttention projections + "
                                                     "apply_rotary_pos_emb (float64 angles) + scaled_dot_product_attention")
    info.update(batch=b, n=n, m=m or n, lowrank=True, lowrank_float32_rel_l2=rel_l2(l32.numpy(), l64.numpy()),
                lowrank_vs_full_rel_l2=rel_l2(l64.numpy(), y64.numpy()))
    tensors[name + ".input"] = x.numpy().astype(np.float16)
    if c is not None: tensors[name + ".context"] = c.numpy().astype(np.float16)
    tensors[name + ".lowrank_output"] = l64.to(torch.float32).numpy()
    cases.append(info)
write_safetensors(os.path.join(HERE, "gqa-bias-head-dim", "lowrank.safetensors"), tensors)
manifest["lowrank"]["gqa-bias-head-dim"] = dict(lr_info, file="gqa-bias-head-dim/lowrank.safetensors", cases=cases)

json.dump(manifest, open(os.path.join(HERE, "manifest.json"), "w"), indent=1)
print("written", list(manifest["layers"]), list(manifest["mha_layers"]), "worst float32 run vs float64:",
      max(c["float32_rel_l2"] for k in ("layers", "mha_layers") for l in manifest[k].values() for c in l["cases"]))
print("long cases: worst float32 run", max(c["float32_rel_l2"] for c in manifest["long_cases"]["gqa"]["cases"]),
      "HF's float32 angles", max(c["hf_float32_angles_rel_l2"] for c in manifest["long_cases"]["gqa"]["cases"]),
      "low-rank: worst float32 run", max(c["lowrank_float32_rel_l2"] for l in manifest["lowrank"].values()
                                         for c in l["cases"]),
      "ranks", {k: l["ranks"] for k, l in manifest["lowrank"].items()})
