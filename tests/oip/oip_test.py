#!/usr/bin/python3
"""The Open Inference Protocol against the real attnserve, with Triton's own Python client.

tritonclient.grpc.InferenceServerClient (and, for requests it will not build, the
GRPCInferenceService stub it ships) talks to the attnserve binary on 127.0.0.1 (an ephemeral
port), serving a layer loaded from PyTorch's nn.MultiheadAttention weights
(tests/data/torch-mha). Answers are checked against oracles that share nothing with attnserve:
a float64 numpy computation of multi-head attention from the checkpoint's own tensors,
PyTorch's stored outputs, and attnserve.v1's Forward answer for the same input (attnserve-cli).
Metrics are read from the server's /metrics. Inputs are random (seeded per run, the seed printed).

Needs the venv scripts/fetch-oip-clients makes (scripts/setup runs it); without it the test
fails and says so. Environment: ATTNSERVE_BINARY, ATTNSERVE_CLI_BINARY, ATTNSERVE_SOURCE_DIR.
"""
import os
import sys

VENV_PYTHON = os.path.join(os.environ.get("ATTNSERVE_CACHE", os.path.expanduser("~/.cache/attnserve")),
                           "oip-clients", "bin", "python")
try:
    import numpy as np
    import grpc
    import tritonclient.grpc as triton
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
    from tritonclient.utils import InferenceServerException
except ImportError as e:
    # The venv's python links to the same interpreter: tell them apart by the prefix.
    venv_dir = os.path.dirname(os.path.dirname(VENV_PYTHON))
    if os.path.realpath(sys.prefix) != os.path.realpath(venv_dir) and os.path.exists(VENV_PYTHON):
        os.execv(VENV_PYTHON, [VENV_PYTHON] + sys.argv)
    sys.exit(f"FAIL: {e}: the Open Inference Protocol test needs tritonclient[grpc] and numpy in {VENV_PYTHON}; "
             "run scripts/setup (or scripts/fetch-oip-clients)")

import json
import re
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from attention_reference import read_safetensors, rel_l2, torch_mha_forward  # noqa: E402
from harness import die_with_parent, read  # noqa: E402

BINARY = os.environ["ATTNSERVE_BINARY"]
CLI = os.environ["ATTNSERVE_CLI_BINARY"]
SOURCE_DIR = os.environ["ATTNSERVE_SOURCE_DIR"]
DATA = os.path.join(SOURCE_DIR, "tests", "data", "torch-mha")
CHECKPOINT = os.path.join(DATA, "small.torch-mha.safetensors")
SOURCE = f"safetensors:{CHECKPOINT},heads=4"
D, HEADS = 64, 4
START_TIMEOUT_S = 60
SEED = int(os.environ.get("ATTNSERVE_TEST_SEED", time.time_ns() % (1 << 31)))
print(f"oip_test: seed {SEED} (ATTNSERVE_TEST_SEED={SEED} repeats this run)", flush=True)


WEIGHTS = {k: v.astype(np.float64) for k, v in read_safetensors(CHECKPOINT).items()}


def reference(x, context=None, causal=False, key_lengths=None):
    """nn.MultiheadAttention in float64 from the checkpoint (tests/tools/attention_reference.py)."""
    return torch_mha_forward(WEIGHTS, HEADS, x, context, causal, key_lengths)


