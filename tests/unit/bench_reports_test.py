#!/usr/bin/env python3
"""bench/peers/report.py and bench/long_report.py on small synthetic rounds: the numbers in their
Markdown tables (run by ctest as bench_reports_test, without PyTorch or a build).

The benchmark journal pastes these tables, and their arithmetic is easy to get subtly wrong in a
way that still prints plausible numbers: report.py must take each ratio within a round and print
the median of those ratios (so that the machine's drift between rounds cancels), which differs
from the ratio of the median times; long_report.py must keep the fastest time of each point over
its runs (noise only ever adds). The inputs below are chosen so that each plausible slip (ratio of
medians, the overall best peer instead of each round's, the last run instead of the fastest, ...)
changes a printed number.
"""
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS_REPORT = ROOT / "bench" / "peers" / "report.py"
LONG_REPORT = ROOT / "bench" / "long_report.py"
THREADS = 4


def write_json(directory, name, records):
    path = pathlib.Path(directory, name)
    path.write_text(json.dumps(records), encoding="utf-8")
    return str(path)


def run_script(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True)


def ours_round(times):
    """forward_bench --json records of one round: times is {(shape, form): ms}."""
    return [{"shape": s, "form": f, "threads": THREADS, "ms": ms} for (s, f), ms in times.items()]


def peers_round(times):
    """cpu_peers.py --json records of one round: times is {(shape, peer): ms}."""
    return [{"shape": s, "peer": p, "device": "cpu", "threads": THREADS, "ms": ms} for (s, p), ms in times.items()]


