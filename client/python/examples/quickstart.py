#!/usr/bin/env python3
"""attnserve's Python client in a few lines: health, layers, a forward pass, both forms compared,
the spectra. Against `scripts/serve` (the `demo` layer on localhost:50051):

    python3 client/python/examples/quickstart.py [TARGET] [LAYER]
"""
import sys

import numpy as np

import attnserve

target = sys.argv[1] if len(sys.argv) > 1 else "localhost:50051"
layer = sys.argv[2] if len(sys.argv) > 2 else "demo"

with attnserve.Client(target) as client:
    print("health:", client.health())                                  # SERVING
    info = client.layer(layer)
    print(f"{info.name}: d_model {info.d_model}, {info.heads} heads, forms {sorted(info.forms)}")

    x = np.random.default_rng(0).standard_normal((2, 16, info.d_model)).astype(np.float32)
    result = client.forward(layer, x, form="summed")
    print("forward:", result.output.shape, result.output.dtype, "by the", result.form, "form in",
          result.compute_us, "us")

    compared = client.compare(layer, x)                                # served by the route (factored)
    for form, d in compared.divergence.items():
        print(f"compare: {form} vs {compared.form}: max_abs {d.max_abs:.3g}, rel_l2 {d.rel_l2:.3g}")

    try:
        client.forward(layer, x[:, :, :-1])                            # the wrong d_model
    except attnserve.AttnserveError as e:
        print("error:", e.code_name, "-", e.details)

    spectrum = client.spectrum(layer)
    if spectrum.ov:
        print("OV stable rank per head:", [round(h.stable_rank, 1) for h in spectrum.ov])