class Server:
    """The attnserve binary on 127.0.0.1 with ephemeral gRPC and metrics ports."""

    def __init__(self, *flags, env=None):
        self.dir = tempfile.TemporaryDirectory(prefix="attnserve-oip-")
        port_file = os.path.join(self.dir.name, "port")
        metrics_file = os.path.join(self.dir.name, "metrics_port")
        self.log_path = os.path.join(self.dir.name, "server.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [BINARY, "--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen", "127.0.0.1:0",
             "--metrics-port-file", metrics_file, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (os.path.exists(port_file) and os.path.exists(metrics_file)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"attnserve did not start:\n{self.read_log()}")
            time.sleep(0.05)
        self.port = int(read(port_file))
        self.metrics_port = int(read(metrics_file))
        self.target = f"127.0.0.1:{self.port}"

    def read_log(self):
        self.log.flush()
        return read(self.log_path)

    def metric(self, name, **labels):
        """The sum of the series of `name` on /metrics that carry `labels` (0 when none)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def stop(self):
        """SIGTERM; the server must drain and exit 0 (a sanitizer report at exit would not)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log = self.read_log()
        self.log.close()
        self.dir.cleanup()
        if self.proc.returncode != 0:
            raise AssertionError(f"attnserve exited {self.proc.returncode}:\n{log[-4000:]}")


def infer_input(name, array, datatype):
    i = triton.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def raw_request(model, inputs, parameters=None, outputs=()):
    """A ModelInferRequest built by hand with Triton's generated messages: inputs as
    (name, datatype, array, 'raw' | 'typed')."""
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, array, how in inputs:
        t = req.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if how == "raw":
            req.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        elif datatype == "FP32":
            t.contents.fp32_contents.extend(array.ravel().tolist())
        else:
            t.contents.int_contents.extend(array.ravel().tolist())
    for key, value in (parameters or {}).items():
        p = req.parameters[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = value
    for name in outputs:
        req.outputs.add(name=name)
    return req


def output_of(response):
    """y from a ModelInferResponse as tritonclient reads it: raw_output_contents[0]."""
    assert [o.name for o in response.outputs] == ["y"], response.outputs
    assert response.outputs[0].datatype == "FP32"
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(list(response.outputs[0].shape))


class OpenInferenceProtocol(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # 'small': no route (the factored form unless a request says otherwise); 'routed': every
        # request without a form goes to the summed form (--route).
        cls.server = Server("--layer", f"small={SOURCE}", "--layer", f"routed={SOURCE}", "--route",
                            "routed=summed:1")
        cls.client = triton.InferenceServerClient(cls.server.target)
        cls.channel = grpc.insecure_channel(cls.server.target)
        cls.stub = service_pb2_grpc.GRPCInferenceServiceStub(cls.channel)
        cls.rng = np.random.default_rng(SEED)
        cls.tmp = tempfile.TemporaryDirectory(prefix="attnserve-oip-cli-")

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.channel.close()
        cls.tmp.cleanup()
        cls.server.stop()

    def random(self, *shape):
        a = self.rng.standard_normal(shape).astype(np.float32)
        self.assertGreater(np.abs(a).min(initial=1.0), 0.0)  # never an all-zero input
        return a

    def expect_error(self, code, fragments, call):
        with self.assertRaises((InferenceServerException, grpc.RpcError)) as caught:
            call()
        e = caught.exception
        got_code = e.status() if isinstance(e, InferenceServerException) else str(e.code())
        message = e.message() if isinstance(e, InferenceServerException) else e.details()
        self.assertEqual(got_code, f"StatusCode.{code}", message)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message

    def v1_forward(self, x, form, context=None, causal=False, key_lengths=None):
        """attnserve.v1's Forward answer for the same input, through attnserve-cli."""
        xin = os.path.join(self.tmp.name, "x.npy")
        yout = os.path.join(self.tmp.name, "y.npy")
        np.save(xin, x)
        args = [CLI, "--target", self.server.target, "forward", "--layer", "small", "--form", form, "--input", xin,
                "--output", yout]
        if context is not None:
            cin = os.path.join(self.tmp.name, "c.npy")
            np.save(cin, context)
            args += ["--context", cin]
        if causal:
            args.append("--causal")
        if key_lengths is not None:
            args += ["--key-lengths", ",".join(str(int(k)) for k in key_lengths)]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"form: {form}", r.stdout)
        return np.load(yout)

    # --- health, metadata, config ---------------------------------------------------------

    def test_server_and_model_readiness(self):
        self.assertTrue(self.client.is_server_live())
        self.assertTrue(self.client.is_server_ready())
        self.assertTrue(self.client.is_model_ready("small"))
        self.assertTrue(self.client.is_model_ready("small", "1"))
        self.assertFalse(self.client.is_model_ready("small", "2"))
        self.assertFalse(self.client.is_model_ready("no-such-layer"))
        meta = self.client.get_server_metadata(as_json=True)
        self.assertEqual(meta["name"], "attnserve")
        self.assertTrue(meta["version"])
        self.assertEqual(sorted(meta["extensions"]), ["model_configuration", "parameters"])

    def test_model_metadata(self):
        meta = self.client.get_model_metadata("small", as_json=True)
        self.assertEqual(meta["name"], "small")
        self.assertEqual(meta["versions"], ["1"])
        self.assertEqual(meta["platform"], "attnserve")
        inputs = {t["name"]: (t["datatype"], [int(s) for s in t["shape"]]) for t in meta["inputs"]}
        self.assertEqual(inputs, {"x": ("FP32", [-1, -1, D]), "context": ("FP32", [-1, -1, D]),
                                  "key_lengths": ("INT32", [-1, 1])})
        outputs = {t["name"]: (t["datatype"], [int(s) for s in t["shape"]]) for t in meta["outputs"]}
        self.assertEqual(outputs, {"y": ("FP32", [-1, -1, D])})
        self.expect_error("NOT_FOUND", ["no-such-layer", "loaded: "],
                          lambda: self.client.get_model_metadata("no-such-layer"))

    def test_model_config(self):
        config = self.client.get_model_config("small").config
        self.assertEqual(config.name, "small")
        self.assertEqual(config.platform, "attnserve")
        self.assertEqual(config.backend, "attnserve")
        self.assertGreater(config.max_batch_size, 0)
        self.assertTrue(config.HasField("dynamic_batching"))
        by_name = {i.name: i for i in config.input}
        self.assertEqual(list(by_name["x"].dims), [-1, D])
        self.assertFalse(by_name["x"].optional)
        self.assertEqual(list(by_name["context"].dims), [-1, D])
        self.assertTrue(by_name["context"].optional)
        self.assertTrue(by_name["key_lengths"].optional)
        self.assertEqual(by_name["x"].data_type, model_config_pb2.TYPE_FP32)
        self.assertEqual(by_name["key_lengths"].data_type, model_config_pb2.TYPE_INT32)
        self.assertEqual([(o.name, list(o.dims)) for o in config.output], [("y", [-1, D])])
        self.assertEqual(config.parameters["forms"].string_value, "factored,summed")

    # --- ModelInfer: answers against the oracles -------------------------------------------

    def test_both_forms_match_float64_and_attnserve_v1(self):
        x = self.random(2, 7, D)
        want = reference(x)
        for form in ("factored", "summed"):
            with self.subTest(form=form):
                result = self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"form": form})
                y = result.as_numpy("y")
                self.assertEqual(y.shape, (2, 7, D))
                self.assertLess(rel_l2(y, want), 1e-5)
                v1 = self.v1_forward(x, form)
                self.assertLess(rel_l2(y, v1), 1e-6)
                params = result.get_response().parameters
                self.assertEqual(params["form"].string_param, form)
                self.assertEqual(params["math"].string_param, "fp32")  # the CPU's default math
                self.assertGreaterEqual(params["queue_us"].int64_param, 0)
                self.assertGreater(params["compute_us"].int64_param, 0)
                self.assertGreaterEqual(params["batch_requests"].int64_param, 1)
                self.assertEqual(result.get_response().model_name, "small")
                self.assertEqual(result.get_response().model_version, "1")

    def test_the_math_parameter_is_checked_against_the_layer(self):
        x = self.random(1, 3, D)
        result = self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"math": "fp32"})
        self.assertEqual(result.get_response().parameters["math"].string_param, "fp32")
        self.expect_error("FAILED_PRECONDITION", ["math: layer 'small' is held in fp32 (--extra-maths), got bf16"],
                          lambda: self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"math": "bf16"}))
        self.expect_error("INVALID_ARGUMENT", ["math: expected fp32, tf32, bf16 or fp16 (or nothing), got 'fp8'"],
                          lambda: self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"math": "fp8"}))
        self.expect_error("INVALID_ARGUMENT", ["parameters['math']: expected a string, got a bool"],
                          lambda: self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"math": True}))

    def test_context_key_lengths_and_causal(self):
        x, c = self.random(2, 5, D), self.random(2, 9, D)
        lengths = np.array([9, 4], np.int32)
        cases = [
            ("cross + key_lengths", dict(context=c, key_lengths=lengths), {},
             [infer_input("x", x, "FP32"), infer_input("context", c, "FP32"),
              infer_input("key_lengths", lengths, "INT32")]),
            ("causal", dict(causal=True), {"causal": True}, [infer_input("x", x, "FP32")]),
            ("causal + key_lengths [batch, 1]", dict(causal=True, key_lengths=np.array([5, 2])), {"causal": True},
             [infer_input("x", x, "FP32"), infer_input("key_lengths", np.array([[5], [2]], np.int32), "INT32")]),
        ]
        for name, ref_args, params, inputs in cases:
            want = reference(x, **ref_args)
            for form in ("factored", "summed"):
                with self.subTest(case=name, form=form):
                    y = self.client.infer("small", inputs, parameters={"form": form, **params}).as_numpy("y")
                    self.assertLess(rel_l2(y, want), 1e-5)
        v1 = self.v1_forward(x, "summed", context=c, key_lengths=lengths)
        y = self.client.infer("small", cases[0][3], parameters={"form": "summed"}).as_numpy("y")
        self.assertLess(rel_l2(y, v1), 1e-6)

    def test_pytorch_vectors(self):
        manifest = json.loads(read(os.path.join(DATA, "manifest.json")))
        cases = read_safetensors(os.path.join(DATA, "small.cases.safetensors"))
        for case in manifest["layers"]["small"]["cases"]:
            name = case["name"]
            x = np.ascontiguousarray(cases[f"{name}.input"], np.float32)
            inputs = [infer_input("x", x, "FP32")]
            if case["has_context"]:
                inputs.append(infer_input("context", np.ascontiguousarray(cases[f"{name}.context"], np.float32),
                                          "FP32"))
            if case["key_lengths"] is not None:
                inputs.append(infer_input("key_lengths", np.array(case["key_lengths"], np.int32), "INT32"))
            for form in ("factored", "summed"):
                with self.subTest(case=name, form=form):
                    y = self.client.infer("small", inputs,
                                          parameters={"form": form, "causal": bool(case["causal"])}).as_numpy("y")
                    self.assertLess(rel_l2(y, cases[f"{name}.output"]), 1e-5)

    def test_typed_contents_equal_raw(self):
        x, c = self.random(2, 4, D), self.random(2, 6, D)
        lengths = np.array([6, 3], np.int32)
        answers = {}
        for how in ("raw", "typed"):
            req = raw_request("small", [("x", "FP32", x, how), ("context", "FP32", c, how),
                                        ("key_lengths", "INT32", lengths, how)], {"form": "factored"})
            answers[how] = output_of(self.stub.ModelInfer(req, timeout=30))
        self.assertLess(rel_l2(answers["typed"], reference(x, context=c, key_lengths=lengths)), 1e-5)
        np.testing.assert_array_equal(answers["typed"], answers["raw"])

    def test_fp16_input(self):
        x = self.random(1, 6, D).astype(np.float16)
        y = self.client.infer("small", [infer_input("x", x, "FP16")], parameters={"form": "summed"}).as_numpy("y")
        self.assertEqual(y.dtype, np.float32)
        self.assertLess(rel_l2(y, reference(x.astype(np.float64))), 1e-5)

    def test_compare_reports_divergence(self):
        x = self.random(1, 5, D)
        result = self.client.infer("small", [infer_input("x", x, "FP32")],
                                   parameters={"form": "summed", "compare": True})
        params = result.get_response().parameters
        self.assertEqual(params["form"].string_param, "summed")
        self.assertLess(params["divergence.factored.rel_l2"].double_param, 1e-5)
        self.assertGreater(params["divergence.factored.max_abs"].double_param, 0.0)

    def test_unknown_and_reserved_parameters_are_ignored(self):
        x = self.random(1, 3, D)
        plain = output_of(self.stub.ModelInfer(raw_request("small", [("x", "FP32", x, "raw")], {"form": "summed"})))
        noisy = raw_request("small", [("x", "FP32", x, "raw")],
                            {"form": "summed", "triton_enable_empty_final_response": True, "sequence_id": 7,
                             "priority": 1, "timeout": 1000, "binary_data_output": True, "headers": "x-a: b",
                             "my_own": 0.5})
        np.testing.assert_array_equal(output_of(self.stub.ModelInfer(noisy, timeout=30)), plain)
        # tritonclient's own parameters pass too (it refuses triton_* names client-side).
        y = self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"form": "summed", "foo": "bar"},
                              request_id="r-1", priority=1, timeout=10_000_000).as_numpy("y")
        np.testing.assert_array_equal(y, plain)

    # --- routing and metrics treat OIP requests as attnserve.v1 ones ----------------------

    def test_no_form_follows_the_route(self):
        x = self.random(1, 4, D)
        for model, want in (("routed", "summed"), ("small", "factored")):
            with self.subTest(model=model):
                for request_id in ("", "user-17"):
                    result = self.client.infer(model, [infer_input("x", x, "FP32")], request_id=request_id)
                    self.assertEqual(result.get_response().parameters["form"].string_param, want)
                    self.assertEqual(result.get_response().id, request_id)

    def test_requests_are_counted_like_attnserve_v1(self):
        labels = dict(layer="small", form="summed")
        ok0 = self.server.metric("attnserve_requests_total", code="OK", **labels)
        bad0 = self.server.metric("attnserve_requests_total", code="INVALID_ARGUMENT", **labels)
        x = self.random(1, 3, D)
        for _ in range(5):
            self.client.infer("small", [infer_input("x", x, "FP32")], parameters={"form": "summed"})
        bad = self.random(1, 3, D + 1)
        for _ in range(2):
            self.expect_error("INVALID_ARGUMENT", ["x.shape[2]"], lambda: self.client.infer(
                "small", [infer_input("x", bad, "FP32")], parameters={"form": "summed"}))
        self.assertEqual(self.server.metric("attnserve_requests_total", code="OK", **labels) - ok0, 5)
        self.assertEqual(self.server.metric("attnserve_requests_total", code="INVALID_ARGUMENT", **labels) - bad0, 2)

    # --- hostile requests --------------------------------------------------------------

    def test_malformed_requests_are_refused_with_what_was_expected(self):
        x = self.random(2, 3, D)
        nan = x.copy()
        nan[1, 2, 5] = np.nan
        short = raw_request("small", [("x", "FP32", x, "raw")])
        short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
        mixed = raw_request("small", [("x", "FP32", x, "raw")])
        mixed.inputs[0].contents.fp32_contents.extend([1.0])
        typed_fp16 = raw_request("small", [("x", "FP32", x, "typed")])
        typed_fp16.inputs[0].datatype = "FP16"
        empty = raw_request("small", [("x", "FP32", x, "typed")])
        del empty.inputs[0].contents.fp32_contents[:]
        raw_count = raw_request("small", [("x", "FP32", x, "raw"), ("context", "FP32", x, "typed")])
        cases = [
            ("INVALID_ARGUMENT", ["x.shape[2] (d_model): expected 64", "got 63"],
             raw_request("small", [("x", "FP32", self.random(2, 3, 63), "raw")])),
            ("INVALID_ARGUMENT", ["x.shape: expected rank 3"],
             raw_request("small", [("x", "FP32", self.random(3, D), "raw")])),
            ("INVALID_ARGUMENT", ["x.data: expected 1536 bytes", "got 1532"], short),
            ("INVALID_ARGUMENT", ["x.data: expected 1536 bytes", "got 0"], empty),
            ("INVALID_ARGUMENT", ["x.data: expected finite values", "nan", "[1, 2, 5]"],
             raw_request("small", [("x", "FP32", nan, "raw")])),
            ("INVALID_ARGUMENT", ["raw_input_contents", "got both"], mixed),
            ("INVALID_ARGUMENT", ["raw_input_contents: expected one entry per input (2), got 1"], raw_count),
            ("INVALID_ARGUMENT", ["x: expected FP16 values in raw_input_contents"], typed_fp16),
            ("INVALID_ARGUMENT", ["x.datatype: expected FP32, FP16 or BF16", "'INT8'"],
             raw_request("small", [("x", "INT8", np.ones((1, 2, D), np.int8), "raw")])),
            ("INVALID_ARGUMENT", ["inputs[1].name: expected 'x', 'context' or 'key_lengths'", "'mask'"],
             raw_request("small", [("x", "FP32", x, "raw"), ("mask", "FP32", x, "raw")])),
            ("INVALID_ARGUMENT", ["expected 'x' once, got it twice"],
             raw_request("small", [("x", "FP32", x, "raw"), ("x", "FP32", x, "raw")])),
            ("INVALID_ARGUMENT", ["x: expected a [batch, n, d_model=64] tensor, got none"],
             raw_request("small", [("context", "FP32", x, "raw")])),
            ("INVALID_ARGUMENT", ["context.shape[0] (batch): expected 2 (input's batch), got 1"],
             raw_request("small", [("x", "FP32", x, "raw"), ("context", "FP32", self.random(1, 4, D), "raw")])),
            ("INVALID_ARGUMENT", ["key_lengths[1]: expected a value in [1, 3]", "got 4"],
             raw_request("small", [("x", "FP32", x, "raw"), ("key_lengths", "INT32", np.array([1, 4], np.int32),
                                                              "raw")])),
            ("INVALID_ARGUMENT", ["key_lengths: expected 2 values (one per batch row)", "got 3"],
             raw_request("small", [("x", "FP32", x, "raw"), ("key_lengths", "INT32",
                                                              np.array([1, 1, 1], np.int32), "raw")])),
            ("INVALID_ARGUMENT", ["key_lengths.datatype: expected INT32", "'INT64'"],
             raw_request("small", [("x", "FP32", x, "raw"), ("key_lengths", "INT64", np.array([1, 1], np.int64),
                                                              "raw")])),
            ("INVALID_ARGUMENT", ["parameters['form']: expected 'factored', 'summed', 'lowrank' or 'auto'", "'fast'"],
             raw_request("small", [("x", "FP32", x, "raw")], {"form": "fast"})),
            ("INVALID_ARGUMENT", ["parameters['causal']: expected a bool, got a string"],
             raw_request("small", [("x", "FP32", x, "raw")], {"causal": "yes"})),
            ("INVALID_ARGUMENT", ["position_offset: expected a value in [0,", "got -1"],
             raw_request("small", [("x", "FP32", x, "raw")], {"position_offset": -1})),
            ("INVALID_ARGUMENT", ["outputs[0].name: expected 'y', got 'z'"],
             raw_request("small", [("x", "FP32", x, "raw")], outputs=["z"])),
            ("FAILED_PRECONDITION", ["does not hold the lowrank form"],
             raw_request("small", [("x", "FP32", x, "raw")], {"form": "lowrank"})),
            ("NOT_FOUND", ["no layer named 'nope'", "loaded: "], raw_request("nope", [("x", "FP32", x, "raw")])),
        ]
        for code, fragments, request in cases:
            with self.subTest(expected=fragments[0]):
                self.expect_error(code, fragments, lambda: self.stub.ModelInfer(request, timeout=30))
        version = raw_request("small", [("x", "FP32", x, "raw")])
        version.model_version = "2"
        self.expect_error("NOT_FOUND", ["model_version: expected \"1\" or empty", "'2'"],
                          lambda: self.stub.ModelInfer(version, timeout=30))
        # The server still answers well after all of them.
        y = self.client.infer("small", [infer_input("x", x, "FP32")]).as_numpy("y")
        self.assertLess(rel_l2(y, reference(x)), 1e-5)

    def test_unimplemented_calls_say_so(self):
        message = self.expect_error("UNIMPLEMENTED", ["ModelStatistics is not implemented", "/metrics"],
                                    lambda: self.client.get_inference_statistics("small"))
        self.assertIn("docs/service.md", message)
        self.expect_error("UNIMPLEMENTED", ["RepositoryModelLoad is not implemented", "LoadLayer"],
                          lambda: self.client.load_model("small"))
        self.expect_error("UNIMPLEMENTED", ["SystemSharedMemoryStatus is not implemented"],
                          lambda: self.client.get_system_shared_memory_status())
        stream = self.stub.ModelStreamInfer(iter([raw_request("small", [("x", "FP32", self.random(1, 2, D), "raw")])]),
                                            timeout=30)
        self.expect_error("UNIMPLEMENTED", ["ModelStreamInfer is not implemented", "ModelInfer"], lambda: list(stream))


