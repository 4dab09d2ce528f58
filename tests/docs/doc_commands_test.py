#!/usr/bin/python3
"""The commands the docs tell a user to type, run as written against the real server.

- README.md, "Run": the server as scripts/serve starts it (its `exec` line's flags: the loopback
  admin listener and the model dir), then every line of the "Try it" block with attnserve-cli,
  each of which must exit 0 (a `# WORD` comment in capitals is also the output expected).
- docs/service.md, "Try it": each `$ ` command, its output compared with the lines the doc shows
  under it: error messages exactly, numbers within 1e-4, timings (queue_us, compute_us, ...) and
  byte counts (which the CPU's weight layout sets) left out; the server must exit 0 at `kill`.
- The Python client's example script, as the README names it, exists (tests/python_client runs it).

Ports in the docs (50051, 50052) become ephemeral ones; $PWD is the source tree.
Environment: ATTNSERVE_BINARY, ATTNSERVE_CLI_BINARY, ATTNSERVE_SOURCE_DIR.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import unittest

SOURCE_DIR = os.environ["ATTNSERVE_SOURCE_DIR"]
BINARY = os.environ["ATTNSERVE_BINARY"]
CLI = os.environ["ATTNSERVE_CLI_BINARY"]
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "tools"))
from harness import die_with_parent, read  # noqa: E402

# Lines of attnserve-cli's output that are timings or depend on the machine's weight layout.
VARIABLE_KEYS = ("queue_us", "decode_us", "compute_us", "encode_us", "client_ms", "batch_requests")


def doc(path):
    with open(os.path.join(SOURCE_DIR, path)) as f:
        return f.read()


def code_block_after(text, marker):
    """The lines of the first ``` block after the line containing `marker`."""
    start = text.index(marker)
    begin = text.index("```", start)
    begin = text.index("\n", begin) + 1
    return text[begin:text.index("```", begin)].rstrip("\n").split("\n")


class Server:
    """attnserve with `args`, its --listen and --admin-listen on ephemeral loopback ports."""

    def __init__(self, args):
        self.dir = tempfile.TemporaryDirectory(prefix="attnserve-docs-")
        d = self.dir.name
        args = [a.replace("$PWD", SOURCE_DIR) for a in args]
        args = self.override(args, "--listen", "127.0.0.1:0")
        args = self.override(args, "--admin-listen", "127.0.0.1:0") if "--admin-listen" in args else args
        self.log_path = os.path.join(d, "log")
        with open(self.log_path, "w") as log:
            admin = ["--admin-port-file", f"{d}/admin"] if "--admin-listen" in args else []
            self.proc = subprocess.Popen([BINARY, *args, "--port-file", f"{d}/port", *admin,
                                          "--metrics-listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=log,
                                         text=True, preexec_fn=die_with_parent)
        self.first_line = self.proc.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{d}/port"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"attnserve {args} did not start:\n{read(self.log_path)}")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{read(f'{d}/port').strip()}"
        self.admin = f"127.0.0.1:{read(f'{d}/admin').strip()}" if os.path.exists(f"{d}/admin") else None

    @staticmethod
    def override(args, flag, value):
        out, i = [], 0
        while i < len(args):
            if args[i] == flag:
                out += [flag, value]
                i += 2
            elif args[i].startswith(flag + "="):
                out.append(f"{flag}={value}")
                i += 1
            else:
                out.append(args[i])
                i += 1
        if flag not in out and not any(a.startswith(flag + "=") for a in out):
            out += [flag, value]
        return out

    def stop(self):
        self.proc.stdout.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()
        return self.proc.returncode


def normalise(text):
    """attnserve-cli output without timings and byte counts, one entry per line."""
    lines = []
    for line in text.strip().split("\n"):
        if line.split(":")[0].strip() in VARIABLE_KEYS:
            continue
        lines.append(re.sub(r"bytes=\d+", "bytes=N", line).rstrip())
    return lines


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same_line(got, want):
    """Equal, except numbers within 1e-4 (relative) or 1e-5 (absolute); divergences below 1e-4."""
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    if got.startswith("divergence:"):
        return all(float(v) < 1e-4 for v in re.findall(r"=([-\d.e+]+)", got))
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want)):
        g, w = float(g), float(w)
        if abs(g - w) > max(1e-5, 1e-4 * abs(w)):
            return False
    return True


