"""Runs forward_bench briefly and checks its JSON: one record per case, the documented fields,
sane values (time > 0, GFLOP/s consistent with ratio and ceiling)."""
import json
import subprocess
import sys
import tempfile

bench = sys.argv[1]
with tempfile.NamedTemporaryFile(suffix=".json") as out:
    subprocess.run([bench, "--shapes", "small-request", "--threads", "1", "--min-time-s", "0", "--json", out.name],
                   check=True, stdout=subprocess.DEVNULL)
    records = json.load(open(out.name))
fields = {"shape", "form", "threads", "ms", "gflops", "ceiling_gflops", "ratio_to_ceiling", "ceiling_source", "isa",
          "gemm"}
assert len(records) == 2, f"expected 2 records (factored, summed), got {len(records)}"
assert {r["form"] for r in records} == {"factored", "summed"}, records
for r in records:
    assert fields <= set(r), f"missing fields {fields - set(r)} in {r}"
    assert r["shape"] == "small-request" and r["threads"] == 1, r
    assert r["ms"] > 0 and r["gflops"] > 0 and r["ceiling_gflops"] > 0, r
    assert abs(r["gflops"] / r["ceiling_gflops"] - r["ratio_to_ceiling"]) < 1e-3, r
    # The ceiling names its library and shape; the ISA is what the CPU kernels may use.
    assert r["ceiling_source"].split()[0] in {"eigen", "onednn", "blis"}, r
    assert r["isa"] in {"avx512", "avx2", "generic"} and r["gemm"] in {"eigen", "onednn"}, r
print("forward_bench JSON ok:", records)