class PerfAnalyzer(unittest.TestCase):
    """Triton's load generator against the real server, at concurrency 1 to 4 with the form as a
    request parameter: it runs to completion, and the server counts its requests, all OK, all
    under the summed form. Its exit status and throughput prove nothing on their own (it exits 0
    while every request fails); the server's counts do."""

    def test_runs_to_completion_and_every_request_is_counted(self):
        venv = os.path.dirname(os.path.dirname(VENV_PYTHON))
        perf_analyzer = os.path.join(venv, "bin", "perf_analyzer")
        cudart = [os.path.join(p, "nvidia", "cuda_runtime", "lib") for p in sys.path if p.endswith("site-packages")]
        cudart = [p for p in cudart if os.path.exists(os.path.join(p, "libcudart.so.12"))]
        self.assertTrue(os.access(perf_analyzer, os.X_OK) and cudart,
                        f"perf_analyzer or libcudart.so.12 missing in {venv}: run scripts/fetch-oip-clients")
        server = Server()  # the built-in 'demo' layer: d_model 768, 12 heads
        try:
            d = 768
            tmp = server.dir.name
            # x only: perf_analyzer then leaves the optional inputs out of its requests (it still
            # wants a shape for every input of dynamic shape, hence --shape context:1,768).
            x = np.random.default_rng(SEED).standard_normal((16, d)).astype(np.float32)
            data = os.path.join(tmp, "input.json")
            with open(data, "w") as f:
                json.dump({"data": [{"x": {"content": x.ravel().tolist(), "shape": [16, d]}}]}, f)
            export = os.path.join(tmp, "profile.json")
            labels = dict(layer="demo")
            ok0 = server.metric("attnserve_requests_total", form="summed", code="OK", **labels)
            factored0 = server.metric("attnserve_requests_total", form="factored", code="OK", **labels)
            env = dict(os.environ, LD_LIBRARY_PATH=":".join(cudart + [os.environ.get("LD_LIBRARY_PATH", "")]))
            # -s 1000: any three windows count as stable (this machine's load is not the point).
            run = subprocess.run(
                [perf_analyzer, "-i", "grpc", "-u", server.target, "-m", "demo", "--input-data", data, "--shape",
                 f"context:1,{d}", "-b", "1", "--concurrency-range", "1:4", "--request-parameter",
                 "form:summed:string", "--measurement-interval", "500", "-s", "1000", "--profile-export-file",
                 export], capture_output=True, text=True, timeout=240, env=env)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            reported = [int(n) for n in re.findall(r"Request count: (\d+)", run.stdout)]
            self.assertEqual(len(reported), 4, f"one report per concurrency level:\n{run.stdout}")
            self.assertTrue(all(n > 0 for n in reported), run.stdout)
            with open(export) as f:
                experiments = json.load(f)["experiments"]
            sent = sum(len(e["requests"]) for e in experiments)
            self.assertGreaterEqual(sent, sum(reported))
            ok = server.metric("attnserve_requests_total", form="summed", code="OK", **labels) - ok0
            # Every request perf_analyzer recorded was served OK by the summed form; beyond those,
            # at most the requests still in flight when it moved to the next level (<= 4 each).
            self.assertGreaterEqual(ok, sent)
            self.assertLessEqual(ok, sent + 4 * len(experiments))
            self.assertEqual(server.metric("attnserve_requests_total", form="factored", code="OK", **labels),
                             factored0, "every request named the summed form (--request-parameter)")
            every = server.metric("attnserve_requests_total", **labels)
            self.assertEqual(every, server.metric("attnserve_requests_total", code="OK", **labels),
                             "perf_analyzer's requests all answered OK")
        finally:
            server.stop()


