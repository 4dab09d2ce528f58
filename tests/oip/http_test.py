#!/usr/bin/python3
"""The Open Inference Protocol over HTTP/REST (--http-listen) against the real attnserve.

curl and Triton's own HTTP client (tritonclient.http) send random inputs, as JSON (flat and
nested) and as binary data, to a layer loaded from PyTorch's nn.MultiheadAttention weights
(tests/data/torch-mha); each answer must be bitwise equal to the gRPC Open Inference
Protocol's answer for the same input and form (tritonclient.grpc, the same server: one call
path computes both) and within tolerance of a float64 reference that shares nothing with
attnserve (tests/tools/attention_reference.py). Also: health and readiness, metadata equal to
gRPC's, refusals with HTTP statuses and {"error"} naming the field, the body limit (413), the
metrics counting HTTP calls like gRPC ones, TLS, and the drain (503 for new calls while the
accepted ones are answered). Needs the venv of scripts/fetch-oip-clients (tritonclient[grpc,http]).
Environment: ATTNSERVE_BINARY, ATTNSERVE_SOURCE_DIR.
"""
import os
import sys

VENV_PYTHON = os.path.join(os.environ.get("ATTNSERVE_CACHE", os.path.expanduser("~/.cache/attnserve")),
                           "oip-clients", "bin", "python")
try:
    import numpy as np
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
except (ImportError, RuntimeError) as e:
    venv_dir = os.path.dirname(os.path.dirname(VENV_PYTHON))
    if os.path.realpath(sys.prefix) != os.path.realpath(venv_dir) and os.path.exists(VENV_PYTHON):
        os.execv(VENV_PYTHON, [VENV_PYTHON] + sys.argv)
    sys.exit(f"FAIL: {e}: the HTTP/REST test needs tritonclient[grpc,http] and numpy in {VENV_PYTHON}; "
             "run scripts/setup (or scripts/fetch-oip-clients)")

import json
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from attention_reference import read_safetensors, rel_l2, torch_mha_forward  # noqa: E402
from harness import die_with_parent, log_tail, read  # noqa: E402

BINARY = os.environ["ATTNSERVE_BINARY"]
SOURCE_DIR = os.environ["ATTNSERVE_SOURCE_DIR"]
CHECKPOINT = os.path.join(SOURCE_DIR, "tests", "data", "torch-mha", "small.torch-mha.safetensors")
SOURCE = f"safetensors:{CHECKPOINT},heads=4"
D, HEADS = 64, 4
SEED = int(os.environ.get("ATTNSERVE_TEST_SEED", time.time_ns() % (1 << 31)))
print(f"http_test: seed {SEED} (ATTNSERVE_TEST_SEED={SEED} repeats this run)", flush=True)
WEIGHTS = {k: v.astype(np.float64) for k, v in read_safetensors(CHECKPOINT).items()}
CURL = shutil.which("curl")


def reference(x, context=None, causal=False, key_lengths=None):
    return torch_mha_forward(WEIGHTS, HEADS, x, context, causal, key_lengths)


class Server:
    """attnserve on 127.0.0.1: gRPC, metrics and HTTP on ephemeral ports."""

    def __init__(self, *flags):
        self.dir = tempfile.TemporaryDirectory(prefix="attnserve-http-")
        files = {k: os.path.join(self.dir.name, k) for k in ("port", "metrics", "http")}
        self.log_path = os.path.join(self.dir.name, "server.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [BINARY, "--listen", "127.0.0.1:0", "--port-file", files["port"], "--metrics-listen", "127.0.0.1:0",
             "--metrics-port-file", files["metrics"], "--http-listen", "127.0.0.1:0", "--http-port-file",
             files["http"], "--layer", f"small={SOURCE}", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f) for f in files.values()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"attnserve did not start:\n{log_tail(self.log_path)}")
            time.sleep(0.05)
        self.grpc = f"127.0.0.1:{int(read(files['port']))}"
        self.http = f"127.0.0.1:{int(read(files['http']))}"
        self.metrics_port = int(read(files["metrics"]))

    def metric(self, name, **labels):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if m and m.group(1) == name:
                got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if all(got.get(k) == v for k, v in labels.items()):
                    total += float(m.group(3))
        return total

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        text = read(self.log_path)
        self.dir.cleanup()
        return text