def table(text, header_start):
    """The rows (lists of cells) of the Markdown table whose header begins with header_start; the
    header itself is the first row, the |---| line is left out."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header_start)), None)
    if start is None:
        raise AssertionError(f"no table headed {header_start!r} in:\n{text}")
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def row(rows, *first_cells):
    """The one row of a table that begins with first_cells."""
    found = [r for r in rows if r[:len(first_cells)] == list(first_cells)]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} rows begin with {first_cells} in {rows}")
    return found[0]


# Three rounds. For bert-base the best peer changes from round to round (ort-attention, torch-sdpa,
# ort-attention) and the median of the per-round ratios differs from the ratio of the medians:
# factored ours/best per round 10/5, 40/10, 30/25 = 2.0, 4.0, 1.2, median 2.00, while the ratio of
# the medians would be 30/20 = 1.50 (and ours over the overall best peer, torch-sdpa, round by
# round would give 0.50). For gpt2-medium torch-sdpa is best in every round, so its cell has no
# "best in K/3 rounds" note. ort-graph never ran: its cells are "–".
BERT_OURS = {"factored": [10, 40, 30], "summed": [12, 48, 36]}
BERT_PEERS = {"torch-mha": [100, 100, 100], "torch-sdpa": [20, 10, 60], "ort-attention": [5, 80, 25]}
GPT2_OURS = {"factored": [50, 60, 55], "summed": [70, 80, 75]}
GPT2_PEERS = {"torch-mha": [100, 100, 100], "torch-sdpa": [25, 30, 20]}


def three_rounds(directory):
    ours, peers = [], []
    for i in range(3):
        o = {("bert-base", f): t[i] for f, t in BERT_OURS.items()}
        o.update({("gpt2-medium", f): t[i] for f, t in GPT2_OURS.items()})
        p = {("bert-base", name): t[i] for name, t in BERT_PEERS.items()}
        p.update({("gpt2-medium", name): t[i] for name, t in GPT2_PEERS.items()})
        ours.append(write_json(directory, f"ours-{i + 1}.json", ours_round(o)))
        peers.append(write_json(directory, f"peers-{i + 1}.json", peers_round(p)))
    return ours, peers


class PeersReportTest(unittest.TestCase):
    def test_three_rounds_take_the_median_of_per_round_ratios(self):
        with tempfile.TemporaryDirectory() as d:
            ours, peers = three_rounds(d)
            result = run_script(PEERS_REPORT, "--ours", *ours, "--peers", *peers)
        self.assertEqual(result.returncode, 0, result.stderr)
        out = result.stdout
        self.assertIn(f"Forward time, ms (median over 3 rounds), {THREADS} threads:", out)

        ratios = table(out, "| shape | form |")
        self.assertEqual(ratios[0], ["shape", "form", "torch-mha", "torch-sdpa", "ort-graph", "ort-attention",
                                     "best peer", "ours/best", "ours/best min–max"])
        # torch-sdpa: per round 0.5, 4.0, 0.5 -> 0.50 (the ratio of medians would be 30/20 = 1.50).
        # The best peer by median time is torch-sdpa (20 ms against ort-attention's 25 ms), yet it
        # was the fastest in round 2 alone.
        self.assertEqual(row(ratios, "bert-base", "factored"),
                         ["bert-base", "factored", "0.30", "0.50", "–", "1.20",
                          "torch-sdpa (20.000 ms), best in 1/3 rounds", "**2.00**", "1.20–4.00"])
        # Summed: ours/best per round 12/5, 48/10, 36/25 = 2.4, 4.8, 1.44.
        self.assertEqual(row(ratios, "bert-base", "summed"),
                         ["bert-base", "summed", "0.36", "0.60", "–", "1.44",
                          "torch-sdpa (20.000 ms), best in 1/3 rounds", "**2.40**", "1.44–4.80"])
        # The same best peer in every round: no note. Factored per round 2.0, 2.0, 2.75.
        self.assertEqual(row(ratios, "gpt2-medium", "factored"),
                         ["gpt2-medium", "factored", "0.55", "2.00", "–", "–",
                          "torch-sdpa (25.000 ms)", "**2.00**", "2.00–2.75"])
        self.assertEqual(row(ratios, "gpt2-medium", "summed"),
                         ["gpt2-medium", "summed", "0.75", "2.80", "–", "–",
                          "torch-sdpa (25.000 ms)", "**2.80**", "2.67–3.75"])

        # The forward time table: each implementation's median over the rounds (a mean would
        # give 26.667 for bert-base factored).
        times = table(out, "| shape | attnserve factored |")
        self.assertEqual(row(times, "bert-base 8×128, d=768, h=12"),
                         ["bert-base 8×128, d=768, h=12", "30.000", "36.000", "100.000", "20.000", "–", "25.000"])
        self.assertEqual(row(times, "gpt2-medium 4×256, d=1024, h=16"),
                         ["gpt2-medium 4×256, d=1024, h=16", "55.000", "75.000", "100.000", "25.000", "–", "–"])

    def test_one_round_is_a_single_measurement(self):
        with tempfile.TemporaryDirectory() as d:
            ours = write_json(d, "ours.json", ours_round({("bert-base", "factored"): 10, ("bert-base", "summed"): 16}))
            peers = write_json(d, "peers.json", peers_round({
                ("bert-base", "torch-mha"): 40, ("bert-base", "torch-sdpa"): 20,
                ("bert-base", "ort-graph"): 25, ("bert-base", "ort-attention"): 8}))
            result = run_script(PEERS_REPORT, "--ours", ours, "--peers", peers)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"Forward time, ms (median), {THREADS} threads:", result.stdout)
        times = table(result.stdout, "| shape | attnserve factored |")
        self.assertEqual(row(times, "bert-base 8×128, d=768, h=12")[1:],
                         ["10.000", "16.000", "40.000", "20.000", "25.000", "8.000"])
        ratios = table(result.stdout, "| shape | form |")
        # No min–max column, and no "best in" note, with a single round.
        self.assertEqual(ratios[0], ["shape", "form", "torch-mha", "torch-sdpa", "ort-graph", "ort-attention",
                                     "best peer", "ours/best"])
        self.assertEqual(row(ratios, "bert-base", "factored"),
                         ["bert-base", "factored", "0.25", "0.50", "0.40", "1.25", "ort-attention (8.000 ms)", "**1.25**"])
        self.assertEqual(row(ratios, "bert-base", "summed"),
                         ["bert-base", "summed", "0.40", "0.80", "0.64", "2.00", "ort-attention (8.000 ms)", "**2.00**"])

    def test_serving_overhead_is_p50_less_the_in_process_forward(self):
        def bench_records(p50_ms, p90_ms, queue_us, compute_us):
            # Records at other forms and concurrencies come first: the report must pick the
            # factored, concurrency 1 one.
            other = {"p50_ms": 9.0, "p90_ms": 9.5, "queue_us": 900, "compute_us": 900}
            return [dict(other, form="summed", concurrency=1), dict(other, form="factored", concurrency=8),
                    {"form": "factored", "concurrency": 1, "p50_ms": p50_ms, "p90_ms": p90_ms,
                     "queue_us": queue_us, "compute_us": compute_us}]

        with tempfile.TemporaryDirectory() as d:
            # In-process small-request factored: median of 0.125, 0.25, 0.2 ms = 200 µs.
            ours, peers = [], []
            for i, ms in enumerate([0.125, 0.25, 0.2]):
                ours.append(write_json(d, f"ours-{i}.json", ours_round(
                    {("small-request", "factored"): ms, ("small-request", "summed"): 2 * ms})))
                peers.append(write_json(d, f"peers-{i}.json", peers_round({("small-request", "torch-sdpa"): 0.5})))
            serving = [write_json(d, "serving-defaults.json", bench_records(0.5, 0.75, 12, 180)),
                       write_json(d, "serving-noop.json", bench_records(0.08, 0.1, 0, 0))]
            result = run_script(PEERS_REPORT, "--ours", *ours, "--peers", *peers, "--serving", *serving)
        self.assertEqual(result.returncode, 0, result.stderr)
        rows = table(result.stdout, "| server batching |")
        self.assertEqual(len(rows), 3, rows)
        self.assertEqual(row(rows, "defaults"), ["defaults", "500", "750", "12", "180", "200", "**300**"])
        # The no-op server computes nothing: its whole p50 is overhead.
        self.assertEqual(row(rows, "no-op server (the bench's own cost)"),
                         ["no-op server (the bench's own cost)", "80", "100", "0", "0", "0", "**80**"])

    def test_unequal_rounds_are_refused(self):
        with tempfile.TemporaryDirectory() as d:
            one = ours_round({("bert-base", "factored"): 1, ("bert-base", "summed"): 1})
            ours = [write_json(d, f"ours-{i}.json", one) for i in range(3)]
            peers = [write_json(d, f"peers-{i}.json", peers_round({("bert-base", "torch-sdpa"): 1})) for i in range(2)]
            result = run_script(PEERS_REPORT, "--ours", *ours, "--peers", *peers)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("3 --ours files but 2 --peers files", result.stderr)


def long_ours(layer, n, form, ms, gflops, rss, threads=THREADS, order="auto"):
    return {"sweep": "long", "layer": layer, "n": n, "form": form, "order": order, "threads": threads, "ms": ms,
            "gflops": gflops, "rss_growth_mb": rss, "all_scores_mb": n * n * 12 * 4 / 2**20}


def long_peer(layer, n, ms, rss, threads=THREADS):
    return {"sweep": "long", "layer": layer, "peer": "torch-sdpa", "n": n, "threads": threads, "ms": ms,
            "gflops": 1.0, "rss_growth_mb": rss}


class LongReportTest(unittest.TestCase):
    def test_fastest_of_the_runs_is_kept(self):
        layer = "d768-h12"
        # The fastest time of a point is in the first run for some and the second for others, so
        # neither run alone, nor the slowest, gives the table. Faster records that must be left out:
        # a summed form in a forced association order, and points at fewer threads.
        ours_1 = [long_ours(layer, 1024, "factored", 10.0, 300, 40), long_ours(layer, 1024, "summed", 30.0, 100, 200),
                  long_ours(layer, 4096, "factored", 90.0, 320, 150), long_ours(layer, 4096, "summed", 500.0, 90, 900),
                  long_ours(layer, 1024, "summed", 1.0, 999, 1, order="mix-first"),
                  long_ours(layer, 1024, "factored", 1.0, 999, 1, threads=1)]
        ours_2 = [long_ours(layer, 1024, "factored", 12.0, 250, 41), long_ours(layer, 1024, "summed", 25.0, 110, 190),
                  long_ours(layer, 4096, "factored", 80.0, 350, 160), long_ours(layer, 4096, "summed", 550.0, 80, 950)]
        peer_1 = [long_peer(layer, 1024, 30.0, 60), long_peer(layer, 4096, 200.0, 700),
                  long_peer(layer, 1024, 1.0, 1, threads=1)]
        peer_2 = [long_peer(layer, 1024, 20.0, 70), long_peer(layer, 4096, 240.0, 650)]
        with tempfile.TemporaryDirectory() as d:
            svg_path = pathlib.Path(d, "long.svg")
            result = run_script(LONG_REPORT, "--ours", write_json(d, "a1.json", ours_1), write_json(d, "a2.json", ours_2),
                                "--peer", write_json(d, "s1.json", peer_1), write_json(d, "s2.json", peer_2),
                                "--svg", svg_path)
            self.assertEqual(result.returncode, 0, result.stderr)
            svg = ET.parse(svg_path).getroot()

        rows = table(result.stdout, "| layer | n |")
        self.assertEqual(len(rows), 3, rows)
        # n=1024: factored 10 (run 1), summed 25 (run 2), sdpa 20 (run 2): sdpa/factored 2.00 (the
        # last run's would be 20/12 = 1.67, the first's 30/10 = 3.00). The GFLOP/s and RSS come
        # with the fastest record.
        self.assertEqual(row(rows, layer, "1024"),
                         [layer, "1024", "10.0", "25.0", "20.0", "2.00", "300", "40 / 190 / 70", "48"])
        # n=4096: factored 80 (run 2), summed 500 (run 1), sdpa 200 (run 1): 2.50.
        self.assertEqual(row(rows, layer, "4096"),
                         [layer, "4096", "80.0", "500.0", "200.0", "2.50", "350", "160 / 900 / 700", "768"])

        ns = "{http://www.w3.org/2000/svg}"
        self.assertEqual(svg.tag, ns + "svg")
        # Two panels (time, memory), each a line per series: factored, summed and torch-sdpa.
        self.assertEqual(len(svg.findall(ns + "polyline")), 6)
        titles = [t.text for t in svg.findall(ns + "text")]
        self.assertIn(f"time per call, {THREADS} threads (ms)", titles)

    def test_one_length_and_values_on_a_power_of_ten_still_plot(self):
        # A quick sweep of one length (bench/cpu_check.sh LONG_LENGTHS=512) once divided by a
        # zero-width axis; so did a panel whose values are all one power of ten.
        layer = "d768-h12"
        ours = [long_ours(layer, 512, "factored", 10.0, 300, 100), long_ours(layer, 512, "summed", 100.0, 100, 100)]
        peer = [long_peer(layer, 512, 10.0, 100)]
        with tempfile.TemporaryDirectory() as d:
            svg_path = pathlib.Path(d, "long.svg")
            result = run_script(LONG_REPORT, "--ours", write_json(d, "a.json", ours), "--peer",
                                write_json(d, "s.json", peer), "--svg", svg_path)
            self.assertEqual(result.returncode, 0, result.stderr)
            svg = ET.parse(svg_path).getroot()
        self.assertEqual(row(table(result.stdout, "| layer | n |"), layer, "512")[:6],
                         [layer, "512", "10.0", "100.0", "10.0", "1.00"])
        ns = "{http://www.w3.org/2000/svg}"
        for line in svg.findall(ns + "polyline"):
            for point in line.get("points").split():
                self.assertTrue(all(math.isfinite(float(v)) for v in point.split(",")), point)


if __name__ == "__main__":
    unittest.main()