class PerfAnalyzerPlainCommand(unittest.TestCase):
    """What README.md says of `perf_analyzer -m demo --shape x:16,768`: perf_analyzer 2.41 wants a
    shape for the optional `context` too, and its generated data cannot be attention inputs
    (random bytes hold NaN bit patterns, which the server refuses naming the element). When this
    test fails, perf_analyzer or the model's metadata changed: the README's advice may be stale."""

    def test_fails_for_the_reasons_the_readme_gives(self):
        venv = os.path.dirname(os.path.dirname(VENV_PYTHON))
        perf_analyzer = os.path.join(venv, "bin", "perf_analyzer")
        cudart = [os.path.join(p, "nvidia", "cuda_runtime", "lib") for p in sys.path if p.endswith("site-packages")]
        cudart = [p for p in cudart if os.path.exists(os.path.join(p, "libcudart.so.12"))]
        self.assertTrue(os.access(perf_analyzer, os.X_OK) and cudart,
                        f"perf_analyzer or libcudart.so.12 missing in {venv}: run scripts/fetch-oip-clients")
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(cudart + [os.environ.get("LD_LIBRARY_PATH", "")]))
        server = Server()  # the built-in 'demo' layer
        try:
            base = [perf_analyzer, "-i", "grpc", "-u", server.target, "-m", "demo", "--shape", "x:16,768",
                    "--measurement-interval", "500", "-s", "1000"]
            plain = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
            self.assertIn("input context contains dynamic shape", plain.stdout + plain.stderr)
            generated = subprocess.run(base + ["--shape", "context:16,768"], capture_output=True, text=True,
                                       timeout=120, env=env)
            self.assertIn("x.data: expected finite values", generated.stdout + generated.stderr)
        finally:
            server.stop()