def curl(url, body=None, headers=(), extra=()):
    """(status, body bytes) of one curl call; body: bytes sent with POST."""
    args = [CURL, "-s", "-o", "-", "-w", "\n%{http_code}", *extra]
    for h in headers:
        args += ["-H", h]
    if body is not None:
        args += ["-X", "POST", "--data-binary", "@-"]
    r = subprocess.run(args + [url], input=body, capture_output=True, timeout=60)
    out = r.stdout
    cut = out.rfind(b"\n")
    return int(out[cut + 1:] or b"0"), out[:cut]


def json_body(inputs, parameters=None, outputs=None, nested=False):
    """A KServe v2 JSON request: inputs as (name, datatype, array)."""
    body = {"inputs": [{"name": n, "datatype": t, "shape": list(a.shape),
                        "data": a.tolist() if nested else a.ravel().tolist()} for n, t, a in inputs]}
    if parameters:
        body["parameters"] = parameters
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


class HttpRest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if CURL is None:
            raise AssertionError("curl is not installed (scripts/setup installs it)")
        cls.server = Server()
        cls.base = f"http://{cls.server.http}"
        cls.grpc = tgrpc.InferenceServerClient(cls.server.grpc)
        cls.http = thttp.InferenceServerClient(cls.server.http)
        cls.rng = np.random.default_rng(SEED)

    @classmethod
    def tearDownClass(cls):
        cls.http.close()
        cls.grpc.close()
        log = cls.server.stop()
        if cls.server.proc.returncode != 0:
            raise AssertionError(f"attnserve exited {cls.server.proc.returncode}:\n{log[-4000:]}")

    def random(self, *shape):
        a = self.rng.standard_normal(shape).astype(np.float32)
        self.assertGreater(np.abs(a).min(initial=1.0), 0.0)
        return a

    def grpc_infer(self, inputs, **params):
        """The gRPC Open Inference Protocol's y for the same inputs: (name, datatype, array)."""
        tensors = []
        for name, datatype, a in inputs:
            t = tgrpc.InferInput(name, list(a.shape), datatype)
            t.set_data_from_numpy(a)
            tensors.append(t)
        return self.grpc.infer("small", tensors, parameters=params).as_numpy("y")

    def http_infer(self, inputs, binary, **params):
        tensors = []
        for name, datatype, a in inputs:
            t = thttp.InferInput(name, list(a.shape), datatype)
            t.set_data_from_numpy(a, binary_data=binary)
            tensors.append(t)
        out = thttp.InferRequestedOutput("y", binary_data=binary)
        return self.http.infer("small", tensors, outputs=[out], parameters=params)

    # --- health, readiness, metadata -------------------------------------------------------

    def test_health_readiness_and_metadata(self):
        self.assertEqual(curl(f"{self.base}/v2/health/live"), (200, b'{"live":true}'))
        self.assertEqual(curl(f"{self.base}/v2/health/ready"), (200, b'{"ready":true}'))
        self.assertEqual(curl(f"{self.base}/v2/models/small/ready")[0], 200)
        self.assertEqual(curl(f"{self.base}/v2/models/small/versions/1/ready")[0], 200)
        self.assertTrue(self.http.is_server_live())
        self.assertTrue(self.http.is_server_ready())
        self.assertTrue(self.http.is_model_ready("small"))
        self.assertFalse(self.http.is_model_ready("nope"))
        status, body = curl(f"{self.base}/v2/models/nope/ready")
        self.assertEqual(status, 404)
        self.assertIn("no model (layer) named 'nope'", json.loads(body)["error"])
        status, body = curl(f"{self.base}/v2/models/small/versions/2")
        self.assertEqual(status, 404)
        self.assertIn('has only version "1", got \'2\'', json.loads(body)["error"])
        # The same content as gRPC's ModelMetadata.
        want = self.grpc.get_model_metadata("small", as_json=True)
        for url in (f"{self.base}/v2/models/small", f"{self.base}/v2/models/small/versions/1"):
            status, body = curl(url)
            self.assertEqual(status, 200)
            got = json.loads(body)
            self.assertEqual(got["name"], want["name"])
            self.assertEqual(got["versions"], want["versions"])
            self.assertEqual(got["platform"], want["platform"])
            for key in ("inputs", "outputs"):
                self.assertEqual([(t["name"], t["datatype"], [int(s) for s in t["shape"]]) for t in got[key]],
                                 [(t["name"], t["datatype"], [int(s) for s in t["shape"]]) for t in want[key]])
        self.assertEqual(self.http.get_model_metadata("small")["inputs"][0]["shape"], [-1, -1, D])
        status, _ = curl(f"{self.base}/v2/nothing")
        self.assertEqual(status, 404)
        status, body = curl(f"{self.base}/v2/models/small/infer")
        self.assertEqual(status, 405)
        self.assertIn("method: expected POST", json.loads(body)["error"])

    # --- answers equal gRPC's, within tolerance of float64 ---------------------------------

    def test_curl_json_equals_grpc_bitwise(self):
        for form in ("factored", "summed"):
            for nested in (False, True):
                with self.subTest(form=form, nested=nested):
                    x = self.random(2, 5, D)
                    status, body = curl(f"{self.base}/v2/models/small/infer",
                                        json_body([("x", "FP32", x)], {"form": form}, nested=nested),
                                        ["Content-Type: application/json"])
                    self.assertEqual(status, 200, body)
                    answer = json.loads(body)
                    self.assertEqual(answer["model_name"], "small")
                    self.assertEqual(answer["model_version"], "1")
                    self.assertEqual(answer["parameters"]["form"], form)
                    self.assertGreater(answer["parameters"]["compute_us"], 0)
                    (y_out,) = answer["outputs"]
                    self.assertEqual((y_out["name"], y_out["datatype"], y_out["shape"]), ("y", "FP32", [2, 5, D]))
                    y = np.array(y_out["data"], dtype=np.float64).astype(np.float32).reshape(2, 5, D)
                    want = self.grpc_infer([("x", "FP32", x)], form=form)
                    self.assertEqual(y.tobytes(), want.tobytes())
                    self.assertLess(rel_l2(y, reference(x)), 1e-5)

    def test_tritonclient_http_binary_and_json_equal_grpc_bitwise(self):
        x, context = self.random(2, 3, D), self.random(2, 6, D)
        key_lengths = np.array([[6], [4]], dtype=np.int32)
        inputs = [("x", "FP32", x), ("context", "FP32", context), ("key_lengths", "INT32", key_lengths)]
        want64 = reference(x, context, key_lengths=key_lengths.ravel())
        for form in ("factored", "summed"):
            want = self.grpc_infer(inputs, form=form)
            for binary in (True, False):
                with self.subTest(form=form, binary=binary):
                    result = self.http_infer(inputs, binary, form=form)
                    y = result.as_numpy("y")
                    self.assertEqual(y.dtype, np.float32)
                    self.assertEqual(y.tobytes(), want.tobytes())
                    self.assertLess(rel_l2(y, want64), 1e-5)
                    self.assertEqual(result.get_response()["parameters"]["form"], form)
        # Causal self-attention with a position offset, and FP16 input, still equal to gRPC's.
        y = self.http_infer([("x", "FP32", x)], True, form="summed", causal=True).as_numpy("y")
        self.assertEqual(y.tobytes(), self.grpc_infer([("x", "FP32", x)], form="summed", causal=True).tobytes())
        self.assertLess(rel_l2(y, reference(x, causal=True)), 1e-5)
        x16 = x.astype(np.float16)
        y = self.http_infer([("x", "FP16", x16)], True, form="factored").as_numpy("y")
        self.assertEqual(y.tobytes(), self.grpc_infer([("x", "FP16", x16)], form="factored").tobytes())
        self.assertLess(rel_l2(y, reference(x16.astype(np.float32))), 1e-5)

    def test_binary_data_with_curl(self):
        x = self.random(1, 4, D)
        header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4, D],
                                         "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"form": "summed", "binary_data_output": True}}).encode()
        args = [CURL, "-s", "-D", "-", "-o", "-", "-X", "POST", "--data-binary", "@-",
                "-H", f"Inference-Header-Content-Length: {len(header)}",
                "-H", "Content-Type: application/octet-stream", f"{self.base}/v2/models/small/infer"]
        out = subprocess.run(args, input=header + x.tobytes(), capture_output=True, timeout=60).stdout
        head, _, body = out.partition(b"\r\n\r\n")
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
        self.assertIn(b"200 OK", head.split(b"\r\n")[0])
        json_len = int(headers["Inference-Header-Content-Length"])
        meta = json.loads(body[:json_len])
        self.assertEqual(meta["outputs"][0]["parameters"]["binary_data_size"], x.nbytes)
        y = np.frombuffer(body[json_len:], "<f4").reshape(1, 4, D)
        self.assertEqual(y.tobytes(), self.grpc_infer([("x", "FP32", x)], form="summed").tobytes())

    # --- refusals ----------------------------------------------------------------------------

    def test_refusals_name_the_field_expected_and_got(self):
        x = self.random(1, 2, D)
        url = f"{self.base}/v2/models/small/infer"
        cases = [
            (b"{oops", 400, ["body", "expected a JSON object", "not JSON"]),
            (json_body([("q", "FP32", x)]), 400, ["inputs[0].name", "expected 'x', 'context' or 'key_lengths'", "'q'"]),
            (json_body([("x", "FP32", self.random(1, 2, D - 1))]), 400, ["x.shape[2]", str(D), str(D - 1)]),
            (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2, D], "data": [1.0]}]}).encode(),
             400, ["inputs[0].data", f"expected {2 * D} values", "got 1"]),
            (json_body([("x", "FP32", x)], {"form": "bogus"}), 400, ["parameters['form']", "expected 'factored'", "'bogus'"]),
            (json_body([("x", "FP32", x)], {"causal": "yes"}), 400, ["parameters['causal']", "expected a bool", "a string"]),
            (json_body([("x", "FP32", x)], outputs=[{"name": "z"}]), 400, ["outputs[0].name", "expected 'y'", "'z'"]),
        ]
        for body, want_status, fragments in cases:
            with self.subTest(fragments=fragments[0]):
                status, answer = curl(url, body)
                self.assertEqual(status, want_status, answer)
                message = json.loads(answer)["error"]
                for f in fragments:
                    self.assertIn(f, message)
        status, answer = curl(f"{self.base}/v2/models/nope/infer", json_body([("x", "FP32", x)]))
        self.assertEqual(status, 404)
        self.assertIn("layer: no layer named 'nope'", json.loads(answer)["error"])
        # tritonclient.http raises with the server's message.
        with self.assertRaises(Exception) as caught:
            self.http_infer([("x", "FP32", self.random(1, 2, 3))], True)
        self.assertIn("x.shape[2]", str(caught.exception))

    def test_http_calls_are_counted_like_grpc_ones(self):
        labels = {"layer": "small", "form": "summed"}
        ok0 = self.server.metric("attnserve_requests_total", code="OK", **labels)
        bad0 = self.server.metric("attnserve_requests_total", layer="small", code="INVALID_ARGUMENT")
        x = self.random(1, 3, D)
        for _ in range(3):
            self.http_infer([("x", "FP32", x)], True, form="summed")
        curl(f"{self.base}/v2/models/small/infer", b"{oops")
        self.assertEqual(self.server.metric("attnserve_requests_total", code="OK", **labels) - ok0, 3)
        self.assertEqual(self.server.metric("attnserve_requests_total", layer="small", code="INVALID_ARGUMENT") - bad0, 1)


