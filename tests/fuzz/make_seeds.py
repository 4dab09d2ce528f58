#!/usr/bin/python3
"""Writes the seed corpora of the fuzz targets that need no project code to make them
(tests/fuzz/corpus/{safetensors,npy,source,yaml_config}); forward_request's seeds come from
forward_request_seeds.cc, which uses the generated proto classes. Deterministic; run with
Debian's python3 (numpy) from the repository root:

    tests/fuzz/make_seeds.py

Every seed is small (the whole corpus is a few KB): valid inputs and near-valid ones that each
break one rule, so the fuzzer starts past the format's magic, lengths and JSON/YAML syntax.
"""
import json
import pathlib
import re
import struct

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests/fuzz/corpus"


def write(target, name, data):
    path = CORPUS / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


# ---- safetensors ----------------------------------------------------------------------------

def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, bytes)] → a file image, offsets in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(text)) + text + data


def trimmed(layout, d=4):
    """The real tests/data/torch-mha checkpoint of a layout, every tensor cut to d_model = d (the
    leading block of the real values), same names and dtypes."""
    header, data = read_safetensors(ROOT / f"tests/data/torch-mha/small.{layout}.safetensors")
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        full = np.frombuffer(data[begin:end], dtype="<f4").reshape(info["shape"])
        # Dims that are 3·d_model (packed q, k, v) become 3·d, the others d.
        cut = tuple(slice(0, 3 * d if s == 3 * 64 else d) for s in full.shape)
        small = np.ascontiguousarray(full[cut])
        out.append((name, "F32", small.shape, small.astype("<f4").tobytes()))
    return out


def make_safetensors():
    for layout in ("torch-mha", "gpt2", "bert"):
        write("safetensors", f"small_{layout}", safetensors(trimmed(layout)))
    values = np.arange(6, dtype=np.float64) / 4 - 0.5
    write("safetensors", "dtypes", safetensors([
        ("f64", "F64", [2, 3], values.astype("<f8").tobytes()),
        ("f16", "F16", [3, 2], values.astype("<f2").tobytes()),
        ("bf16", "BF16", [6], (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()),
        ("position_ids", "I64", [1, 3], np.arange(3, dtype="<i8").tobytes()),
        ("mask", "BOOL", [2], b"\x01\x00"),
        ("scale", "F32", [], np.float32(0.125).tobytes()),
        ("empty", "F32", [0, 4], b""),
    ], metadata={"format": "pt", "note": "fuzz seed"}))
    base = trimmed("torch-mha", d=2)
    good = safetensors(base)
    write("safetensors", "truncated_data", good[:-5])
    write("safetensors", "header_length_past_end", struct.pack("<Q", 1 << 20) + good[8:64])
    bad_offsets = safetensors(base).replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1)
    write("safetensors", "offsets_shifted", bad_offsets)
    write("safetensors", "shape_mismatch", safetensors([("w", "F32", [3, 3], np.zeros(8, "<f4").tobytes())]))
    write("safetensors", "unknown_dtype", safetensors([("w", "F12", [2], b"\0" * 4)]))


# ---- npy --------------------------------------------------------------------------------------

def npy_image(array, version=None):
    import io
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
    return buf.getvalue()


def make_npy():
    a = (np.arange(12, dtype=np.float32).reshape(1, 3, 4) - 6) / 8
    write("npy", "f4_3d", npy_image(a))
    write("npy", "f8_2d", npy_image(a.reshape(3, 4).astype(np.float64)))
    write("npy", "f4_scalar", npy_image(np.float32(1.5)))
    write("npy", "f4_empty", npy_image(np.zeros((0, 4), dtype=np.float32)))
    write("npy", "f4_v2", npy_image(a.reshape(12), version=(2, 0)))
    write("npy", "f4_fortran", npy_image(np.asfortranarray(a.reshape(3, 4))))
    write("npy", "big_endian", npy_image(a.reshape(3, 4).astype(">f4")))
    write("npy", "int32", npy_image(np.arange(4, dtype=np.int32)))
    write("npy", "truncated", npy_image(a)[:-3])


# ---- SOURCE -----------------------------------------------------------------------------------

def make_source():
    # Every SOURCE in docs/sources.md and the README, and near-valid variants.
    text = (ROOT / "docs/sources.md").read_text() + (ROOT / "README.md").read_text()
    found = sorted(set(re.findall(r"(?:random|safetensors):[A-Za-z0-9_./=,:+-]+", text)))
    found = [s.rstrip(".,") for s in found if "..." not in s and not s.endswith(":")]
    extra = [
        "random:d_model=64,heads=4,kv_heads=2,d_head=32,bias=false,seed=18446744073709551615,summed=false",
        "random:d_model=8,heads=2,spectrum=false,rope_theta=1e12",
        "random: d_model = 8 , heads = 2 , lowrank = energy:1",
        "random:d_model=8,heads=2,d_model=8",
        "random:d_model=8,heads=3",
        "random:d_model=65537,heads=1",
        "random:d_model=8,heads=2,lowrank=budget:0",
        "random:d_model=8,heads=2,lowrank=energy:0.99,spectrum=false",
        "safetensors:m.safetensors,arch=torch-mha,index=1",
        "safetensors:m.safetensors,prefix=,heads=2,kv_heads=1,rope_theta=-1",
        "safetensors:,arch=llama",
        "file:/etc/passwd",
    ]
    for i, s in enumerate(found + extra):
        write("source", f"source_{i:02d}", s)


# ---- YAML config ------------------------------------------------------------------------------

def make_yaml():
    cm = (ROOT / "deploy/k8s/base/configmap.yaml").read_text()
    block = cm.split("attnserve.yaml: |\n", 1)[1]
    config = "".join(line[4:] + "\n" for line in block.splitlines())
    write("yaml_config", "configmap", config)
    service = (ROOT / "docs/service.md").read_text()
    example = re.search(r"```yaml\n(# attnserve.yaml\n.*?)```", service, re.S).group(1)
    write("yaml_config", "service_md", example)
    write("yaml_config", "every_kind", (
        "port_file: /tmp/port\n"
        "max_batch_requests: 4\n"
        "max_queue_delay_us: 100\n"
        "device: cpu\n"
        "gpu_math: tf32\n"
        "shadow_rate: 0.5\n"
        "log_json: false\n"
        "model_dirs: [/models, /srv/models]\n"
        "routes:\n  '*': factored:50,summed:50\n  toy: summed:100\n"
        "layers: {toy: 'random:d_model=8,heads=2'}\n"))
    write("yaml_config", "unknown_key", "listen: 0.0.0.0:1\nthreadz: 2\n")
    write("yaml_config", "bad_value", "threads: -3\nworkers: many\n")
    write("yaml_config", "layers_as_list", "layers:\n  - random:d_model=8,heads=2\n")
    write("yaml_config", "not_a_map", "- listen\n- threads\n")
    write("yaml_config", "anchors", "a: &x {toy: 'random:d_model=8,heads=2'}\nlayers: *x\n")


if __name__ == "__main__":
    make_safetensors()
    make_npy()
    make_source()
    make_yaml()