class ResponseLimit(unittest.TestCase):
    """The largest response counts what the OIP echoes: the request id comes back in the answer,
    so an id that pushes an answer past --max-message-mb is refused before compute, naming the
    flag, rather than failing when gRPC sends it."""

    def test_echoed_id_counts_against_the_largest_response(self):
        server = Server("--layer", f"small={SOURCE}", "--max-message-mb", "1")
        try:
            client = triton.InferenceServerClient(server.target)
            # FP16 in, FP32 out: 4000 x 64 x 4 = 1,024,000 bytes of output, under 1 MiB alone.
            x = np.random.default_rng(SEED).standard_normal((1, 4000, D)).astype(np.float16)
            y = client.infer("small", [infer_input("x", x, "FP16")], request_id="short").as_numpy("y")
            self.assertEqual(y.shape, (1, 4000, D))
            with self.assertRaises(InferenceServerException) as caught:
                client.infer("small", [infer_input("x", x, "FP16")], request_id="r" * 30000)
            self.assertEqual(caught.exception.status(), "StatusCode.RESOURCE_EXHAUSTED")
            self.assertIn("--max-message-mb", caught.exception.message())
            client.close()
        finally:
            server.stop()


class DeviceFault(unittest.TestCase):
    """ServerReady and ModelReady follow the device's health as the health service does: a device
    fault (the emulated GPU of tests/cuda_emulation, told to fail its first GEMM once the server
    is up: its warmup runs GEMMs before it is ready) fails the request and takes the server out of
    rotation; ServerLive stays true."""

    def test_not_ready_after_a_device_fault(self):
        if os.environ.get("ATTNSERVE_SERVER_LOADS_CUDA_PLUGIN", "1") != "1":
            self.skipTest("this attnserve was built without the CUDA toolkit: --device cuda loads no plugin")
        plugin = os.environ.get("ATTNSERVE_EMULATED_PLUGIN", "")
        self.assertTrue(os.path.exists(plugin), f"the emulated CUDA plugin is missing: '{plugin}'")
        armed = tempfile.TemporaryDirectory(prefix="attnserve-oip-fault-")
        self.addCleanup(armed.cleanup)
        armed_file = os.path.join(armed.name, "armed")
        server = Server("--device", "cuda", "--layer", f"small={SOURCE}",
                        env=dict(os.environ, ATTNSERVE_CUDA_PLUGIN_PATH=plugin,
                                 ATTNSERVE_CUDA_EMULATION_FAULT_AT_GEMM="0",
                                 ATTNSERVE_CUDA_EMULATION_FAULT_ARMED_BY=armed_file))
        try:
            with open(armed_file, "w") as f:
                f.write("armed\n")
            client = triton.InferenceServerClient(server.target)
            self.assertTrue(client.is_server_ready())
            self.assertEqual(client.get_model_config("small").config.parameters["device"].string_value, "cuda:0")
            x = np.random.default_rng(SEED).standard_normal((1, 3, D)).astype(np.float32)
            with self.assertRaises(InferenceServerException) as caught:
                client.infer("small", [infer_input("x", x, "FP32")])
            self.assertEqual(caught.exception.status(), "StatusCode.INTERNAL")
            self.assertIn("cuBLAS error", caught.exception.message())
            deadline = time.monotonic() + 5  # the device watch polls every 250 ms
            while client.is_server_ready() and time.monotonic() < deadline:
                time.sleep(0.1)
            self.assertFalse(client.is_server_ready())
            self.assertFalse(client.is_model_ready("small"))
            self.assertTrue(client.is_server_live())
            client.close()
        finally:
            server.stop()


