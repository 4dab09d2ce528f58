"""Checks an SVG written by `attnserve-cli bench --plot`: well-formed XML, an <svg> root in the
SVG namespace, labelled axes, a legend naming every form, and one series per (panel, form,
metric) with one point per concurrency level.

    python3 check_bench_svg.py FILE.svg FORMS(comma-separated) LEVELS
Exits 0 and prints "svg ok" when all holds; otherwise prints what is wrong and exits 1.
"""
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def main():
    path, forms, levels = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    root = ET.parse(path).getroot()  # raises on malformed XML
    problems = []
    if root.tag != NS + "svg":
        problems.append(f"root is {root.tag}, not an SVG <svg>")
    texts = " ".join("".join(t.itertext()) for t in root.iter(NS + "text"))
    for label in ("concurrency", "latency (ms)", "throughput (requests/s)"):
        if label not in texts:
            problems.append(f"no axis label {label!r}")
    legend = root.find(f".//{NS}g[@id='legend']")
    legend_text = " ".join(legend.itertext()) if legend is not None else ""
    expected = [("latency", f, m) for f in forms for m in ("p50", "p90", "p99")]
    expected += [("throughput", f, "requests_per_s") for f in forms]
    series = {(g.get("data-panel"), g.get("data-form"), g.get("data-metric")): g
              for g in root.iter(NS + "g") if g.get("class") == "series"}
    for key in expected:
        g = series.get(key)
        if g is None:
            problems.append(f"missing series {key}")
            continue
        line = g.find(NS + "polyline")
        points = line.get("points", "").split() if line is not None else []
        if len(points) != levels or len(g.findall(NS + "circle")) != levels:
            problems.append(f"series {key}: {len(points)} points, expected {levels}")
        for p in points:
            x, y = (float(v) for v in p.split(","))
            if not (0 <= x <= float(root.get("width")) and 0 <= y <= float(root.get("height"))):
                problems.append(f"series {key}: point {p} outside the canvas")
    for f in forms:
        if f not in legend_text:
            problems.append(f"legend lacks {f!r}")
    if set(series) - set(expected):
        problems.append(f"unexpected series {sorted(set(series) - set(expected))}")
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print("svg ok")


if __name__ == "__main__":
    main()
