#!/usr/bin/python3
"""The Python client (client/python) installed as a user installs it, against the real server.

The package is installed with pip from a copy of the tree (client/python, proto/, CMakeLists.txt)
into a temporary folder, offline: Debian's python3 with --no-build-isolation, so setup.py
generates the stubs with Debian's protoc and grpc_python_plugin, which match Debian's
python3-grpcio and python3-protobuf. Then attnserve.Client talks to the attnserve binary on
127.0.0.1 (ephemeral ports) serving a layer loaded from PyTorch's nn.MultiheadAttention weights
(tests/data/torch-mha). Oracles that share nothing with attnserve or its client: a float64 numpy
computation of the attention from the checkpoint's own tensors, numpy's SVD of every head's
W_V_i W_O_i, the server's metrics, and the statuses a broken request must get. TLS and mTLS on a
throwaway CA made with openssl. The README's example script (client/python/examples) runs too.

Environment: ATTNSERVE_BINARY, ATTNSERVE_SOURCE_DIR.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

SOURCE_DIR = os.environ["ATTNSERVE_SOURCE_DIR"]
BINARY = os.environ["ATTNSERVE_BINARY"]
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "tools"))
from attention_reference import read_safetensors, rel_l2, torch_mha_forward  # noqa: E402
from harness import die_with_parent, read, stop  # noqa: E402

CHECKPOINT = os.path.join(SOURCE_DIR, "tests", "data", "torch-mha", "small.torch-mha.safetensors")
SOURCE = f"safetensors:{CHECKPOINT},heads=4"
D, HEADS = 64, 4
ADMIN_TOKEN = "python-client-test-token-0123456789"
SEED = int(os.environ.get("ATTNSERVE_TEST_SEED", time.time_ns() % (1 << 31)))
print(f"python_client_test: seed {SEED} (ATTNSERVE_TEST_SEED={SEED} repeats this run)", flush=True)

WORK = tempfile.TemporaryDirectory(prefix="attnserve-pyclient-")


def install_package():
    """pip install of client/python from a copy of what it is built from; returns the folder."""
    src = os.path.join(WORK.name, "src")
    shutil.copytree(os.path.join(SOURCE_DIR, "client", "python"), os.path.join(src, "client", "python"),
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copytree(os.path.join(SOURCE_DIR, "proto"), os.path.join(src, "proto"))
    shutil.copy(os.path.join(SOURCE_DIR, "CMakeLists.txt"), src)
    site = os.path.join(WORK.name, "site")
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                          "--disable-pip-version-check", "--target", site, os.path.join(src, "client", "python")],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise AssertionError(f"pip install ./client/python failed:\n{out.stdout}\n{out.stderr}")
    return site


SITE = install_package()
sys.path.insert(0, SITE)
import attnserve  # noqa: E402

W = {k: v.astype(np.float64) for k, v in read_safetensors(CHECKPOINT).items()}


def reference(x, context=None, causal=False, key_lengths=None):
    """nn.MultiheadAttention in float64 from the checkpoint (tests/tools/attention_reference.py)."""
    return torch_mha_forward(W, HEADS, x, context, causal, key_lengths)


class Server:
    """The attnserve binary on 127.0.0.1, ephemeral ports; stop() needs exit status 0."""

    def __init__(self, *flags, env=None):
        self.dir = tempfile.mkdtemp(prefix="server-", dir=WORK.name)
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "server.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([BINARY, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                          "--metrics-listen", "127.0.0.1:0", "--threads", "2", *flags],
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                         env=dict(os.environ, **(env or {})))
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"attnserve did not start:\n{read(self.log_path)}")
            time.sleep(0.05)
        self.port = int(read(port_file))

    def stop(self):
        stop(self.proc, timeout=30)
        if self.proc.returncode != 0:
            raise AssertionError(f"attnserve exited {self.proc.returncode}:\n{read(self.log_path)[-4000:]}")


class ClientAgainstServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--layer", f"small={SOURCE}", "--layer", "demo=random:d_model=64,heads=4,seed=5",
                            env={"ATTNSERVE_ADMIN_TOKEN": ADMIN_TOKEN})
        cls.client = attnserve.Client(f"127.0.0.1:{cls.server.port}", admin_token=ADMIN_TOKEN)
        cls.rng = np.random.default_rng(SEED)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def random(self, *shape):
        a = self.rng.standard_normal(shape).astype(np.float32)
        self.assertGreater(np.abs(a).min(initial=1.0), 0.0)  # never an all-zero input
        return a

    def test_version_is_the_projects(self):
        with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
            self.assertIn(f"project(attnserve VERSION {attnserve.__version__} ", f.read())

    def test_forward_both_forms_against_float64(self):
        x = self.random(3, 7, D)
        want = reference(x)
        for form in ("factored", "summed"):
            result = self.client.forward("small", x, form=form)
            self.assertEqual(result.form, form)
            self.assertEqual(result.output.shape, (3, 7, D))
            self.assertEqual(result.output.dtype, np.float32)
            self.assertTrue(result.output.flags.writeable)
            self.assertLess(rel_l2(result.output, want), 1e-5, form)
            self.assertGreater(result.compute_us, 0)
            self.assertGreaterEqual(result.batch_requests, 1)
            self.assertEqual(result.divergence, {})

    def test_form_auto_is_answered_by_an_exact_form(self):
        # The proto's FORM_AUTO reaches the client as the form "auto"; the answer names the exact
        # form that served it and is that form's, bit for bit.
        x = self.random(1, 5, D)
        result = self.client.forward("small", x, form="auto")
        self.assertIn(result.form, ("factored", "summed"))
        self.assertLess(rel_l2(result.output, reference(x)), 1e-5)
        named = self.client.forward("small", x, form=result.form).output
        self.assertTrue(np.array_equal(result.output, named))

    def test_one_sequence_float16_float64_inputs(self):
        x = self.random(9, D)
        y = self.client.forward("small", x).output
        self.assertEqual(y.shape, (9, D))
        self.assertLess(rel_l2(y, reference(x[None])[0]), 1e-5)
        half = x.astype(np.float16)
        self.assertLess(rel_l2(self.client.forward("small", half).output, reference(half[None].astype(np.float64))[0]),
                        1e-5)
        self.assertLess(rel_l2(self.client.forward("small", x.astype(np.float64)).output, reference(x[None])[0]), 1e-5)

    def test_context_causal_key_lengths(self):
        x, c = self.random(2, 5, D), self.random(2, 8, D)
        got = self.client.forward("small", x, context=c, key_lengths=[3, 8]).output
        self.assertLess(rel_l2(got, reference(x, context=c, key_lengths=[3, 8])), 1e-5)
        got = self.client.forward("small", x, causal=True, form="summed").output
        self.assertLess(rel_l2(got, reference(x, causal=True)), 1e-5)
        one = self.client.forward("small", x[0], context=c[0], key_lengths=4).output
        self.assertLess(rel_l2(one, reference(x[:1], context=c[:1], key_lengths=[4])[0]), 1e-5)

    def test_compare_reports_the_other_form(self):
        x = self.random(2, 6, D)
        result = self.client.compare("small", x, form="factored")
        self.assertEqual(result.form, "factored")
        self.assertEqual(set(result.divergence), {"summed"})
        summed = self.client.forward("small", x, form="summed").output
        d = result.divergence["summed"]
        # The server's divergence against the two answers this client got (recomputed here).
        self.assertAlmostEqual(d.max_abs, float(np.abs(summed - result.output).max()), delta=1e-6)
        self.assertLess(d.rel_l2, 1e-5)
        self.assertGreater(d.max_abs, 0.0)

    def test_layers_and_spectrum(self):
        names = {info.name: info for info in self.client.layers()}
        self.assertEqual(set(names), {"small", "demo"})
        small = self.client.layer("small")
        self.assertEqual((small.d_model, small.heads, small.kv_heads, small.d_head), (D, HEADS, HEADS, D // HEADS))
        self.assertTrue(small.bias)
        self.assertAlmostEqual(small.scale, 1 / np.sqrt(D // HEADS), places=6)
        self.assertEqual(set(small.forms), {"factored", "summed"})
        self.assertEqual(small.forms["factored"].parameters, 4 * D * D + 4 * D)
        self.assertIsNone(small.spectrum)
        spectrum = self.client.spectrum("small")
        self.assertEqual(len(spectrum.ov), HEADS)
        dh = D // HEADS
        wv, wo = W["in_proj_weight"][2 * D:], W["out_proj.weight"]
        for h in range(HEADS):
            # x W_V_hᵀ then W_O's columns of head h: the d×d map is W_V_hᵀ W_O_hᵀ.
            ov = wv[h * dh:(h + 1) * dh].T @ wo[:, h * dh:(h + 1) * dh].T
            want = np.linalg.svd(ov, compute_uv=False)[:dh]
            got = spectrum.ov[h].singular_values
            np.testing.assert_allclose(got[:dh], want, rtol=1e-4, atol=1e-6)
            self.assertAlmostEqual(spectrum.ov[h].frobenius, float(np.linalg.norm(ov)), delta=1e-4 * np.linalg.norm(ov))
        self.assertEqual(spectrum.singular_values("ov").shape[0], HEADS)

    def test_live_calibration(self):
        # calibration=live:ROWS: the rows of served calls build the low-rank form in the background.
        source = "random:d_model=16,heads=2,seed=3,summed=false,lowrank=divergence:0.2,calibration=live:32"
        info = self.client.load("live", source)
        try:
            self.assertNotIn("lowrank", info.forms)
            self.assertEqual(info.live_calibration, attnserve.LiveCalibration("divergence:0.2", 32, 0, ""))
            self.client.forward("live", self.random(1, 20, 16), form="factored")
            self.assertEqual(self.client.layer("live").live_calibration.rows_seen, 20)
            with self.assertRaises(attnserve.AttnserveError) as caught:
                self.client.forward("live", self.random(1, 4, 16), form="lowrank")
            self.assertEqual(caught.exception.code_name, "UNAVAILABLE")
            self.assertIn("20 of 32 rows", str(caught.exception))
            self.client.forward("live", self.random(1, 20, 16), form="factored")
            deadline = time.monotonic() + 30
            while "lowrank" not in self.client.layer("live").forms and time.monotonic() < deadline:
                time.sleep(0.02)
            built = self.client.layer("live")
            self.assertIn("lowrank", built.forms)
            self.assertIsNone(built.live_calibration)
            self.assertEqual(built.forms["lowrank"].calibration_rows, 32)
            self.assertLessEqual(built.forms["lowrank"].calibration_divergence, 0.2)
            self.assertEqual(self.client.forward("live", self.random(1, 4, 16), form="lowrank").output.shape, (1, 4, 16))
        finally:
            self.client.unload("live")

    def test_route_and_routing(self):
        try:
            routing = self.client.route("small", {"summed": 1})
            self.assertEqual(routing.routes["small"], {"summed": 1.0})
            self.assertEqual(self.client.routing().routes["small"], {"summed": 1.0})
            x = self.random(1, 4, D)
            self.assertEqual(self.client.forward("small", x).form, "summed")  # no form: the route
            self.assertEqual(self.client.forward("small", x, form="factored").form, "factored")
            # A target naming its math; the layer is held in the CPU's fp32 alone.
            routing = self.client.route("small", {"summed@fp32": 1})
            self.assertEqual(routing.routes["small"], {"summed@fp32": 1.0})
            result = self.client.forward("small", x)
            self.assertEqual((result.form, result.math), ("summed", "fp32"))
            self.assertEqual(self.client.layer("small").maths, ["fp32"])
            with self.assertRaises(attnserve.AttnserveError) as e:
                self.client.forward("small", x, math="bf16")
            self.assertIn("math: layer 'small' is held in fp32 (--extra-maths), got bf16", str(e.exception))
            self.assertEqual(self.client.route(shadow_rate=0.25).shadow_rate, 0.25)
        finally:
            routing = self.client.route("small", {}, shadow_rate=0.0)
        self.assertNotIn("small", routing.routes)
        self.assertEqual(self.client.forward("small", self.random(1, 4, D)).form, "factored")

    def test_admin_calls_need_the_token(self):
        with attnserve.Client(f"127.0.0.1:{self.server.port}") as anonymous:
            with self.assertRaises(attnserve.AttnserveError) as caught:
                anonymous.load("extra", "random:d_model=32,heads=2,seed=1")
            self.assertEqual(caught.exception.code_name, "UNAUTHENTICATED")
            self.assertEqual(str(caught.exception), f"LoadLayer: UNAUTHENTICATED: {caught.exception.details}")
            with self.assertRaises(attnserve.AttnserveError) as caught:
                anonymous.route("*", {"summed": 1})
            self.assertEqual(caught.exception.code_name, "UNAUTHENTICATED")
        with attnserve.Client(f"127.0.0.1:{self.server.port}", admin_token="wrong-token-0123456789") as wrong:
            with self.assertRaises(attnserve.AttnserveError) as caught:
                wrong.load("extra", "random:d_model=32,heads=2,seed=1")
            self.assertEqual(caught.exception.code_name, "UNAUTHENTICATED")
        info = self.client.load("extra", "random:d_model=32,heads=2,seed=1")
        self.assertEqual((info.name, info.d_model, info.heads), ("extra", 32, 2))
        self.client.unload("extra")
        self.assertNotIn("extra", {i.name for i in self.client.layers()})

    def test_errors_name_the_status_and_the_field(self):
        cases = [
            (lambda: self.client.forward("small", self.random(1, 3, D - 1)), "INVALID_ARGUMENT", "d_model"),
            (lambda: self.client.forward("nosuch", self.random(1, 3, D)), "NOT_FOUND", "nosuch"),
            (lambda: self.client.forward("small", self.random(1, 3, D), form="lowrank"), "FAILED_PRECONDITION",
             "lowrank"),
            (lambda: self.client.forward("small", self.random(2, 3, D), key_lengths=[1]), "INVALID_ARGUMENT",
             "key_lengths"),
            (lambda: self.client.unload("nosuch"), "NOT_FOUND", "nosuch"),
        ]
        for call, code, fragment in cases:
            with self.subTest(code=code, fragment=fragment):
                with self.assertRaises(attnserve.AttnserveError) as caught:
                    call()
                e = caught.exception
                self.assertEqual(e.code_name, code, e.details)
                self.assertIn(fragment, e.details)
                self.assertTrue(str(e).split(": ")[1] == code, str(e))
        nan = self.random(1, 3, D)
        nan[0, 1, 2] = np.nan
        with self.assertRaises(attnserve.AttnserveError) as caught:
            self.client.forward("small", nan)
        self.assertEqual(caught.exception.code_name, "INVALID_ARGUMENT")
        self.assertIn("[0, 1, 2]", caught.exception.details)
        # Refused before anything is sent: the argument is named, with expected and got.
        with self.assertRaisesRegex(TypeError, r"x: expected a float32.*got dtype int64"):
            self.client.forward("small", np.ones((1, 2, D), np.int64))
        with self.assertRaisesRegex(ValueError, r"form: expected one of factored, summed, lowrank.*got 'sum'"):
            self.client.forward("small", self.random(1, 2, D), form="sum")
        with self.assertRaisesRegex(ValueError, r"x: expected 3 dimensions.*got shape \[64\]"):
            self.client.forward("small", self.random(D))

    def test_health_and_deadline(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("attnserve.v1.AttentionService"), "SERVING")
        with self.assertRaises(attnserve.AttnserveError) as caught:
            self.client.health("no.such.Service")
        self.assertEqual(caught.exception.code_name, "NOT_FOUND")
        # 1 ms for a request of 2048 tokens (17 M attention scores): the client's deadline ends it.
        with attnserve.Client(f"127.0.0.1:{self.server.port}", timeout=1e-3) as hasty:
            with self.assertRaises(attnserve.AttnserveError) as caught:
                hasty.forward("small", self.random(1, 2048, D))
            self.assertEqual(caught.exception.code_name, "DEADLINE_EXCEEDED")

    def test_readme_example_script_runs(self):
        script = os.path.join(SOURCE_DIR, "client", "python", "examples", "quickstart.py")
        out = subprocess.run([sys.executable, script, f"127.0.0.1:{self.server.port}", "demo"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PYTHONPATH=SITE))
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("health: SERVING", out.stdout)
        self.assertRegex(out.stdout, r"forward: \(2, 16, 64\) float32 by the summed form")
        self.assertRegex(out.stdout, r"compare: summed vs factored: max_abs [0-9.e-]+, rel_l2")
        self.assertRegex(out.stdout, r"error: INVALID_ARGUMENT - input.shape\[2\] \(d_model\)")
        self.assertIn("OV stable rank per head:", out.stdout)


def make_pki(directory):
    """A throwaway CA, a server certificate for the name 'attnserve' and a client certificate."""
    def openssl(*args):
        out = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError(f"openssl {' '.join(args)}: {out.stderr}")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        with open(os.path.join(directory, f"{name}.cnf"), "w") as f:
            f.write(f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\nsubjectAltName=DNS:attnserve\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.cnf")


@unittest.skipIf(shutil.which("openssl") is None, "no openssl to make test certificates")
class ClientOverTls(unittest.TestCase):
    def test_mtls(self):
        pki = tempfile.mkdtemp(prefix="pki-", dir=WORK.name)
        make_pki(pki)
        p = lambda name: os.path.join(pki, name)  # noqa: E731
        server = Server("--layer", f"small={SOURCE}", "--tls-cert", p("server.crt"), "--tls-key", p("server.key"),
                        "--tls-client-ca", p("ca.crt"))
        target = f"127.0.0.1:{server.port}"
        x = np.random.default_rng(SEED).standard_normal((1, 5, D)).astype(np.float32)
        try:
            with attnserve.Client(target, root_certificates=p("ca.crt"), certificate_chain=p("client.crt"),
                                  private_key=p("client.key"), server_name="attnserve") as client:
                self.assertEqual(client.health(), "SERVING")
                self.assertLess(rel_l2(client.forward("small", x).output, reference(x)), 1e-5)
            with open(p("ca.crt"), "rb") as f:
                ca_bytes = f.read()
            refused = [
                ("no client certificate", dict(root_certificates=ca_bytes, server_name="attnserve")),
                ("plaintext", {}),
                ("a name the certificate lacks", dict(root_certificates=ca_bytes, certificate_chain=p("client.crt"),
                                                      private_key=p("client.key"), server_name="other")),
            ]
            for what, kwargs in refused:
                with self.subTest(what):
                    with attnserve.Client(target, timeout=10, **kwargs) as client:
                        with self.assertRaises(attnserve.AttnserveError) as caught:
                            client.forward("small", x)
                        self.assertEqual(caught.exception.code_name, "UNAVAILABLE", str(caught.exception))
            with self.assertRaisesRegex(ValueError, "certificate_chain, private_key: a client certificate needs both"):
                attnserve.Client(target, root_certificates=ca_bytes, certificate_chain=p("client.crt"))
            with self.assertRaisesRegex(ValueError, "root_certificates: cannot read"):
                attnserve.Client(target, root_certificates=p("missing.crt"))
        finally:
            server.stop()


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        WORK.cleanup()