class Drain(unittest.TestCase):
    """ServerReady and ModelReady follow the drain as health does; ServerLive stays true."""

    def test_not_ready_while_draining(self):
        # One call still computing after SIGTERM: the summed form of a d_model 1024 layer over
        # 4096 tokens, ~140 GFLOP (seconds on these 2 cores). (A queue delay no longer holds a
        # call: the drain runs what is queued at once.)
        server = Server("--layer", f"small={SOURCE}", "--layer", "slow=random:d_model=1024,heads=16,seed=3",
                        "--drain-timeout-s", "60")
        try:
            client = triton.InferenceServerClient(server.target)
            self.assertTrue(client.is_server_ready())
            x = np.random.default_rng(SEED).standard_normal((1, 3, D)).astype(np.float32)
            big = np.random.default_rng(SEED + 1).standard_normal((1, 4096, 1024)).astype(np.float32)
            answer = {}

            def slow_call():
                try:
                    answer["y"] = client.infer("slow", [infer_input("x", big, "FP32")],
                                               parameters={"form": "summed"}, client_timeout=120).as_numpy("y")
                except Exception as e:  # noqa: BLE001 - reported by the assertion below
                    answer["error"] = e

            t = threading.Thread(target=slow_call)
            t.start()
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            self.assertTrue(client.is_server_live())
            self.assertFalse(client.is_server_ready())
            self.assertFalse(client.is_model_ready("small"))
            with self.assertRaises(InferenceServerException) as caught:
                client.infer("small", [infer_input("x", x, "FP32")])
            self.assertEqual(caught.exception.status(), "StatusCode.UNAVAILABLE")
            self.assertIn("draining", caught.exception.message())
            t.join(timeout=120)
            self.assertNotIn("error", answer, answer.get("error"))
            self.assertEqual(answer["y"].shape, big.shape)
            self.assertTrue(np.isfinite(answer["y"]).all())
            self.assertEqual(server.proc.wait(timeout=60), 0)
            client.close()
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
