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
          "gemm", "weights"}
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
    # The default packs the weights wherever the CPU kernels run (AVX2 or AVX-512).
    assert r["weights"] == ("plain" if r["isa"] == "generic" else "packed"), r
print("forward_bench JSON ok:", records)

# Before timing, both forms against float64: reported, and a bound nothing meets stops the run
# with exit status 1 before anything is timed.
checked = subprocess.run([bench, "--shapes", "small-request", "--threads", "1", "--min-time-s", "0", "--no-ceiling"],
                         capture_output=True, text=True, check=True)
for form in ("factored", "summed"):
    assert f"{form} in fp32: relative L2 to float64" in checked.stdout and ": ok" in checked.stdout, checked.stdout
failed = subprocess.run([bench, "--shapes", "small-request", "--threads", "1", "--min-time-s", "0", "--no-ceiling",
                         "--accuracy-bound", "1e-12"], capture_output=True, text=True)
assert failed.returncode == 1 and "FAILED" in failed.stdout and "nothing timed" in failed.stderr, (failed.returncode,
                                                                                                  failed.stdout,
                                                                                                  failed.stderr)
assert "GFLOP/s" not in failed.stdout, failed.stdout
print("forward_bench's check against float64 ok")

# One form alone (a profile's run), with a pause before each timed call and one sequence a value
# group; a bad value is refused with the flag's name.
with tempfile.NamedTemporaryFile(suffix=".json") as out:
    subprocess.run([bench, "--shapes", "small-request", "--threads", "1", "--min-time-s", "0", "--forms", "summed",
                    "--idle-us", "200", "--value-group-mib", "0", "--weight-layout", "plain", "--json", out.name],
                   check=True,
                   stdout=subprocess.DEVNULL)
    alone = json.load(open(out.name))
assert [r["form"] for r in alone] == ["summed"] and alone[0]["ms"] > 0 and alone[0]["weights"] == "plain", alone
for flag, value in (("--forms", "lowrank"), ("--idle-us", "-1"), ("--value-group-mib", "x"), ("--weight-layout", "x")):
    bad = subprocess.run([bench, flag, value], capture_output=True, text=True)
    assert bad.returncode == 2 and flag in bad.stderr, (flag, bad.returncode, bad.stderr)
print("forward_bench --forms, --idle-us, --value-group-mib, --weight-layout ok")

# The long sweep, at two short lengths: every point's time from this process, its RSS growth from
# a child process of its own (--rss-point); a child that failed would report -1.
with tempfile.NamedTemporaryFile(suffix=".json") as out:
    subprocess.run([bench, "--sweep", "long", "--lengths", "256,512", "--threads", "1", "--min-time-s", "0",
                    "--json", out.name], check=True, stdout=subprocess.DEVNULL)
    long_records = json.load(open(out.name))
assert len(long_records) == 2 * 2 * 2, f"expected 2 layers x 2 lengths x 2 forms, got {len(long_records)}"
for r in long_records:
    assert r["sweep"] == "long" and r["ms"] > 0 and r["gflops"] > 0, r
    assert r["rss_growth_mb"] > 0, f"no RSS growth measured (the child process failed?): {r}"
    if r["form"] == "factored":  # tiled: never the n x L x heads scores
        assert r["rss_growth_mb"] < r["all_scores_mb"] + 8, r
print("forward_bench --sweep long JSON ok:", long_records)