class ReadmeTryIt(unittest.TestCase):
    def test_run_and_try_it(self):
        readme = doc("README.md")
        serve = doc("scripts/serve")
        exec_line = next(line for line in serve.split("\n") if line.startswith("exec build/server/attnserve"))
        flags = [f for f in shlex.split(exec_line)[2:] if f != "$@"]
        self.assertIn("--admin-listen", flags, "scripts/serve's admin listener (the README's load command uses it)")
        run_block = code_block_after(readme, "## Run")
        self.assertTrue(any(line.startswith("scripts/serve") for line in run_block), run_block)
        commands = [line.split(" #")[0].strip() for line in code_block_after(readme, "Try it from another shell")]
        self.assertGreaterEqual(len(commands), 5)
        server = Server(flags)
        try:
            with tempfile.TemporaryDirectory(prefix="attnserve-docs-cwd-") as cwd:
                for line, full in zip(commands, code_block_after(readme, "Try it from another shell")):
                    with self.subTest(command=line):
                        argv = shlex.split(line)
                        self.assertEqual(argv[0], "attnserve-cli")
                        ports = {"localhost:50052": server.admin, "localhost:50051": server.target}
                        argv = [CLI] + [re.sub("localhost:5005[12]", lambda m: ports[m.group(0)], a) for a in argv[1:]]
                        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd,
                                             env=dict(os.environ, ATTNSERVE_TARGET=server.target))
                        self.assertEqual(out.returncode, 0, f"{line}\n{out.stdout}{out.stderr}")
                        comment = full.partition(" #")[2].strip()
                        if re.fullmatch(r"[A-Z_]+", comment):
                            self.assertEqual(out.stdout.strip(), comment)
        finally:
            self.assertEqual(server.stop(), 0)

    def test_python_example_is_there(self):
        readme = doc("README.md")
        paths = set(re.findall(r"client/python/examples/\w+\.py", readme))
        self.assertTrue(paths, "the README shows the Python client's example script")
        for p in paths:
            self.assertTrue(os.path.exists(os.path.join(SOURCE_DIR, p)), p)


class ServiceTryIt(unittest.TestCase):
    def test_session(self):
        block = code_block_after(doc("docs/service.md"), "## Try it")
        steps, current = [], None
        for line in block:
            if line.startswith("$ "):
                current = [line[2:].split("  #")[0].strip(), []]
                steps.append(current)
            else:
                current[1].append(line)
        start, expected = steps[0]
        argv = shlex.split(start.rstrip("&").strip())
        self.assertEqual(argv[0], "attnserve")
        server = Server(argv[1:])
        exited = None
        try:
            self.assertTrue(server.first_line.startswith("listening on 127.0.0.1:"), server.first_line)
            self.assertEqual([re.sub(r":\d+$", ":PORT", e) for e in expected], ["listening on 127.0.0.1:PORT"])
            for command, want in steps[1:]:
                with self.subTest(command=command):
                    argv = shlex.split(command)
                    if argv[0] == "export":
                        continue  # ATTNSERVE_TARGET: set for every command below
                    if argv[0] == "kill":
                        exited = server.stop()
                        continue
                    self.assertEqual(argv[0], "attnserve-cli")
                    argv = [CLI] + [a.replace("127.0.0.1:50052", server.admin) for a in argv[1:]]
                    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=SOURCE_DIR,
                                         env=dict(os.environ, ATTNSERVE_TARGET=server.target))
                    got = normalise(out.stdout + out.stderr)
                    want = normalise("\n".join(want))
                    failed = bool(want) and want[0].startswith("error:")
                    self.assertEqual(out.returncode != 0, failed, f"{command}\n{out.stdout}{out.stderr}")
                    self.assertEqual(len(got), len(want), f"{command}: got\n" + "\n".join(got))
                    for g, w in zip(got, want):
                        self.assertTrue(same_line(g, w), f"{command}:\n got: {g}\nwant: {w}")
        finally:
            if exited is None:
                exited = server.stop()
        self.assertEqual(exited, 0, "the server exits 0 on SIGTERM")


class ServiceHttpTryIt(unittest.TestCase):
    """The block after the line "Try it over HTTP" in docs/service.md: the server line, then each curl command as written
    (its port the server's); the readiness answer and the infer answer as the doc says."""

    def test_curl_commands(self):
        block = code_block_after(doc("docs/service.md"), "Try it over HTTP")
        commands, joined = [], ""
        for line in block:  # shell continuation lines joined
            joined += line[:-1] if line.endswith("\\") else line
            if not line.endswith("\\"):
                commands.append(joined.strip())
                joined = ""
        argv = shlex.split(commands[0].rstrip("&").strip())
        self.assertEqual(argv[0], "attnserve")
        http_listen = argv[argv.index("--http-listen") + 1]
        port_file = tempfile.NamedTemporaryFile(prefix="attnserve-docs-http-", delete=False).name
        os.unlink(port_file)
        server = Server(Server.override(argv[1:], "--http-listen", "127.0.0.1:0") + ["--http-port-file", port_file])
        try:
            port = read(port_file).strip()
            outputs = []
            for command in commands[1:]:
                self.assertTrue(command.startswith("curl "), command)
                command = command.replace(http_listen.replace("127.0.0.1", "localhost"), f"localhost:{port}")
                out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
                self.assertEqual(out.returncode, 0, f"{command}\n{out.stderr}")
                outputs.append(json.loads(out.stdout))
            self.assertEqual(outputs[0], {"ready": True})
            answer = outputs[1]
            self.assertEqual((answer["model_name"], answer["model_version"]), ("tiny", "1"))
            self.assertEqual(answer["parameters"]["form"], "summed")
            (y,) = answer["outputs"]
            self.assertEqual((y["name"], y["datatype"], y["shape"]), ("y", "FP32", [1, 2, 4]))
            self.assertEqual(len(y["data"]), 8)
            self.assertTrue(all(isinstance(v, float) for v in y["data"]))
        finally:
            self.assertEqual(server.stop(), 0, "the server exits 0 on SIGTERM")
            if os.path.exists(port_file):
                os.unlink(port_file)


if __name__ == "__main__":
    unittest.main(verbosity=2)
