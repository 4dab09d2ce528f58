#!/usr/bin/python3
"""A fleet of three real attnserve processes following one routes file, scraped by a real
Prometheus (label "e2e" in CTest).

Starts three servers with the same --routes-file and Debian's `prometheus` scraping all three
(loopback, ephemeral ports, a temporary folder, scrape interval 1 s). The test is the
round-robin client: routed Forward calls with request keys go to the servers in turn, through
attnserve-cli. Then it changes the routes file (written whole and renamed into place) and asks
Prometheus's HTTP API what docs/service.md ("Routes for a fleet") promises:

  attnserve_routes_generation            the same on every instance, and equal to FNV-1a 64 of
                                          the routes' canonical text >> 11 (computed here)
  attnserve_route_weight                  the file's split on every instance
  sum by (form) (attnserve_requests_total) what the client saw served, form by form

and that the split moved (every key on the summed form stays there when its share grows), the
same request_key gets the same form from all three processes before and after the change, a
route change over SetRouting is refused naming the file, and a bad file is refused by every
process (config_reload_total{result="error"}) with the generation kept.

A second case gives `attnserve-cli ab` a load built to have a known answer: a round-robin client
(`bench` on one channel, gRPC's round_robin over the three addresses) sends the layer "ab"
(d_model 256, 8 heads, requests [1, 128, 256]) equal numbers of factored and summed calls,
interleaved. The summed form does h/2 = 4x the projection work there (n = m; about 3x the
compute per call), so `attnserve-cli ab --prometheus --json` must say "different" (exit 3) with
summed the slower form, the latency ratio's interval above 1 and near the ratio the client and
the servers' own compute times show, the requests per form exactly what the client sent (summed
over the three replicas, every replica serving both forms), and no errors. No equality case: at
alpha 5 % a test of equal forms says "different" once in twenty runs by design.

Environment (set by CTest): ATTNSERVE_BINARY, ATTNSERVE_CLI_BINARY. Every process it starts dies
with it (PR_SET_PDEATHSIG) and is stopped in tearDownClass; the run takes about 25 s on 2 cores
(the verdict case 2-3 s of it; 40 s with three busy loops beside it).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from harness import die_with_parent, free_port, log_tail, read, stop, wait_for  # noqa: E402

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BINARY = os.environ.get("ATTNSERVE_BINARY", os.path.join(SRC, "build", "server", "attnserve"))
CLI = os.environ.get("ATTNSERVE_CLI_BINARY", os.path.join(SRC, "build", "client", "attnserve-cli"))
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ADMIN_TOKEN = "fleet-e2e-admin-token-0123456789"

REPLICAS = 3
KEYS = 60
LAYER = "demo"
LAYER_SOURCE = "random:d_model=64,heads=4,seed=3"
# The A/B case's layer: summed does h/2 = 4x the projection work of factored at n = m (about
# 3x the compute per call, 2.2x the client's p50 on 2 cores).
AB_LAYER = "ab"
AB_LAYER_SOURCE = "random:d_model=256,heads=8,seed=5"
AB_SHAPE = "1,128"
AB_REQUESTS = 210  # per form; ab decides nothing below --min-requests (100) a form
BEFORE = "factored:80,summed:20"
AFTER = "factored:20,summed:80"
START_TIMEOUT_S = 60
SCRAPE_TIMEOUT_S = 30


def dashboard_query(title):
    """The query of the Grafana dashboard's panel `title` (deploy/grafana/attnserve.json)."""
    with open(os.path.join(SRC, "deploy", "grafana", "attnserve.json")) as f:
        [panel] = [p for p in json.load(f)["panels"] if p["title"] == title]
    [target] = panel["targets"]
    return target["expr"]


DASHBOARD_GENERATIONS = dashboard_query("Routes generations across replicas")


