"""Python client of attnserve's native API, attnserve.v1 (proto/attnserve/v1/attention.proto).

    import numpy as np, attnserve
    with attnserve.Client("localhost:50051") as client:
        x = np.random.default_rng(0).standard_normal((1, 16, 768), dtype=np.float32)
        y = client.forward("demo", x).output              # [1, 16, 768] float32
        print(client.compare("demo", x).divergence)       # {'summed': Divergence(max_abs=..., rel_l2=...)}

client/python/README.md has every call. Errors from the server are raised as AttnserveError,
which names the gRPC status code and carries the server's message.
"""
from attnserve.client import (AttnserveError, Client, Divergence, FormInfo, ForwardResult, HeadSpectrum, LayerInfo,
                              LiveCalibration, Routing, Spectrum)

try:
    from attnserve._version import __version__  # written when the package is built (setup.py)
except ImportError:  # pragma: no cover - only when run from an unbuilt tree
    __version__ = "unknown"

__all__ = ["AttnserveError", "Client", "Divergence", "FormInfo", "ForwardResult", "HeadSpectrum", "LayerInfo",
           "LiveCalibration", "Routing", "Spectrum", "__version__"]