class HttpListener(unittest.TestCase):
    """Servers of their own: the body limit, TLS, the drain."""

    def test_a_body_over_the_limit_is_refused_413(self):
        server = Server("--max-message-mb", "1")
        try:
            big = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[' + b"1," * (600 << 10) + b'1]}]}'
            url = f"http://{server.http}/v2/models/small/infer"
            # curl asks "Expect: 100-continue" for a body this size and waits; "Expect:" (empty)
            # makes it send the body at once, which the server must read and drop so that the
            # client gets the 413 rather than a reset. Chunked: no Content-Length to refuse early.
            for headers in ((), ("Expect:",), ("Expect:", "Transfer-Encoding: chunked")):
                for _ in range(3):
                    with self.subTest(headers=headers):
                        status, body = curl(url, big, headers=headers)
                        self.assertEqual(status, 413, body)
                        self.assertIn("body: expected at most 1048576 bytes (--max-message-mb)",
                                      json.loads(body)["error"])
            status, body = curl(url, b"{}", headers=("Expect: something-else",))
            self.assertEqual(status, 417, body)
            self.assertIn("Expect: expected '100-continue', got 'something-else'", json.loads(body)["error"])
            self.assertEqual(curl(f"http://{server.http}/v2/health/live")[0], 200)
        finally:
            server.stop()

    def test_a_large_body_is_answered_without_the_expect_stall(self):
        # Without "100 Continue" from the server, curl waits its expect timeout (1 s) before it
        # sends a body over 1 MiB: every large call would be a second late.
        server = Server("--max-message-mb", "8")
        try:
            rng = np.random.default_rng(SEED)
            x = rng.standard_normal((1, 1024, D)).astype(np.float32)
            body = json_body([("x", "FP32", x)])
            self.assertGreater(len(body), 1 << 20)
            url = f"http://{server.http}/v2/models/small/infer"
            timings = []
            for _ in range(3):
                start = time.monotonic()
                status, answer = curl(url, body)
                timings.append(time.monotonic() - start)
                self.assertEqual(status, 200, answer[:300])
                self.assertEqual(json.loads(answer)["outputs"][0]["shape"], [1, 1024, D])
            self.assertLess(min(timings), 0.9, f"{timings}: the server never sent 100 Continue")
        finally:
            server.stop()

    def test_tls_like_the_grpc_listener(self):
        tmp = tempfile.TemporaryDirectory(prefix="attnserve-http-tls-")
        cert, key = os.path.join(tmp.name, "c.pem"), os.path.join(tmp.name, "k.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                       check=True, capture_output=True)
        # Start and see: either the listener serves HTTPS with the gRPC listener's certificate,
        # or (a civetweb that cannot load this system's OpenSSL) the server refuses to start,
        # naming --http-listen. Never a plaintext HTTP listener beside a TLS gRPC one.
        proc_dir = tempfile.TemporaryDirectory(prefix="attnserve-http-tls-run-")
        files = {k: os.path.join(proc_dir.name, k) for k in ("port", "http")}
        log_path = os.path.join(proc_dir.name, "log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [BINARY, "--listen", "127.0.0.1:0", "--port-file", files["port"], "--metrics-listen", "127.0.0.1:0",
                 "--http-listen", "127.0.0.1:0", "--http-port-file", files["http"], "--layer", f"small={SOURCE}",
                 "--tls-cert", cert, "--tls-key", key], stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
            deadline = time.monotonic() + 60
            while proc.poll() is None and not os.path.exists(files["http"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                if proc.poll() is not None:
                    text = read(log_path)
                    self.assertNotEqual(proc.returncode, 0)
                    self.assertIn("http_listen: --tls-cert asks every listener for TLS", text)
                    self.assertIn("cannot load the system's OpenSSL", text)
                    print("http_test: this civetweb cannot serve TLS; the server refused to start, as it must")
                else:
                    port = int(read(files["http"]))
                    status, body = curl(f"https://127.0.0.1:{port}/v2/health/ready", extra=["--cacert", cert])
                    self.assertEqual((status, body), (200, b'{"ready":true}'))
                    status, _ = curl(f"http://127.0.0.1:{port}/v2/health/ready")
                    self.assertNotEqual(status, 200)  # no plaintext on the TLS port
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)
        tmp.cleanup()
        proc_dir.cleanup()

    def test_drain_answers_accepted_calls_and_refuses_new_ones_503(self):
        # One worker, one thread, long requests sent as binary data (quick to send, slow to
        # compute): calls queue in the pipeline, so some are in flight at SIGTERM.
        server = Server("--workers", "1", "--threads", "1", "--drain-timeout-s", "30")
        rng = np.random.default_rng(SEED + 1)
        x = rng.standard_normal((1, 4096, D)).astype(np.float32)
        header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                         "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"form": "factored", "binary_data_output": True}}).encode()
        results = []

        def call():
            results.append(curl(f"http://{server.http}/v2/models/small/infer", header + x.tobytes(),
                                [f"Inference-Header-Content-Length: {len(header)}"]))

        try:
            threads = [threading.Thread(target=call) for _ in range(4)]  # of the 8 HTTP threads
            for t in threads:
                t.start()
            wait_for_metric = time.monotonic() + 10
            while server.metric("attnserve_inflight_requests") < 4 and time.monotonic() < wait_for_metric:
                time.sleep(0.01)
            # Accepted at SIGTERM (in the pipeline): each of these must be answered in full.
            accepted = server.metric("attnserve_inflight_requests")
            server.proc.send_signal(signal.SIGTERM)
            # New calls during the drain: 503 naming the drain, and readiness false.
            refused = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and refused is None:
                status, answer = curl(f"http://{server.http}/v2/models/small/infer", json_body([("x", "FP32", x[:, :2])]))
                if status == 503:
                    refused = json.loads(answer)["error"]
                elif status == 0:
                    break  # the listener already closed: too late to see the 503
            ready = curl(f"http://{server.http}/v2/health/ready")[0]
            for t in threads:
                t.join(timeout=60)
            self.assertIsNotNone(refused, "no new call was refused 503 during the drain")
            self.assertIn("draining", refused)
            self.assertIn(ready, (503, 0))
            self.assertEqual(len(results), 4)
            self.assertGreaterEqual(accepted, 1)
            self.assertGreaterEqual(sum(status == 200 for status, _ in results), accepted)
            want = reference(x)
            for status, answer in results:
                if status == 503:  # sent before SIGTERM but not yet in the pipeline: refused whole
                    self.assertIn("draining", json.loads(answer)["error"])
                    continue
                self.assertEqual(status, 200, answer[:300])
                meta = json.loads(answer[:-x.nbytes])
                self.assertEqual(meta["outputs"][0]["parameters"]["binary_data_size"], x.nbytes)
                y = np.frombuffer(answer[-x.nbytes:], "<f4").reshape(x.shape)
                self.assertLess(rel_l2(y, want), 1e-5)
            server.proc.wait(timeout=30)
            self.assertEqual(server.proc.returncode, 0)
        finally:
            log = server.stop()
        self.assertIn("HTTP listener closed", log)


if __name__ == "__main__":
    unittest.main(verbosity=2)
