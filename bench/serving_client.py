#!/usr/bin/python3
"""A second, independent client of the serving-overhead bench: Python grpcio with stubs made from
attnserve's own proto by protoc's Python plugin (Debian's python3-grpcio, python3-protobuf,
grpc_python_plugin). It sends the same 1×16×768 random Forward as attnserve-cli bench, one at a
time, and prints the p50 latency per target, so the overhead over the floor can be confirmed by
code that shares nothing with the C++ client.

    /usr/bin/python3 bench/serving_client.py --target NAME=HOST:PORT [--target ...] \
        [--requests 2000] [--warmup 200] [--burst 24] [--warm 4] [--shape 1,16,768] [--json FILE]

The targets are timed in bursts of --burst calls each, in an order that rotates from cycle to
cycle, the first --warm calls of each burst left out (they meet the other side's threads still
spinning down from the burst before), until each target has --requests timed calls: the machine
is noisy, and a burst to each target within milliseconds meets it in the same state. Prints one
line per target: `NAME p50_us=… p90_us=… requests=… compute_us=…` (compute_us: the median of the
server's own compute time in the answers; 0 from the no-op server). With targets named `served`
and `floor`, also a line `gap served−floor_us=… path_us=…`: the medians over the cycles of the
served burst's p50 minus the floor burst's, and of that minus the served burst's median
compute_us (the serving path without the forward, which needs no in-process figure). The stubs
are generated once into a temporary directory.
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_stubs(workdir):
    """Generates attnserve/v1/attention_pb2{,_grpc}.py from proto/ and imports them."""
    plugin = shutil.which("grpc_python_plugin")
    if plugin is None:
        sys.exit("serving_client.py: grpc_python_plugin is missing (Debian's protobuf-compiler-grpc)")
    subprocess.run(["protoc", f"-I{ROOT}/proto", f"--python_out={workdir}", f"--grpc_python_out={workdir}",
                    f"--plugin=protoc-gen-grpc_python={plugin}", f"{ROOT}/proto/attnserve/v1/attention.proto"],
                   check=True)
    sys.path.insert(0, workdir)
    return (importlib.import_module("attnserve.v1.attention_pb2"),
            importlib.import_module("attnserve.v1.attention_pb2_grpc"))


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="NAME=HOST:PORT (repeatable)")
    ap.add_argument("--requests", type=int, default=2000, help="timed requests per target")
    ap.add_argument("--warmup", type=int, default=200, help="untimed requests per target first")
    ap.add_argument("--burst", type=int, default=24, help="calls to one target in a row")
    ap.add_argument("--warm", type=int, default=4, help="untimed calls at the start of each burst")
    ap.add_argument("--shape", default="1,16,768", help="batch,n,d_model of the random input")
    ap.add_argument("--layer", default="demo")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    import grpc  # Debian's python3-grpcio
    import numpy as np

    targets = []
    for t in args.target:
        name, sep, address = t.partition("=")
        if not sep or not name or not address:
            sys.exit(f"serving_client.py: --target: expected NAME=HOST:PORT, got '{t}'")
        targets.append((name, address))
    shape = [int(v) for v in args.shape.split(",")]
    if len(shape) != 3 or min(shape) < 1:
        sys.exit(f"serving_client.py: --shape: expected three positive integers, got '{args.shape}'")
    if args.burst < 1 or not 0 <= args.warm < args.burst or args.requests < 1:
        sys.exit(f"serving_client.py: expected --requests ≥ 1 and 0 ≤ --warm < --burst, got --requests "
                 f"{args.requests} --warm {args.warm} --burst {args.burst}")

    with tempfile.TemporaryDirectory() as workdir:
        pb, pb_grpc = load_stubs(workdir)
        x = np.random.default_rng(1).standard_normal(shape).astype("<f4")
        request = pb.ForwardRequest(layer=args.layer, form=pb.FORM_FACTORED,
                                    input=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=shape, data=x.tobytes()))
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        stubs = {name: pb_grpc.AttentionServiceStub(grpc.insecure_channel(address, options=options))
                 for name, address in targets}
        expected_bytes = x.nbytes
        for name, stub in stubs.items():
            for _ in range(args.warmup):
                stub.Forward(request, timeout=10)
        latencies = {name: [] for name in stubs}
        computes = {name: [] for name in stubs}
        cycles = []  # per cycle: {target: (burst p50 µs, burst median compute_us)}
        names = list(stubs)
        while any(len(v) < args.requests for v in latencies.values()):
            cycle = {}
            shift = len(cycles) % len(names)
            for name in names[shift:] + names[:shift]:
                burst, burst_compute = [], []
                for call in range(args.burst):
                    start = time.perf_counter()
                    response = stubs[name].Forward(request, timeout=10)
                    elapsed = (time.perf_counter() - start) * 1e6
                    if len(response.output.data) != expected_bytes:
                        sys.exit(f"serving_client.py: {name}: {len(response.output.data)} output bytes, "
                                 f"expected {expected_bytes}")
                    if call >= args.warm:
                        burst.append(elapsed)
                        burst_compute.append(response.compute_us)
                latencies[name] += burst
                computes[name] += burst_compute
                cycle[name] = (statistics.median(burst), statistics.median(burst_compute))
            cycles.append(cycle)
        results = []
        for name, values in latencies.items():
            values.sort()
            results.append({"target": name, "p50_us": percentile(values, 0.5), "p90_us": percentile(values, 0.9),
                            "requests": len(values), "compute_us": statistics.median(computes[name])})
            print(f"{name} p50_us={results[-1]['p50_us']:.0f} p90_us={results[-1]['p90_us']:.0f} "
                  f"requests={len(values)} compute_us={results[-1]['compute_us']:.0f}")
        if "served" in stubs and "floor" in stubs:
            gaps = [c["served"][0] - c["floor"][0] for c in cycles]
            paths = [c["served"][0] - c["served"][1] - c["floor"][0] for c in cycles]
            results.append({"target": "gap", "gap_us": statistics.median(gaps), "path_us": statistics.median(paths),
                            "cycles": len(cycles)})
            print(f"gap served−floor_us={results[-1]['gap_us']:.0f} path_us={results[-1]['path_us']:.0f} "
                  f"cycles={len(cycles)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