def generation(canonical):
    """FNV-1a 64 from its definition, top 53 bits: attnserve_routes_generation for that text."""
    h = 0xCBF29CE484222325
    for byte in canonical.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return float(h >> 11)


def canonical(spec):
    return f"*=factored:100\n{LAYER}={spec}\n"


def write_routes(path, text):
    """Whole, then renamed into place, as the kubelet or an editor replaces it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


class FleetE2E(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        for tool in (BINARY, CLI, PROMETHEUS):
            if not os.access(tool, os.X_OK):
                raise AssertionError(f"{tool} is missing: build the project and run scripts/setup (Debian 'prometheus')")
        cls.dir = tempfile.mkdtemp(prefix="attnserve_fleet_")
        cls.servers, cls.logs, cls.prometheus = [], [], None
        cls.routes = os.path.join(cls.dir, "routes", "routes.yaml")
        os.makedirs(os.path.dirname(cls.routes))
        write_routes(cls.routes, f"routes:\n  {LAYER}: {BEFORE}\n")
        try:
            cls.start_servers()
            cls.start_prometheus()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        stop(cls.prometheus)
        for server in cls.servers:
            stop(server)
        for log in cls.logs:
            log.close()
        if os.environ.get("ATTNSERVE_E2E_KEEP_LOGS"):
            for i in range(len(cls.servers)):
                print(f"--- server{i}.log\n" + cls.log(f"server{i}.log"), file=sys.stderr)
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def log(cls, name):
        return log_tail(os.path.join(cls.dir, name))

    @classmethod
    def start_servers(cls):
        cls.targets, cls.metrics_ports = [], []
        for i in range(REPLICAS):
            port_file = os.path.join(cls.dir, f"port{i}")
            metrics_port_file = os.path.join(cls.dir, f"metrics_port{i}")
            cmd = [BINARY, "--listen", "127.0.0.1:0", "--port-file", port_file,
                   "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", metrics_port_file,
                   "--layer", f"{LAYER}={LAYER_SOURCE}", "--layer", f"{AB_LAYER}={AB_LAYER_SOURCE}",
                   "--threads", "1", "--log-level", "warn",
                   "--admin-token", ADMIN_TOKEN, "--routes-file", cls.routes]
            log = open(os.path.join(cls.dir, f"server{i}.log"), "w")
            cls.logs.append(log)
            cls.servers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
        for i, server in enumerate(cls.servers):
            port_file = os.path.join(cls.dir, f"port{i}")
            metrics_port_file = os.path.join(cls.dir, f"metrics_port{i}")

            def ports():
                if server.poll() is not None:
                    raise AssertionError(f"attnserve {i} exited with {server.returncode}: " + cls.log(f"server{i}.log"))
                if os.path.exists(port_file) and os.path.exists(metrics_port_file):
                    return int(read(port_file)), int(read(metrics_port_file))
                return None
            port, metrics_port = wait_for(ports, START_TIMEOUT_S, f"attnserve {i}'s port files")
            cls.targets.append(f"127.0.0.1:{port}")
            cls.metrics_ports.append(metrics_port)

    @classmethod
    def start_prometheus(cls):
        cls.prom_port = free_port()
        config = os.path.join(cls.dir, "prometheus.yml")
        targets = ", ".join(f"'127.0.0.1:{p}'" for p in cls.metrics_ports)
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: attnserve\n    static_configs:\n"
                    f"      - targets: [{targets}]\n")
        cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(cls.dir, 'data')}",
               f"--web.listen-address=127.0.0.1:{cls.prom_port}", "--log.level=warn",
               "--storage.tsdb.retention.time=1h"]
        log = open(os.path.join(cls.dir, "prometheus.log"), "w")
        cls.logs.append(log)
        cls.prometheus = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cls.dir,
                                          preexec_fn=die_with_parent)
        cls.prom = f"http://127.0.0.1:{cls.prom_port}"
        # Its query API answers 503 until the TSDB is open (seconds on a loaded machine): wait for
        # /-/ready first, whose 503 (an HTTPError, an OSError) wait_for counts as "not yet".
        wait_for(lambda: urllib.request.urlopen(cls.prom + "/-/ready", timeout=5).status == 200,
                 START_TIMEOUT_S, "Prometheus ready")
        wait_for(lambda: cls.query_by_instance("sum by (instance) (up)") == {t: 1.0 for t in cls.metrics_targets()},
                 START_TIMEOUT_S, "Prometheus scraping all three servers")

    @classmethod
    def metrics_targets(cls):
        return [f"127.0.0.1:{p}" for p in cls.metrics_ports]

    # --- Clients ---------------------------------------------------------------------------------

    @classmethod
    def cli(cls, target, *args):
        return subprocess.run([CLI, "--target", target, "--timeout-ms", "30000", "--admin-token", ADMIN_TOKEN, *args],
                              capture_output=True, text=True, timeout=60)

    @classmethod
    def forward(cls, target, key):
        out = cls.cli(target, "forward", "--layer", LAYER, "--random", "1,8", "--request-key", key)
        served = re.search(r"^form: (\w+)$", out.stdout, re.M)
        if out.returncode != 0 or not served:
            raise AssertionError(f"forward to {target} exited {out.returncode}: {out.stdout}{out.stderr}")
        return served.group(1)

    def serve_round(self):
        """Every key once, the servers in turn (round-robin), then again on the two others:
        {key: form} as the round-robin client saw it; fails when any process disagrees."""
        forms, per_form = {}, {}
        for k in range(KEYS):
            key = f"user-{k}"
            first = k % REPLICAS
            forms[key] = self.forward(self.targets[first], key)
            for other in range(1, REPLICAS):
                target = self.targets[(first + other) % REPLICAS]
                self.assertEqual(self.forward(target, key), forms[key],
                                 f"{key}: {self.targets[first]} and {target} chose different forms")
        for form in forms.values():
            per_form[form] = per_form.get(form, 0) + REPLICAS
        for form, n in per_form.items():
            FleetE2E.sent[form] = FleetE2E.sent.get(form, 0) + n
        return forms

    sent = {}

    # --- Prometheus's HTTP API -------------------------------------------------------------------

    @classmethod
    def query_by_instance(cls, promql):
        """{instance: value} of an instant vector with one series per instance."""
        url = cls.prom + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                answer = json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus refused {promql!r}: {e.read().decode()}") from None
        if answer.get("status") != "success":
            raise AssertionError(f"Prometheus: {promql!r}: {answer}")
        return {r["metric"].get("instance", r["metric"].get("form", "")): float(r["value"][1])
                for r in answer["data"]["result"]}

    def wait_every_instance(self, promql, value, what):
        want = {t: value for t in self.metrics_targets()}
        return wait_for(lambda: (lambda got: got if got == want else None)(self.query_by_instance(promql)),
                        SCRAPE_TIMEOUT_S, f"{what}: {promql} == {want}")

    # --- The fleet -------------------------------------------------------------------------------

    def test_one_split_for_the_fleet(self):
        t0 = time.monotonic()
        before = generation(canonical(BEFORE))
        self.wait_every_instance("attnserve_routes_generation", before, "the file's routes at start")
        self.wait_every_instance(f'attnserve_route_weight{{layer="{LAYER}",form="summed"}}', 0.2, "the start split")
        forms_before = self.serve_round()

        # One source of truth: a route change over SetRouting is refused, naming the file.
        refused = self.cli(self.targets[0], "route", LAYER, "summed:100")
        self.assertNotEqual(refused.returncode, 0, refused.stdout)
        self.assertIn("FAILED_PRECONDITION", refused.stdout + refused.stderr)
        self.assertIn(self.routes, refused.stdout + refused.stderr)

        # The operator changes the file: every process applies it, and says so.
        write_routes(self.routes, f"routes:\n  {LAYER}: {AFTER}\n")
        after = generation(canonical(AFTER))
        self.wait_every_instance("attnserve_routes_generation", after, "the new routes on every process")
        self.wait_every_instance(f'attnserve_route_weight{{layer="{LAYER}",form="summed"}}', 0.8, "the new split")
        # One generation across the fleet, as the dashboard's panel and the docs count them.
        self.assertEqual(self.query_by_instance(DASHBOARD_GENERATIONS), {"": 1.0}, DASHBOARD_GENERATIONS)
        self.assertEqual(self.query_by_instance('count(count_values("generation", attnserve_routes_generation))'),
                         {"": 1.0})
        forms_after = self.serve_round()

        # The split moved: 60 keys at 20 % and at 80 % summed ([1, 24] and [36, 59] hold them with
        # probability 1 - 1e-5 each), and widening the summed share moved keys onto it only.
        summed_before = sum(f == "summed" for f in forms_before.values())
        summed_after = sum(f == "summed" for f in forms_after.values())
        self.assertTrue(1 <= summed_before <= 24, summed_before)
        self.assertTrue(36 <= summed_after <= 59, summed_after)
        for key, form in forms_before.items():
            if form == "summed":
                self.assertEqual(forms_after[key], "summed", f"{key} left the growing form")

        # Prometheus counts what the client saw served, form by form, across the fleet.
        want = {form: float(n) for form, n in self.sent.items()}
        got = wait_for(lambda: (lambda v: v if v == want else None)(
            self.query_by_instance(f'sum by (form) (attnserve_requests_total{{layer="{LAYER}",code="OK"}})')),
            SCRAPE_TIMEOUT_S, f"sum by (form) (attnserve_requests_total) == {want}")
        per_instance = self.query_by_instance(f'sum by (instance) (attnserve_requests_total{{layer="{LAYER}"}})')
        self.assertEqual(per_instance, {t: 2.0 * KEYS for t in self.metrics_targets()})

        # A bad file: every process refuses it and keeps the generation.
        write_routes(self.routes, f"routes:\n  {LAYER}: factored:20,lowrank:80\n")
        self.wait_every_instance('attnserve_config_reload_total{result="error"}', 1.0, "the bad file refused")
        self.wait_every_instance("attnserve_routes_generation", after, "the generation kept")
        self.wait_every_instance('attnserve_config_reload_total{result="ok"}', 2.0, "no other reload")
        self.assertEqual({k: v for k, v in self.serve_round().items()}, forms_after)
        print(f"\nfleet of {REPLICAS}: keys on summed {summed_before}/{KEYS} at {BEFORE} -> {summed_after}/{KEYS} "
              f"at {AFTER}; requests by form {got}; generations {before:.0f} -> {after:.0f}; "
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr)

    # --- The verdict -----------------------------------------------------------------------------

    def test_ab_finds_the_slower_form(self):
        t0 = time.monotonic()
        bench_json = os.path.join(self.dir, "ab_bench.json")
        target = "ipv4:" + ",".join(self.targets)
        out = subprocess.run([CLI, "--target", target, "--load-balancing", "round_robin", "--timeout-ms", "30000",
                              "bench", "--layer", AB_LAYER, "--shape", AB_SHAPE, "--forms", "factored,summed",
                              "--interleave", "request", "--requests", str(AB_REQUESTS), "--warmup", "0s",
                              "--json", bench_json], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise AssertionError(f"attnserve-cli bench exited {out.returncode}: {out.stdout}{out.stderr}")
        with open(bench_json) as f:
            records = {r["form"]: r for r in json.load(f)}
        sent = {form: float(r["requests"] + r["errors"]) for form, r in records.items()}
        self.assertEqual(sent, {"factored": AB_REQUESTS, "summed": AB_REQUESTS}, out.stdout)
        for r in records.values():
            self.assertEqual(r["errors"], 0, out.stdout)
        client_ratio = records["summed"]["p50_ms"] / records["factored"]["p50_ms"]

        def server_ms(form):
            return (records[form]["queue_us"] + records[form]["compute_us"]) / 1000.0
        server_ratio = server_ms("summed") / server_ms("factored")
        # The load is what it was built to be: summed clearly slower, seen by the client and in the
        # servers' own times (a machine so loaded that this fails cannot test the verdict).
        self.assertGreater(client_ratio, 1.3, f"the client's p50 ratio summed/factored: {out.stdout}")
        self.assertGreater(server_ratio, 1.5, f"the servers' queue + compute ratio summed/factored: {out.stdout}")

        # Every replica served both forms (round robin), and Prometheus has scraped all of it.
        def settled():
            got = self.query_by_instance(f'sum by (form) (attnserve_requests_total{{layer="{AB_LAYER}"}})')
            return got if got == sent else None
        wait_for(settled, SCRAPE_TIMEOUT_S, f"sum by (form) (attnserve_requests_total{{layer={AB_LAYER!r}}}) == {sent}")
        for form in sent:
            per_instance = self.query_by_instance(
                f'sum by (instance) (attnserve_requests_total{{layer="{AB_LAYER}",form="{form}"}})')
            self.assertEqual(set(per_instance), set(self.metrics_targets()), f"{form}: {per_instance}")
            self.assertTrue(all(v >= AB_REQUESTS / 6 for v in per_instance.values()),
                            f"{form} per replica under round robin: {per_instance}")

        verdict = subprocess.run([CLI, "ab", "--prometheus", self.prom, "--layer", AB_LAYER, "--json"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(verdict.returncode, 3,
                         f"exit 3 (a significant difference) wanted: {verdict.stdout}{verdict.stderr}")
        j = json.loads(verdict.stdout)
        self.assertEqual(j["exit_code"], 3)
        [layer] = j["layers"]
        self.assertEqual(layer["layer"], AB_LAYER)
        forms = {f["form"]: f for f in layer["forms"]}
        self.assertEqual({f: forms[f]["requests"] for f in forms}, sent)
        for f in forms.values():
            self.assertEqual((f["errors"], f["error_ratio"]), (0.0, 0.0), f)
            self.assertFalse(f["latency_includes_failures"], f)
            self.assertEqual(f["latency_observations"], AB_REQUESTS, f)
        [c] = layer["comparisons"]
        self.assertEqual((c["baseline"], c["form"], c["verdict"]), ("factored", "summed", "different"), c)
        self.assertTrue(c["latency_significant"], c)
        self.assertFalse(c["error_significant"], c)
        self.assertRegex(c["reason"], r"^summed is [0-9.]+% slower than factored", c)
        low, high = c["latency_ratio_ci"]
        self.assertTrue(1.0 < low <= c["latency_ratio"] <= high, c)
        # Near what the client and the servers measured, loosely: ab's ratio of geometric means of
        # the servers' latency lies between the client's p50 ratio (a round trip's fixed cost
        # shrinks a ratio) and the servers' ratio of mean queue + compute times (a tail weighs on a
        # mean more than on a geometric mean), each widened by x1.5.
        self.assertTrue(client_ratio / 1.5 <= c["latency_ratio"] <= server_ratio * 1.5,
                        f"ab's ratio {c['latency_ratio']:.3f} against the client's p50 ratio {client_ratio:.3f} "
                        f"and the servers' queue + compute ratio {server_ratio:.3f}")
        print(f"\nattnserve-cli ab over {REPLICAS} replicas, {AB_REQUESTS} requests a form: ratio summed/factored "
              f"{c['latency_ratio']:.3f} [{low:.3f}, {high:.3f}], p={c['latency_p_value']:.3g} ({c['reason']}); "
              f"client p50 ratio {client_ratio:.3f}, servers' queue+compute ratio {server_ratio:.3f}; "
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
