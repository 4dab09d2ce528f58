#!/usr/bin/python3
"""Checks of the deployment files against the real binaries (label "deploy" in CTest).

No Docker engine or Kubernetes cluster runs here, so what can be checked without one is:
  Dockerfile   every RUN step calls a repository script, and this test runs each of those calls
               in a dry form (scripts/setup --dry-run, scripts/build --configure-only in a copy
               of the build context that .dockerignore leaves, scripts/runtime-packages on the
               built binaries); the runtime stages' user, ports, health check, stop signal and
               entrypoint flags against `attnserve --help` and `attnserve-cli --help`.
  compose      flags, ports (published on 127.0.0.1 only), grace period, mounted files,
               Prometheus's scrape target and Grafana's data source, and the real server started
               with the compose command: it serves, and refuses admin calls without a token.
  Kubernetes   the kustomizations rendered (by a small renderer here; compared with `kubectl
               kustomize` where kubectl exists), flags, ports, gRPC probes, grace period vs the
               drain, resources, selectors, security contexts, the NetworkPolicy, in the base and
               every overlay; the admin overlay's Secret; the tls overlay's certificate, mounts
               and exec probes; and the real server started with the ConfigMap (admin calls
               refused, then allowed with the admin overlay's token) and with the tls overlay's
               flags on a throwaway CA, its probe commands run against it.
  alerts       deploy/prometheus/rules.yaml: `promtool check rules`, `promtool test rules` on
               rules_test.yaml (each alert fires on the series built to fire it, and only there),
               the Kubernetes PrometheusRule holding the same groups, and Prometheus's config
               (compose and image) loading the file.

Run by CTest with ATTNSERVE_SOURCE_DIR, ATTNSERVE_BUILD_DIR, ATTNSERVE_BINARY and
ATTNSERVE_CLI_BINARY set; `deploy_test.py ClassName` runs one group. Debian's /usr/bin/python3
with python3-yaml (scripts/setup installs it).
"""

import contextlib
import copy
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import yaml

SRC = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD_DIR = os.environ.get("ATTNSERVE_BUILD_DIR", os.path.join(SRC, "build"))
BINARY = os.environ.get("ATTNSERVE_BINARY", os.path.join(BUILD_DIR, "server", "attnserve"))
CLI = os.environ.get("ATTNSERVE_CLI_BINARY", os.path.join(BUILD_DIR, "client", "attnserve-cli"))
DEPLOY = os.path.join(SRC, "deploy")
GRPC_HEALTH_SERVICES = ("", "attnserve.v1.AttentionService")


# ---------------------------------------------------------------------------------------------
# The binaries' flags


def parse_help(text):
    """{'--flag': default or None} from a --help text: entries start with two spaces and '-'."""
    flags, current = {}, None
    entries = []
    for line in text.splitlines():
        m = re.match(r"^ {2,4}(-{1,2}[A-Za-z0-9][A-Za-z0-9-]*)((?:, -{1,2}[A-Za-z0-9-]+)*)(.*)$", line)
        if m:
            names = [m.group(1)] + re.findall(r"-{1,2}[A-Za-z0-9-]+", m.group(2))
            current = [names, m.group(3)]
            entries.append(current)
        elif current is not None and line.startswith("      ") and line.strip():
            current[1] += " " + line.strip()
        else:
            current = None
    for names, text in entries:
        d = re.search(r"\(default ([^)\s;,]+)", text)
        for n in names:
            flags[n] = d.group(1) if d else None
    return flags


_help_cache = {}


def help_flags(binary):
    if binary not in _help_cache:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise AssertionError(f"{binary} --help exited {out.returncode}: {out.stderr}")
        _help_cache[binary] = parse_help(out.stdout)
    return _help_cache[binary]


def server_flags():
    return help_flags(BINARY)


def flag_names(args):
    """The --names in an argument list (values may follow as '--x=v' or '--x v')."""
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and not re.match(r"^-\d", a)]


def flag_value(args, name, default=None):
    """The last value of flag `name` in args ('--x=v' or '--x v')."""
    value = default
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1 :]
    return value


def port_of(addr):
    return int(str(addr).rsplit(":", 1)[1])


def default_of(flag):
    flags = server_flags()
    if flag not in flags:
        raise AssertionError(f"attnserve --help has no {flag} (flags: {sorted(flags)})")
    if flags[flag] is None:
        raise AssertionError(f"attnserve --help gives no '(default ...)' for {flag}")
    return flags[flag]


def assert_flags_exist(test, args, binary, where):
    known = help_flags(binary)
    missing = [f for f in flag_names(args) if f not in known]
    test.assertEqual(
        missing, [], f"{where} passes flags that `{os.path.basename(binary)} --help` does not list: {missing}"
    )


# ---------------------------------------------------------------------------------------------
# Running the real server briefly


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra):
    """The environment of a server or CLI child: this process's, without the variables that would
    change what is under test (an admin token, a default target), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNSERVE_ADMIN_TOKEN", "ATTNSERVE_TARGET")}
    env.update(extra)
    return env


@contextlib.contextmanager
def running_server(test, args, what, env=None, check_health=True):
    """Starts attnserve with `args` on loopback (listen addresses overridden) and yields its
    target once it has printed 'listening on'. With check_health, it must answer SERVING over
    plaintext first. On leaving: SIGTERM, and exit 0 expected."""
    full = [BINARY] + list(args) + ["--listen=127.0.0.1:0"]
    if "--metrics-listen" in server_flags():
        full.append(f"--metrics-listen=127.0.0.1:{free_port()}")
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=child_env() if env is None else env)
        try:
            line, deadline = "", time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    line = proc.stdout.readline()
                    break
            if not line.startswith("listening on "):
                proc.kill()
                proc.wait()
                err.seek(0)
                test.fail(f"{what}: the server did not start ({shlex.join(full)}); exit {proc.returncode}:\n{err.read()}")
            target = line.split()[-1]
            if check_health:
                health = cli(target, "health")
                test.assertEqual(health.stdout.strip(), "SERVING", f"{what}: health: {health.stdout} {health.stderr}")
            yield target
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
            err.seek(0)
            test.assertEqual(rc, 0, f"{what}: exit status after SIGTERM; log:\n{err.read()}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def start_and_stop_server(test, args, what):
    """Starts attnserve with `args` on loopback (listen addresses overridden), checks that it
    comes up and answers SERVING, sends SIGTERM and expects exit 0."""
    with running_server(test, args, what):
        pass


def cli(target, *args, global_flags=()):
    """attnserve-cli [global flags] --target TARGET ARGS..., without $ATTNSERVE_ADMIN_TOKEN."""
    return subprocess.run([CLI, "--target", target, "--timeout-ms", "10000", *global_flags, *args],
                          capture_output=True, text=True, timeout=60, env=child_env())


# A layer small enough to load in a moment; what the admin checks load.
ADMIN_PROBE_LOAD = ("load", "probe", "random:d_model=8,heads=1")


def check_admin_api(test, closed_args, open_args, token_variable, what):
    """The admin API on the public listener: closed (PERMISSION_DENIED, naming --admin-token) when
    the server runs with `closed_args` and no token; with `open_args` and a 32-hex-digit token in
    the environment variable `token_variable`, refused without the token or with a wrong one
    (UNAUTHENTICATED) and allowed with it (attnserve-cli --admin-token)."""
    with running_server(test, closed_args, f"{what}, no admin token") as target:
        out = cli(target, *ADMIN_PROBE_LOAD)
        test.assertNotEqual(out.returncode, 0, f"{what}: a load without any admin token configured succeeded:\n"
                                                f"{out.stdout}")
        test.assertIn("PERMISSION_DENIED", out.stderr, f"{what}: the admin API must be closed without a token")
        test.assertIn("--admin-token", out.stderr, f"{what}: the refusal should say how to open the admin API")
        listed = cli(target, "layers")
        test.assertEqual(listed.returncode, 0, listed.stderr)
        test.assertNotIn("probe", listed.stdout, f"{what}: the refused load loaded the layer anyway")
    token = secrets.token_hex(16)
    env = child_env(**{token_variable: token})
    with running_server(test, open_args, f"{what}, admin token from ${token_variable}", env=env) as target:
        for flags, case in (((), "no token"), (("--admin-token", secrets.token_hex(16)), "a wrong token")):
            out = cli(target, *ADMIN_PROBE_LOAD, global_flags=flags)
            test.assertNotEqual(out.returncode, 0, f"{what}: a load with {case} succeeded")
            test.assertIn("UNAUTHENTICATED", out.stderr, f"{what}: a load with {case}")
        out = cli(target, *ADMIN_PROBE_LOAD, global_flags=("--admin-token", token))
        test.assertEqual(out.returncode, 0, f"{what}: a load with the token failed:\n{out.stderr}")
        test.assertIn("probe", out.stdout)


# ---------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore


class Stage:
    def __init__(self, base, name):
        self.base, self.name = base, name
        self.instructions = []  # (KEYWORD, rest)

    def all(self, keyword):
        return [rest for k, rest in self.instructions if k == keyword]

    def last(self, keyword):
        found = self.all(keyword)
        return found[-1] if found else None


def substitute(text, variables):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), ""), text)


class Stages(list):
    """The stages of a Dockerfile, in order, with `global_args`: the ARG defaults before the first
    FROM (substituted into FROM lines)."""

    global_args = {}


def parse_dockerfile(path):
    """Stages in order; global ARG defaults substituted into FROM lines."""
    logical, buf = [], ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if re.match(r"^\s*#", line):
                continue  # comments, also inside continuations
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            if buf.strip():
                logical.append(buf.strip())
            buf = ""
    global_args, stages = {}, Stages()
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, value = rest.partition("=")
            global_args[name] = substitute(value, global_args)
        elif keyword == "FROM":
            words = substitute(rest, global_args).split()
            words = [w for w in words if not w.startswith("--platform")]
            stages.append(Stage(words[0], words[2] if len(words) >= 3 and words[1].upper() == "AS" else None))
        else:
            stages[-1].instructions.append((keyword, rest))
    stages.global_args = global_args
    return stages


def exec_form(text):
    text = text.strip()
    return json.loads(text) if text.startswith("[") else ["/bin/sh", "-c", text]


def split_options(text):
    """('--opt=value' options, remainder) of a RUN/COPY/HEALTHCHECK argument string."""
    options = []
    rest = text.strip()
    while rest.startswith("--"):
        opt, _, rest = rest.partition(" ")
        options.append(opt)
        rest = rest.strip()
    return options, rest


def mount_options(options):
    mounts = []
    for opt in options:
        if opt.startswith("--mount="):
            mounts.append(dict(kv.split("=", 1) for kv in opt[len("--mount=") :].split(",")))
    return mounts


def shell_commands(script):
    """A RUN's shell form split into simple commands: [(argv, stdout_redirect or None)]."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    commands, argv, redirect, expect_target = [], [], None, False
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append((argv, redirect))
            argv, redirect = [], None
        elif token in (">", ">>"):
            expect_target = True
        elif expect_target:
            redirect, expect_target = token, False
        else:
            argv.append(token)
    if argv:
        commands.append((argv, redirect))
    return commands


def dockerignore_patterns():
    patterns = []
    with open(os.path.join(SRC, ".dockerignore")) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            p = os.path.normpath(line.lstrip("!").lstrip("/"))
            patterns.append((negate, glob_regex(p)))
    return patterns


def glob_regex(pattern):
    """Docker's .dockerignore syntax: '*' and '?' stay within a path element, '**' crosses them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile("^" + out + "$")


def docker_excludes(path, patterns):
    """Whether the build context leaves `path` (relative) out: a pattern that matches the path or
    one of its parent folders excludes it; the last matching pattern decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, rx in patterns:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def context_files():
    """The files of a clean checkout that the Docker build context keeps."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=SRC, capture_output=True, text=True, check=True).stdout
    patterns = dockerignore_patterns()
    return [p for p in out.split("\0") if p and os.path.exists(os.path.join(SRC, p)) and not docker_excludes(p, patterns)]


def have_nvcc():
    return bool(shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"))


def apt_closure(packages):
    """Every package `packages` depend on, recursively (Depends and Pre-Depends)."""
    out = subprocess.run(
        ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
         "--no-replaces", "--no-enhances"] + list(packages),
        capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        m = re.match(r"^\s*(?:\|?(?:Pre)?Depends:\s*)?<?([a-z0-9][a-z0-9.+-]*)(?::\w+)?>?\s*$", line)
        if m:
            names.add(m.group(1))
    return names


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stages = parse_dockerfile(os.path.join(SRC, "Dockerfile"))
        cls.by_name = {s.name: s for s in cls.stages}
        cls.grpc_port = port_of(default_of("--listen"))
        cls.metrics_port = port_of(default_of("--metrics-listen")) if "--metrics-listen" in server_flags() else None

    def runtime_stages(self):
        return [s for s in self.stages if s.last("ENTRYPOINT")]

    def build_stage_of(self, stage):
        sources = {dict(o.split("=", 1) for o in split_options(c)[0] if "=" in o).get("--from") for c in stage.all("COPY")}
        sources.discard(None)
        self.assertEqual(len(sources), 1, f"stage {stage.name} copies from {sources}")
        return self.by_name[sources.pop()]

    def test_stages_and_bases(self):
        self.assertEqual(self.stages[-1].name, "runtime", "the default target (the last stage) is the CPU runtime")
        bases = {s.name: s.base for s in self.stages}
        self.assertEqual(bases.get("build"), "debian:bookworm")
        self.assertEqual(bases.get("runtime"), "debian:bookworm-slim")
        self.assertRegex(bases.get("cuda-build", ""), r"^nvidia/cuda:[\d.]+-devel-")
        self.assertRegex(bases.get("cuda", ""), r"^nvidia/cuda:[\d.]+-runtime-")
        # Runtime and devel of the same CUDA release and distribution.
        self.assertEqual(bases["cuda-build"].replace("-devel-", "-"), bases["cuda"].replace("-runtime-", "-"))

    def depends_on(self, stage):
        """The stages a stage needs (FROM another stage, COPY --from, RUN --mount from=), itself
        included: what BuildKit builds for --target stage."""
        needed, todo = set(), [stage.name]
        while todo:
            name = todo.pop()
            if name in needed:
                continue
            needed.add(name)
            s = self.by_name[name]
            refs = {s.base}
            for keyword, rest in s.instructions:
                opts = split_options(rest)[0]
                refs |= {o.split("=", 1)[1] for o in opts if o.startswith("--from=")}
                refs |= {m["from"] for m in mount_options(opts) if "from" in m}
            todo += [r for r in refs if r in self.by_name]
        return needed

    def test_cpu_and_cuda_targets_are_independent(self):
        """The default target (the CPU runtime) builds without any CUDA stage or image, and the
        CUDA image without the CPU stages; no `# syntax=` line (the engine's built-in frontend:
        nothing to pull, so the build works offline)."""
        self.assertEqual(self.depends_on(self.by_name["runtime"]), {"runtime", "build"})
        self.assertEqual(self.depends_on(self.by_name["cuda"]), {"cuda", "cuda-build"})
        for name in ("runtime", "build"):
            self.assertNotIn("cuda", self.by_name[name].base)
        with open(os.path.join(SRC, "Dockerfile")) as f:
            text = f.read()
        self.assertNotRegex(text, r"(?im)^#\s*syntax\s*=", "a syntax directive pulls a frontend image")

    def test_oci_labels(self):
        """Both runtime images carry the OCI labels: version = CMakeLists.txt's project version,
        revision from a build argument, source, licenses. The ARGs they use are declared after
        the RUN steps, so a new revision rebuilds no layer."""
        with open(os.path.join(SRC, "CMakeLists.txt")) as f:
            version = re.search(r"project\(attnserve VERSION ([\d.]+)", f.read()).group(1)
        for stage in self.runtime_stages():
            with self.subTest(stage=stage.name):
                labels = {}
                for rest in stage.all("LABEL"):
                    for kv in shlex.split(rest):
                        k, _, v = kv.partition("=")
                        labels[k] = v
                for key in ("version", "revision", "source", "licenses"):
                    self.assertIn(f"org.opencontainers.image.{key}", labels)
                values = {k: substitute(v, self.stages.global_args) for k, v in labels.items()}
                self.assertEqual(values["org.opencontainers.image.version"], version)
                self.assertEqual(labels["org.opencontainers.image.revision"], "${ATTNSERVE_REVISION}")
                keywords = [k for k, _ in stage.instructions]
                last_run = max(i for i, k in enumerate(keywords) if k == "RUN")
                for i, (keyword, rest) in enumerate(stage.instructions):
                    if keyword == "ARG" and rest.startswith("ATTNSERVE_REVISION"):
                        self.assertGreater(i, last_run, "ARG ATTNSERVE_REVISION before a RUN: each commit rebuilds it")

    def test_scripts_test_runs_the_same_scripts(self):
        """CI (scripts/test) runs scripts/setup and scripts/build: the build stages' steps."""
        with open(os.path.join(SRC, "scripts", "test")) as f:
            text = f.read()
        self.assertRegex(text, r"(?m)^\s*scripts/setup\s*$")
        self.assertRegex(text, r"(?m)^\s*scripts/build\s+build\b")

    def resolve_script(self, stage, argv0, mounts, available):
        """The repository script a RUN command calls, or None. `available`: the context paths the
        stage's COPY steps have brought to the same place under its WORKDIR so far."""
        for m in mounts:
            if m.get("type") != "bind" or "from" in m:
                continue
            target = m["target"].rstrip("/")
            if argv0 == target:  # a single file bound
                return os.path.normpath(m.get("source", "."))
            if argv0.startswith(target + "/"):
                return os.path.normpath(os.path.join(m.get("source", "."), argv0[len(target) + 1 :]))
        path = os.path.normpath(argv0)
        if path.startswith("scripts/") and any(a == "." or path == a or path.startswith(a + "/") for a in available):
            return path
        return None

    def context_copies(self, stage):
        """[(instruction index, [context path])] of the stage's COPY steps from the build context
        (no --from). Each must put its sources at the same relative place under the WORKDIR
        (COPY server/ server/, COPY scripts/build scripts/runtime-packages scripts/), so that a
        path in a RUN step is the repository's path."""
        copies = []
        for index, (keyword, rest) in enumerate(stage.instructions):
            if keyword != "COPY":
                continue
            opts, paths = split_options(rest)
            if any(o.startswith("--from") for o in opts):
                continue
            *srcs, dest = paths.split()
            if dest.startswith("/"):
                copies.append((index, []))  # into a system folder (the runtime stages' scripts)
                continue
            placed = []
            for src in srcs:
                if os.path.isdir(os.path.join(SRC, src)) or src.rstrip("/") == ".":
                    where = dest
                else:
                    where = os.path.join(dest, os.path.basename(src)) if dest.endswith("/") or len(srcs) > 1 else dest
                self.assertEqual(os.path.normpath(where), os.path.normpath(src),
                                 f"stage {stage.name}: COPY {paths} puts {src} elsewhere than its repository path")
                placed.append(os.path.normpath(src))
            copies.append((index, placed))
        return copies

    def run_steps(self):
        """[(stage, script, args, redirect, mounts)] for every command of every RUN step."""
        steps = []
        for stage in self.stages:
            copies = dict(self.context_copies(stage))
            available = []
            for index, (keyword, rest) in enumerate(stage.instructions):
                available += copies.get(index, [])
                if keyword != "RUN":
                    continue
                opts, script = split_options(rest)
                mounts = mount_options(opts)
                for argv, redirect in shell_commands(script):
                    path = self.resolve_script(stage, argv[0], mounts, available)
                    self.assertIsNotNone(path, f"stage {stage.name}: RUN calls '{argv[0]}', not a script of scripts/ "
                                               f"that is in the image at that point (keep RUN steps to tested scripts)")
                    steps.append((stage, path, argv[1:], redirect, mounts))
        return steps

    def test_run_steps_call_existing_executable_scripts(self):
        steps = self.run_steps()
        self.assertTrue(steps)
        tracked = set(subprocess.run(["git", "ls-files", "scripts"], cwd=SRC, capture_output=True, text=True).stdout.split())
        untracked = set(subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "scripts"], cwd=SRC,
                                       capture_output=True, text=True).stdout.split())
        for stage, path, _, _, _ in steps:
            full = os.path.join(SRC, path)
            self.assertTrue(os.path.isfile(full), f"stage {stage.name}: {path} does not exist")
            self.assertTrue(os.access(full, os.X_OK), f"stage {stage.name}: {path} is not executable")
            self.assertIn(path, tracked | untracked, f"{path} is ignored by git, so a clean checkout lacks it")
            self.assertIn(os.path.basename(path), ("setup", "build", "runtime-packages"),
                          f"{path}: this test has no dry run for it; add one before the Dockerfile calls it")

    def local_binary(self, image_path, build_dirs):
        """The file of the local build tree that corresponds to a path in a build stage."""
        for d in build_dirs:
            if image_path.startswith(d.rstrip("/") + "/"):
                return os.path.join(BUILD_DIR, image_path[len(d.rstrip("/")) + 1 :])
        self.fail(f"{image_path} is not under a scripts/build folder of its stage ({build_dirs})")

    def built_here(self, path):
        """Whether the local tree has this build output. The CUDA plugin exists only where a CUDA
        toolkit was found; elsewhere its absence is noted, not failed."""
        if os.path.exists(path):
            return True
        if os.path.basename(path) == "libattnserve_cuda.so" and not have_nvcc():
            print(f"note: no nvcc here, so no {path} to check", file=sys.stderr)
            return False
        self.fail(f"{path} does not exist: the Dockerfile copies or inspects a file the build does not make")

    def test_run_steps_dry_run(self):
        """Each scripts/setup call with --dry-run, each scripts/runtime-packages call on the
        local binaries. (scripts/build: test_build_configures_in_the_image_context.)"""
        produced = {}  # (stage, path) -> local file with what the step would write
        with tempfile.TemporaryDirectory() as tmp:
            for stage, path, args, redirect, mounts in self.run_steps():
                name = os.path.basename(path)
                if name == "build":
                    continue
                if name == "runtime-packages":
                    build_dirs = [a[0] for s, p, a, _, _ in self.run_steps() if s is stage and p.endswith("build")]
                    binaries = [self.local_binary(a, build_dirs) for a in args if not a.startswith("--")]
                    binaries = [b for b in binaries if self.built_here(b)]
                    # --skip-unowned: a local tree may link a CUDA toolkit installed without dpkg.
                    out = subprocess.run([os.path.join(SRC, path), "--skip-unowned"] + binaries,
                                         capture_output=True, text=True, timeout=120)
                    self.assertEqual(out.returncode, 0, f"{path} {binaries}: {out.stderr}")
                    self.assertIn("libgrpc++1.51", out.stdout.split(), out.stdout)
                    self.assertIsNotNone(redirect, f"stage {stage.name}: {path} must write its list to a file")
                    local = os.path.join(tmp, f"{stage.name}-{os.path.basename(redirect)}")
                    with open(local, "w") as f:
                        f.write(out.stdout)
                    produced[(stage.name, redirect)] = local
                    continue
                # scripts/setup: files from other stages' mounts are replaced by their local equivalent.
                local_args = []
                for a in args:
                    for m in mounts:
                        if m.get("type") == "bind" and "from" in m and a == m["target"]:
                            key = (m["from"], m["source"])
                            self.assertIn(key, produced, f"{a} comes from stage {m['from']}, which writes no {m['source']}")
                            a = produced[key]
                    local_args.append(a)
                out = subprocess.run([os.path.join(SRC, path)] + local_args + ["--dry-run"],
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(out.returncode, 0, f"{path} {' '.join(args)} --dry-run: {out.stdout}{out.stderr}")

    def test_runtime_packages_cover_the_binaries(self):
        """Every library the built binaries load comes with `scripts/setup --runtime`."""
        listed = subprocess.run([os.path.join(SRC, "scripts", "setup"), "--runtime", "--dry-run"],
                                capture_output=True, text=True, check=True).stdout.split()
        needed = subprocess.run([os.path.join(SRC, "scripts", "runtime-packages"), "--skip-unowned", BINARY, CLI],
                                capture_output=True, text=True, check=True).stdout.split()
        closure = apt_closure(listed)
        self.assertEqual(sorted(set(needed) - closure), [],
                         f"packages the binaries need that scripts/setup --runtime ({listed}) does not bring")

    def copied_before_build(self, stage):
        """The context paths the stage's COPY steps bring before its scripts/build step."""
        copies = dict(self.context_copies(stage))
        available = []
        for index, (keyword, rest) in enumerate(stage.instructions):
            if keyword == "RUN" and "scripts/build" in rest:
                return available
            available += copies.get(index, [])
        self.fail(f"stage {stage.name} has no scripts/build step")

    def test_build_configures_in_the_image_context(self):
        """Each scripts/build call of the Dockerfile, configured (not compiled) in a copy of what
        the stage's COPY steps bring of what .dockerignore leaves of the tree: catches a misspelt
        -D option, a target that does not exist and a source file the stage does not copy."""
        calls = [(s, a) for s, p, a, _, _ in self.run_steps() if os.path.basename(p) == "build"]
        self.assertEqual(sorted(s.name for s, _ in calls), ["build", "cuda-build"])
        files = context_files()
        for required in ("CMakeLists.txt", "scripts/setup", "scripts/build", "server/main.cc", "proto/CMakeLists.txt"):
            self.assertIn(required, files, f".dockerignore leaves {required} out of the build context")
        for stage, args in calls:
            options = [a for a in args[1:] if a.startswith("-D")]
            targets = [args[i + 1] for i, a in enumerate(args) if a == "--target"]
            self.assertIn("-DATTNSERVE_NATIVE=OFF", options, f"stage {stage.name}: an image must not use -march=native")
            for off in ("-DATTNSERVE_TESTS=OFF", "-DATTNSERVE_BENCH=OFF"):
                self.assertIn(off, options, f"stage {stage.name}: the image builds no tests or benchmarks")
            self.assertIn("-DCMAKE_EXE_LINKER_FLAGS=-s", options, f"stage {stage.name}: stripped binaries (-s)")
            expected = ["attnserve", "attnserve-cli"] + (["attnserve_cuda_plugin"] if stage.name == "cuda-build" else [])
            self.assertEqual(sorted(targets), expected)
            copied = self.copied_before_build(stage)
            for what in ("tests", "bench", "docs", "deploy", "."):
                self.assertNotIn(what, copied, f"stage {stage.name} copies {what}/: a change there would recompile")
            stage_files = [f for f in files if any(f == c or f.startswith(c + "/") for c in copied)]
            if stage.name == "cuda-build":
                self.assertIn("-DATTNSERVE_CUDA=ON", options)
                self.assertIn("-DCMAKE_CUDA_ARCHITECTURES=80;90", options, "Ampere (sm_80) and Hopper (sm_90)")
                self.assertIn("-DCMAKE_SHARED_LINKER_FLAGS=-s", options, "the CUDA plugin stripped too")
                self.assertIn("scripts/runtime-packages", stage_files)
                if not have_nvcc():
                    print(f"note: no nvcc here: stage {stage.name}'s configure is not checked", file=sys.stderr)
                    continue
            else:
                self.assertIn("-DATTNSERVE_CUDA=OFF", options)
            with tempfile.TemporaryDirectory() as ctx:
                for f in stage_files:
                    os.makedirs(os.path.join(ctx, os.path.dirname(f)), exist_ok=True)
                    shutil.copy2(os.path.join(SRC, f), os.path.join(ctx, f))
                build = os.path.join(ctx, "build-" + stage.name)
                env = dict(os.environ, PATH="/usr/local/cuda/bin:" + os.environ.get("PATH", ""))
                out = subprocess.run([os.path.join(ctx, "scripts", "build"), build] + options + ["--configure-only"],
                                     capture_output=True, text=True, timeout=600, env=env)
                self.assertEqual(out.returncode, 0, f"stage {stage.name}: scripts/build {build} {options} in what the "
                                                    f"stage copies ({copied}):\n{out.stdout[-4000:]}{out.stderr[-4000:]}")
                listing = subprocess.run(["ninja", "-C", build, "-t", "targets", "all"], capture_output=True,
                                         text=True, check=True).stdout
                known = set(re.findall(r"(?m)^([^:\s]+): ", listing))
                self.assertEqual([t for t in targets if t not in known], [], f"stage {stage.name}: targets CMake lacks")

    def test_build_stages_install_from_setup_alone(self):
        """The package layer of each build stage depends on scripts/setup only: the first COPY
        brings it alone, and `scripts/setup --build-only` (no test packages) runs before any other
        COPY, so editing sources, tests or docs reuses the layer."""
        for stage in (self.by_name["build"], self.by_name["cuda-build"]):
            with self.subTest(stage=stage.name):
                keywords = [k for k, _ in stage.instructions]
                first_copy = keywords.index("COPY")
                self.assertEqual(split_options(stage.instructions[first_copy][1])[1].split()[:-1], ["scripts/setup"])
                first_run = keywords.index("RUN")
                self.assertLess(first_copy, first_run)
                self.assertNotIn("COPY", keywords[first_copy + 1 : first_run])
                self.assertEqual(shlex.split(stage.instructions[first_run][1]), ["scripts/setup", "--build-only"])
        build_only = subprocess.run([os.path.join(SRC, "scripts", "setup"), "--build-only", "--dry-run"],
                                    capture_output=True, text=True, check=True).stdout.split()
        everything = subprocess.run([os.path.join(SRC, "scripts", "setup"), "--no-fetch", "--dry-run"],
                                    capture_output=True, text=True, check=True).stdout.split()
        self.assertLess(set(build_only), set(everything), "--build-only is a part of the default set")
        test_only = ("prometheus", "googletest", "libgtest-dev", "libgmock-dev", "libbenchmark-dev", "python3",
                     "python3-numpy", "python3-pip", "python3-yaml", "yamllint", "clang", "libclang-rt-14-dev", "git")
        self.assertEqual([p for p in test_only if p in build_only], [], "test-only packages in --build-only")
        docker = subprocess.run([os.path.join(SRC, "scripts", "setup"), "--docker", "--dry-run"],
                                capture_output=True, text=True, check=True).stdout.split()
        for p in ("docker.io", "docker-compose", "debootstrap"):
            self.assertIn(p, docker, "scripts/setup --docker: the container test's tools")
            self.assertNotIn(p, everything, "the engine is not part of the build and test packages")

    def test_dockerignore(self):
        patterns = dockerignore_patterns()
        for path in ("build/server/attnserve", "build-asan/CMakeCache.txt", ".git/HEAD", ".cache/x", ".gpu-carry/x",
                     "server/__pycache__/x.pyc", ".env", "deploy/.env", "certs/server.pem", "tls/server.key",
                     "home/.netrc", "keys/id_rsa", "a/secrets/token"):
            self.assertTrue(docker_excludes(path, patterns), f".dockerignore keeps {path} in the build context")
        # Whatever git ignores at the top level (build trees, caches) stays out of the context too.
        top = subprocess.run(["git", "status", "--ignored", "--porcelain"], cwd=SRC, capture_output=True, text=True,
                             check=True).stdout
        for line in top.splitlines():
            if line.startswith("!! "):
                path = line[3:].rstrip("/")
                self.assertTrue(docker_excludes(path, patterns) or docker_excludes(path + "/x", patterns),
                                f"git ignores {path} but .dockerignore keeps it in the build context")

    # The scripts the runtime stages copy from the context, and where.
    CONTAINER_SCRIPTS = {"scripts/container-entrypoint": "/usr/local/bin/attnserve-entrypoint",
                         "scripts/container-health": "/usr/local/bin/attnserve-health"}

    def stage_env(self, stage):
        env = {}
        for rest in stage.all("ENV"):
            for kv in shlex.split(rest):
                k, _, v = kv.partition("=")
                env[k] = v
        return env

    def test_runtime_stages(self):
        stages = self.runtime_stages()
        self.assertEqual(sorted(s.name for s in stages), ["cuda", "runtime"])
        for stage in stages:
            with self.subTest(stage=stage.name):
                # Non-root.
                user = stage.last("USER")
                self.assertIsNotNone(user, "no USER: the server would run as root")
                uid = user.split(":")[0]
                self.assertNotIn(uid, ("0", "root"), "USER is root")
                self.assertRegex(uid, r"^\d+$", "a numeric UID, so that Kubernetes' runAsNonRoot can verify it")
                # Ports = the server's defaults.
                exposed = {int(p.split("/")[0]) for rest in stage.all("EXPOSE") for p in rest.split()}
                self.assertIsNotNone(self.metrics_port, "attnserve --help has no --metrics-listen yet")
                self.assertEqual(exposed, {self.grpc_port, self.metrics_port})
                # The entrypoint: scripts/container-entrypoint, which execs the server with the
                # flags after it (flags it knows).
                entry = exec_form(stage.last("ENTRYPOINT")) + (exec_form(stage.last("CMD")) if stage.last("CMD") else [])
                self.assertEqual(entry[0], "attnserve-entrypoint", "exec form, scripts/container-entrypoint")
                assert_flags_exist(self, entry[1:], BINARY, f"stage {stage.name} ENTRYPOINT/CMD")
                self.assertIsNone(flag_value(entry, "--listen"), "the server's default --listen, as EXPOSE says")
                self.assertIsNone(flag_value(entry, "--port-file"), "the entrypoint passes --port-file itself")
                # Health check: scripts/container-health, the CLI's grpc.health.v1 command on the
                # port the server wrote to $ATTNSERVE_PORT_FILE (else $ATTNSERVE_TARGET).
                options, hc = split_options(stage.last("HEALTHCHECK"))
                self.assertTrue(hc.startswith("CMD "), hc)
                argv = exec_form(hc[4:])
                self.assertEqual(argv[0], "attnserve-health")
                assert_flags_exist(self, argv[1:], CLI, f"stage {stage.name} HEALTHCHECK (attnserve-cli flags)")
                timeout = dict(o.split("=", 1) for o in options).get("--timeout", "30s")
                cli_timeout_ms = int(flag_value(argv, "--timeout-ms", "30000"))
                self.assertLess(cli_timeout_ms, int(timeout.rstrip("s")) * 1000, "the CLI's deadline within --timeout")
                env = self.stage_env(stage)
                self.assertEqual(port_of(env.get("ATTNSERVE_TARGET", "localhost:50051")), self.grpc_port,
                                 "without a port file the health check asks the served port")
                port_file = env.get("ATTNSERVE_PORT_FILE", "")
                self.assertRegex(port_file, r"^/dev/shm/", "the port file on a tmpfs a read-only root still has")
                self.assertEqual(stage.last("STOPSIGNAL"), "SIGTERM")
                # The binaries come from the build stage's scripts/build folder, the two scripts
                # from the context.
                build = self.build_stage_of(stage)
                build_dirs = [a[0] for s, p, a, _, _ in self.run_steps() if s is build and p.endswith("build")]
                copied, scripts = set(), {}
                for rest in stage.all("COPY"):
                    opts, paths = split_options(rest)
                    words = paths.split()
                    if not any(o.startswith("--from") for o in opts):
                        self.assertEqual(len(words), 2, f"COPY {paths}: one script a COPY")
                        scripts[words[0]] = words[1]
                        continue
                    for src in words[:-1]:
                        self.built_here(self.local_binary(src, build_dirs))
                        copied.add(os.path.basename(src))
                    self.assertEqual(words[-1].rstrip("/"), "/usr/local/bin")
                # The server loads the CUDA plugin from its own folder (server/backend/select.cc).
                expected = {"attnserve", "attnserve-cli"} | ({"libattnserve_cuda.so"} if stage.name == "cuda" else set())
                self.assertEqual(copied, expected)
                self.assertEqual(scripts, self.CONTAINER_SCRIPTS)
                for script in scripts:
                    self.assertTrue(os.access(os.path.join(SRC, script), os.X_OK), f"{script} is not executable")
                    with open(os.path.join(SRC, script)) as f:
                        self.assertEqual(f.readline().strip(), "#!/bin/sh", f"{script}: the slim image has no bash")
                    out = subprocess.run(["sh", "-n", os.path.join(SRC, script)], capture_output=True, text=True)
                    self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("--device", flag_names(exec_form(self.by_name["cuda"].last("ENTRYPOINT"))))

    def container_env(self, port_file, **extra):
        """The runtime image's environment for the two container scripts run here: PATH with
        this tree's attnserve and attnserve-cli first, the image's variables, the port file."""
        env = child_env(**self.stage_env(self.by_name["runtime"]))
        env["PATH"] = os.pathsep.join([os.path.dirname(BINARY), os.path.dirname(CLI), env.get("PATH", "")])
        env["ATTNSERVE_PORT_FILE"] = port_file
        env.update(extra)
        return env

    def health(self, env):
        argv = exec_form(split_options(self.by_name["runtime"].last("HEALTHCHECK"))[1][4:])
        argv[0] = os.path.join(SRC, "scripts", "container-health")
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)

    @contextlib.contextmanager
    def entrypoint_server(self, env, *args):
        """The runtime image's ENTRYPOINT (scripts/container-entrypoint) run here in a PID namespace
        of its own, with `args`; yields (the unshare process, its log) once the server answers
        SERVING on the --listen port in args."""
        entry = exec_form(self.by_name["runtime"].last("ENTRYPOINT"))
        argv = [os.path.join(SRC, "scripts", "container-entrypoint")] + entry[1:] + list(args)
        argv.append(f"--metrics-listen=127.0.0.1:{free_port()}")
        port = port_of(flag_value(argv, "--listen"))
        with tempfile.TemporaryFile(mode="w+") as log:
            proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child"] + argv, stdout=log, stderr=log, env=env)
            try:
                deadline, serving = time.time() + 60, False
                while time.time() < deadline and proc.poll() is None and not serving:
                    health = subprocess.run([CLI, "--target", f"127.0.0.1:{port}", "--timeout-ms", "2000", "health"],
                                            capture_output=True, text=True)
                    serving = health.stdout.strip() == "SERVING"
                    time.sleep(0.2)
                log.seek(0)
                self.assertTrue(serving, f"the server did not come up:\n{log.read()}")
                yield proc, log
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def require_pid_namespace(self):
        probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            self.skipTest(f"no PID namespace here (unshare: {probe.stderr.strip()})")

    def test_server_as_pid1_stops_on_sigterm(self):
        """The image has no init: the entrypoint script execs the server, which is then PID 1 of
        its PID namespace, where the kernel drops signals a process does not handle. It must
        still drain and exit 0 on SIGTERM."""
        self.require_pid_namespace()
        with tempfile.TemporaryDirectory() as tmp:
            env = self.container_env(os.path.join(tmp, "attnserve.port"))
            with self.entrypoint_server(env, f"--listen=127.0.0.1:{free_port()}") as (proc, log):
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    children = f.read().split()
                self.assertEqual(len(children), 1)
                with open(f"/proc/{children[0]}/status") as f:
                    status = f.read()
                self.assertEqual(re.search(r"(?m)^Name:\s+(\S+)", status).group(1), "attnserve",
                                 "the entrypoint execs the server (no shell left as PID 1)")
                nspid = re.search(r"(?m)^NSpid:\s+(.*)$", status).group(1).split()
                self.assertEqual(nspid[-1], "1", "the server is PID 1 in its namespace")
                os.kill(int(children[0]), signal.SIGTERM)
                rc = proc.wait(timeout=60)
                log.seek(0)
                self.assertEqual(rc, 0, f"exit status after SIGTERM as PID 1; log:\n{log.read()}")

    def test_health_check_follows_the_listen_address(self):
        """The image's HEALTHCHECK asks the port the server bound: the entrypoint passes
        --port-file $ATTNSERVE_PORT_FILE, the health script reads it (here $ATTNSERVE_TARGET names
        a closed port, so only the file can lead it to the server). Where the port file's folder
        is not writable (a read-only root without /dev/shm), the server starts without it and the
        check asks $ATTNSERVE_TARGET. (scripts/docker-test runs the image with
        `--listen 0.0.0.0:6000` and waits for Docker to call it healthy.)"""
        self.require_pid_namespace()
        with tempfile.TemporaryDirectory() as tmp:
            port_file = os.path.join(tmp, "attnserve.port")
            with open(port_file, "w") as f:
                f.write(f"{free_port()}\n")  # stale: from an earlier start; the entrypoint removes it
            closed = f"127.0.0.1:{free_port()}"
            env = self.container_env(port_file, ATTNSERVE_TARGET=closed)
            port = free_port()
            before = self.health(env)
            self.assertNotEqual(before.returncode, 0, "healthy with no server")
            with self.entrypoint_server(env, f"--listen=0.0.0.0:{port}"):
                with open(port_file) as f:
                    self.assertEqual(f.read().strip(), str(port))
                out = self.health(env)
                self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
                self.assertTrue(out.stdout.startswith(f"SERVING (127.0.0.1:{port}, from {port_file})"), out.stdout)
            down = self.health(env)
            self.assertNotEqual(down.returncode, 0, f"healthy after the server stopped: {down.stdout}")
            # No writable folder for the port file: $ATTNSERVE_TARGET.
            env = self.container_env(os.path.join(tmp, "missing", "attnserve.port"), ATTNSERVE_TARGET=f"127.0.0.1:{port}")
            with self.entrypoint_server(env, f"--listen=127.0.0.1:{port}") as (_, log):
                out = self.health(env)
                self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
                self.assertIn(f"127.0.0.1:{port}, from $ATTNSERVE_TARGET", out.stdout)
                log.seek(0)
                self.assertIn("is not writable: no port file", log.read())


    def test_docker_test_script(self):
        """scripts/docker-test, the stage of the test command that builds and runs the image on a
        real engine: bash, strict mode, syntax; installs through scripts/setup --docker; skips
        (exit 0, a SKIPPED line) only where no engine can start; publishes on 127.0.0.1 only;
        runs the image with the deployments' restrictions."""
        path = os.path.join(SRC, "scripts", "docker-test")
        self.assertTrue(os.access(path, os.X_OK), "scripts/docker-test is not executable")
        with open(path) as f:
            text = f.read()
        self.assertTrue(text.startswith("#!/usr/bin/env bash\n"))
        self.assertRegex(text, r"(?m)^set -euo pipefail$")
        out = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("scripts/setup --docker", text)
        self.assertIn("SKIPPED", text)
        self.assertIn("DOCKER_BUILDKIT=1", text)
        self.assertIn("debootstrap --variant=minbase bookworm", text)
        for flag in ("--read-only", "--cap-drop ALL", "--security-opt no-new-privileges", "--listen 0.0.0.0:6000"):
            self.assertIn(flag, text)
        published = re.findall(r"(?<!\S)-p ([^\s\"$]\S*)", text)  # docker run -p, not mkdir -p "$dir"
        self.assertTrue(published)
        self.assertEqual([p for p in published if not p.startswith("127.0.0.1:")], [], "ports beyond loopback")
        self.assertNotRegex(text, r"(?i)deb\.debian\.org", "the mirror comes from the machine's apt sources")


# ---------------------------------------------------------------------------------------------
# Kustomize (the subset deploy/k8s uses)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def json_pointer(path):
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json6902(doc, ops):
    for op in ops:
        *parents, last = json_pointer(op["path"])
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"JSON 6902 op {op['op']} not supported here")


def kustomize(directory):
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    unknown = set(k) - {"apiVersion", "kind", "resources", "images", "patches", "labels", "namespace"}
    if unknown:
        raise AssertionError(f"{directory}: kustomization fields this renderer does not know: {unknown}")
    objs = []
    for r in k.get("resources", []):
        path = os.path.join(directory, r)
        objs += kustomize(path) if os.path.isdir(path) else load_all(path)
    for patch in k.get("patches", []):
        ops = load_all(os.path.join(directory, patch["path"]))[0]
        if isinstance(ops, dict) and ops.get("$patch") == "delete":  # a strategic-merge deletion
            t = patch["target"]
            gone = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (t["kind"], t["name"])
                    and (o["kind"], o["metadata"]["name"]) == (ops["kind"], ops["metadata"]["name"])]
            if len(gone) != 1:
                raise AssertionError(f"delete patch {patch['path']} matches {len(gone)} objects")
            objs.remove(gone[0])
            continue
        if not isinstance(ops, list):
            raise AssertionError("only JSON 6902 patches are supported here")
        t = patch["target"]
        hits = [o for o in objs if o["kind"] == t["kind"] and o["metadata"]["name"] == t["name"]]
        if len(hits) != 1:
            raise AssertionError(f"patch target {t} matches {len(hits)} objects")
        apply_json6902(hits[0], ops)
    for image in k.get("images", []):
        for o in objs:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name = re.sub(r"[:@].*$", "", c["image"])
                if name == image["name"]:
                    c["image"] = image.get("newName", name) + (":" + image["newTag"] if "newTag" in image else "")
    for label in k.get("labels", []):
        if set(label) - {"pairs"}:
            raise AssertionError(f"labels options not supported here: {label}")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    return objs


def scraped_families():
    """The metric families of a real server's /metrics after one forward."""
    port_dir = tempfile.mkdtemp(prefix="attnserve-scrape-")
    metrics_port = free_port()
    proc = subprocess.Popen([BINARY, "--listen=127.0.0.1:0", f"--port-file={port_dir}/port",
                             f"--metrics-listen=127.0.0.1:{metrics_port}", "--layer=probe=random:d_model=8,heads=1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    try:
        deadline = time.time() + 60
        while not os.path.exists(f"{port_dir}/port"):
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError("attnserve did not start for the scrape")
            time.sleep(0.05)
        with open(f"{port_dir}/port") as f:
            target = f"127.0.0.1:{f.read().strip()}"
        out = cli(target, "forward", "--layer", "probe", "--random", "1,2")
        if out.returncode != 0:
            raise AssertionError(f"forward for the scrape: {out.stderr}")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return set(re.findall(r"(?m)^# TYPE (\w+) ", text))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(port_dir, ignore_errors=True)


def one(objs, kind, predicate=lambda o: True):
    hits = [o for o in objs if o["kind"] == kind and predicate(o)]
    if len(hits) != 1:
        raise AssertionError(f"expected one {kind}, found {len(hits)}")
    return hits[0]


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def cpu_cores(quantity):
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def prestop_seconds(container):
    handler = container.get("lifecycle", {}).get("preStop")
    if handler is None:
        return None
    if "sleep" in handler:
        return int(handler["sleep"]["seconds"])
    argv = handler.get("exec", {}).get("command", [])
    if argv and os.path.basename(argv[0]) == "sleep":
        return int(argv[1])
    return 0


def make_test_pki(directory, dns_names):
    """A throwaway CA (ca.crt) and a certificate for `dns_names` signed by it (tls.crt, tls.key),
    as cert-manager's CA issuer writes them into a Secret, made with openssl."""
    def openssl(*args):
        out = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError(f"openssl {' '.join(args)}: {out.stderr}")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=attnserve test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={dns_names[0]}")
    with open(os.path.join(directory, "ext.cnf"), "w") as f:
        f.write("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
                "subjectAltName=" + ",".join(f"DNS:{n}" for n in dns_names) + "\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf")


# The files cert-manager writes into a Certificate's Secret.
CERT_MANAGER_KEYS = ("tls.crt", "tls.key", "ca.crt")
# Server flags (attnserve) and probe flags (attnserve-cli) that name such a file.
SERVER_TLS_FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")
CLI_TLS_FILE_FLAGS = ("--tls-ca", "--tls-cert", "--tls-key")


class KubernetesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.base = kustomize(os.path.join(DEPLOY, "k8s"))
        cls.gpu = kustomize(os.path.join(DEPLOY, "k8s", "overlays", "gpu"))
        cls.admin = kustomize(os.path.join(DEPLOY, "k8s", "overlays", "admin"))
        cls.tls = kustomize(os.path.join(DEPLOY, "k8s", "overlays", "tls"))
        cls.keda = kustomize(os.path.join(DEPLOY, "k8s", "overlays", "keda"))
        cls.queue_hpa = kustomize(os.path.join(DEPLOY, "k8s", "overlays", "queue-hpa"))

    def variants(self, *names):
        """[(name, objects)] of the base and the overlays (all of them unless named)."""
        all_ = {"base": self.base, "gpu overlay": self.gpu, "admin overlay": self.admin, "tls overlay": self.tls,
                "keda overlay": self.keda, "queue-hpa overlay": self.queue_hpa}
        return [(n, o) for n, o in all_.items() if not names or n in names]

    def deployment(self, objs):
        return one(objs, "Deployment")

    def container(self, objs):
        containers = self.deployment(objs)["spec"]["template"]["spec"]["containers"]
        return one([dict(c, kind="c") for c in containers], "c", lambda c: c["name"] == "attnserve")

    def mount_of(self, objs, path):
        """(volume mount, volume) that holds `path` in the server container: the deepest mount."""
        c = self.container(objs)
        mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        self.assertTrue(mounts, f"{path} is not under any volume mount of the container")
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        volume = one([dict(v, kind="v") for v in self.deployment(objs)["spec"]["template"]["spec"]["volumes"]], "v",
                     lambda v: v["name"] == mount["name"])
        return mount, volume

    def config(self, objs):
        """(args, the YAML config as text and parsed) of the server container."""
        c = self.container(objs)
        args = c.get("command", [])[1:] + c.get("args", [])
        path = flag_value(args, "--config")
        if path is None:
            return args, None, {}
        mount, volume = self.mount_of(objs, path)
        self.assertIn("configMap", volume, f"--config {path} is not in a ConfigMap volume")
        cm = one(objs, "ConfigMap", lambda o: o["metadata"]["name"] == volume["configMap"]["name"])
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        self.assertIn(key, cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key}")
        return args, cm["data"][key], yaml.safe_load(cm["data"][key]) or {}

    def settings(self, objs):
        """The server's effective listen, metrics and drain settings: flags over config over defaults."""
        args, _, conf = self.config(objs)
        listen = flag_value(args, "--listen", conf.get("listen", default_of("--listen")))
        metrics = flag_value(args, "--metrics-listen", conf.get("metrics_listen") or default_of("--metrics-listen"))
        drain = flag_value(args, "--drain-timeout-s", conf.get("drain_timeout_s") or default_of("--drain-timeout-s"))
        return port_of(listen), port_of(metrics), float(drain)

    def routes_file(self, objs):
        """(path, mount, volume, ConfigMap, text) of the container's --routes-file."""
        args = self.container(objs).get("args", [])
        path = flag_value(args, "--routes-file")
        self.assertIsNotNone(path, "the Deployment passes no --routes-file: the split would live in each pod")
        mount, volume = self.mount_of(objs, path)
        self.assertIn("configMap", volume, f"--routes-file {path} is not in a ConfigMap volume")
        cm = one(objs, "ConfigMap", lambda o: o["metadata"]["name"] == volume["configMap"]["name"])
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        self.assertIn(key, cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key}")
        return path, mount, volume, cm, cm["data"][key]

    def local_config(self, objs, tmp):
        """The container's args with --config and --routes-file pointing at copies of their
        ConfigMaps' files in tmp."""
        args, text, _ = self.config(objs)
        self.assertIsNotNone(text, "the Deployment passes no --config")
        path = os.path.join(tmp, "attnserve.yaml")
        with open(path, "w") as f:
            f.write(text)
        routes = os.path.join(tmp, "routes.yaml")
        with open(routes, "w") as f:
            f.write(self.routes_file(objs)[4])
        return [f"--config={path}" if a.startswith("--config") else
                f"--routes-file={routes}" if a.startswith("--routes-file") else a for a in args]

    def admin_token_env(self, objs):
        """The container's env entries that set the admin token."""
        return [e for e in self.container(objs).get("env", []) if e["name"] == "ATTNSERVE_ADMIN_TOKEN"]

    def test_kinds(self):
        base_kinds = ["ConfigMap", "ConfigMap", "Deployment", "Service", "Service", "HorizontalPodAutoscaler",
                      "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"]
        self.assertEqual(sorted(o["kind"] for o in self.base), sorted(base_kinds))
        self.assertEqual(sorted(o["kind"] for o in self.gpu), sorted(base_kinds))
        self.assertEqual(sorted(o["kind"] for o in self.admin), sorted(base_kinds))
        self.assertEqual(sorted(o["kind"] for o in self.tls), sorted(base_kinds + ["Certificate"]))
        self.assertEqual(sorted(o["kind"] for o in self.queue_hpa), sorted(base_kinds))
        keda_kinds = [k for k in base_kinds if k != "HorizontalPodAutoscaler"] + ["ScaledObject"]
        self.assertEqual(sorted(o["kind"] for o in self.keda), sorted(keda_kinds), "KEDA owns the only HPA")
        for name, objs in self.variants():
            for o in objs:
                self.assertIn("app.kubernetes.io/name", o["metadata"].get("labels", {}),
                              f"{name}: {o['kind']} {o['metadata']['name']}")

    def test_flags_exist(self):
        for name, objs in self.variants():
            c = self.container(objs)
            assert_flags_exist(self, c.get("args", []), BINARY, f"deploy/k8s ({name}) container args")
            self.assertEqual(c.get("command"), None, "the image's ENTRYPOINT runs the server; args only")

    def test_ports_and_grpc_probes(self):
        for name, objs in self.variants("base", "gpu overlay", "admin overlay"):
            with self.subTest(objs=name):
                grpc_port, metrics_port, _ = self.settings(objs)
                c = self.container(objs)
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                self.assertEqual(ports, {"grpc": grpc_port, "metrics": metrics_port})
                self.assertIn("livenessProbe", c)
                self.assertIn("readinessProbe", c)
                for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if kind not in c:
                        continue
                    probe = c[kind]
                    self.assertEqual(set(probe) & {"httpGet", "tcpSocket", "exec"}, set(), f"{kind}: native gRPC only")
                    self.assertEqual(probe["grpc"]["port"], grpc_port, f"{kind} probes the served port")
                    self.assertIn(probe["grpc"].get("service", ""), GRPC_HEALTH_SERVICES)
                self.assertEqual(c["readinessProbe"]["grpc"].get("service"), "attnserve.v1.AttentionService")

    def test_grace_period_exceeds_drain(self):
        for name, objs in self.variants():
            _, _, drain = self.settings(objs)
            pod = self.deployment(objs)["spec"]["template"]["spec"]
            sleep = prestop_seconds(self.container(objs))
            self.assertIsNotNone(sleep, "a preStop hook lets the endpoint removal spread before SIGTERM")
            self.assertGreater(sleep, 0)
            self.assertGreater(pod["terminationGracePeriodSeconds"], sleep + drain,
                               f"{name}: grace period must cover the preStop sleep ({sleep}s) and the drain ({drain}s)")

    def test_resources_and_threads(self):
        for name, objs in self.variants():
            with self.subTest(objs=name):
                c = self.container(objs)
                res = c["resources"]
                for k in ("cpu", "memory"):
                    self.assertIn(k, res["requests"])
                    self.assertIn(k, res["limits"])
                self.assertLessEqual(cpu_cores(res["requests"]["cpu"]), cpu_cores(res["limits"]["cpu"]))
                args, _, conf = self.config(objs)
                threads = int(flag_value(args, "--threads", conf.get("threads", 0)))
                workers = int(flag_value(args, "--workers", conf.get("workers", 1)))
                self.assertGreaterEqual(threads, 1, "threads 0 sizes OpenMP to the node's cores, not the CPU limit")
                self.assertLessEqual(threads * workers, cpu_cores(res["limits"]["cpu"]), "threads x workers <= CPU limit")
                self.assertGreaterEqual(self.deployment(objs)["spec"]["replicas"], 2)

    def test_security(self):
        """Non-root as the image's user, no privilege escalation, no capabilities, read-only root
        file system, the runtime's default seccomp profile: in the base and every overlay."""
        user = parse_dockerfile(os.path.join(SRC, "Dockerfile"))[-1].last("USER").split(":")[0]
        for name, objs in self.variants():
            with self.subTest(objs=name):
                pod = self.deployment(objs)["spec"]["template"]["spec"]
                for host in ("hostNetwork", "hostPID", "hostIPC"):
                    self.assertFalse(pod.get(host, False), host)
                psc = pod.get("securityContext", {})
                self.assertIs(psc.get("runAsNonRoot"), True)
                self.assertEqual(psc.get("runAsUser"), 65532)
                self.assertEqual(str(psc["runAsUser"]), user, "the image's USER")
                for c in pod["containers"] + pod.get("initContainers", []):
                    csc = c.get("securityContext", {})
                    self.assertIs(csc.get("allowPrivilegeEscalation"), False, c["name"])
                    self.assertIs(csc.get("readOnlyRootFilesystem"), True, c["name"])
                    self.assertEqual(csc.get("capabilities", {}).get("drop"), ["ALL"], c["name"])
                    self.assertEqual(csc.get("capabilities", {}).get("add", []), [], c["name"])
                    self.assertFalse(csc.get("privileged", False), c["name"])
                    self.assertNotIn(csc.get("runAsUser", 65532), (0,), c["name"])
                    self.assertNotEqual(csc.get("runAsNonRoot"), False, c["name"])
                    seccomp = csc.get("seccompProfile", psc.get("seccompProfile", {}))
                    self.assertEqual(seccomp.get("type"), "RuntimeDefault", c["name"])

    def test_network_policy(self):
        """The NetworkPolicy selects the server pods and lets in exactly: gRPC from the pods of the
        namespace, metrics from the namespace named monitoring."""
        for name, objs in self.variants():
            with self.subTest(objs=name):
                policy = one(objs, "NetworkPolicy")
                pod_labels = self.deployment(objs)["spec"]["template"]["metadata"]["labels"]
                selector = policy["spec"]["podSelector"]
                self.assertEqual(set(selector), {"matchLabels"}, "select by labels only")
                self.assertTrue(selector["matchLabels"], "an empty podSelector selects every pod of the namespace")
                self.assertTrue(selects(selector["matchLabels"], pod_labels), "the NetworkPolicy selects no server pod")
                self.assertEqual(policy["spec"]["policyTypes"], ["Ingress"])
                grpc_port, metrics_port, _ = self.settings(objs)
                named = {p["name"]: p["containerPort"] for p in self.container(objs)["ports"]}

                def port_number(p):
                    return named.get(p["port"]) if isinstance(p["port"], str) else p["port"]

                rules = [(json.dumps(r.get("from"), sort_keys=True),
                          sorted((port_number(p), p.get("protocol", "TCP")) for p in r.get("ports", [])))
                         for r in policy["spec"].get("ingress", [])]
                expected = [
                    (json.dumps([{"podSelector": {}}], sort_keys=True), [(grpc_port, "TCP")]),
                    (json.dumps([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                                sort_keys=True), [(metrics_port, "TCP")]),
                ]
                self.assertEqual(sorted(rules), sorted(expected))

    def test_admin_api_closed_except_admin_overlay(self):
        """Only overlays/admin sets a token, from a Secret that must exist (optional: false); the
        base, its ConfigMap and the other overlays leave the admin API closed."""
        for name, objs in self.variants():
            with self.subTest(objs=name):
                args, _, conf = self.config(objs)
                self.assertNotIn("admin_token", conf, "a token in a ConfigMap is readable by anyone who can read it")
                self.assertEqual([f for f in flag_names(args) if f in ("--admin-token", "--admin-listen")], [])
                env = self.admin_token_env(objs)
                if name != "admin overlay":
                    self.assertEqual(env, [], f"{name} keeps the admin API closed")
                    continue
                self.assertEqual(len(env), 1)
                self.assertNotIn("value", env[0], "the token comes from a Secret, not the manifest")
                ref = env[0]["valueFrom"]["secretKeyRef"]
                self.assertEqual((ref["name"], ref["key"]), ("attnserve-admin", "token"))
                self.assertIs(ref.get("optional"), False, "without the Secret the pod must not start")
                # The overlay tells how to create that very Secret.
                overlay = os.path.join(DEPLOY, "k8s", "overlays", "admin")
                text = ""
                for f in sorted(os.listdir(overlay)):
                    with open(os.path.join(overlay, f)) as fh:
                        text += fh.read()
                m = re.search(r"kubectl create secret generic (\S+) --from-literal=([\w.-]+)="
                              r"\$\(openssl rand -hex (\d+)\)", text)
                self.assertIsNotNone(m, "overlays/admin: no `kubectl create secret generic ...` comment")
                self.assertEqual((m.group(1), m.group(2)), (ref["name"], ref["key"]))
                self.assertGreaterEqual(int(m.group(3)), 16, "a token of 16 bytes or more")

    def test_tls_overlay(self):
        """The server on TLS with the cert-manager Secret's files, and the exec probes that replace
        the native gRPC ones: the CLI where the image installs it, flags it knows, files under the
        Secret's mount, the served port, a name the certificate carries, deadlines under the
        probes' timeouts."""
        objs = self.tls
        grpc_port, _, _ = self.settings(objs)
        cert = one(objs, "Certificate")
        self.assertEqual(cert["apiVersion"], "cert-manager.io/v1")
        self.assertEqual(cert["spec"]["secretName"], "attnserve-tls")
        self.assertEqual((cert["spec"]["issuerRef"].get("kind", "Issuer"), cert["spec"]["issuerRef"]["name"]),
                         ("Issuer", "attnserve-ca"))
        self.assertTrue({"server auth", "client auth"} <= set(cert["spec"].get("usages", [])),
                        "server auth, and client auth for the mTLS variant's probes")
        dns_names = cert["spec"]["dnsNames"]
        namespaces = {n.split(".")[1] for n in dns_names if ".svc" in n}
        self.assertEqual(len(namespaces), 1, f"dnsNames in one namespace: {dns_names}")
        ns = namespaces.pop()
        for s in (o for o in objs if o["kind"] == "Service"):
            n = s["metadata"]["name"]
            for name in (n, f"{n}.{ns}.svc", f"{n}.{ns}.svc.cluster.local"):
                self.assertIn(name, dns_names, f"Service {n}: clients connect by {name}")
            for p in s["spec"]["ports"]:
                if p["name"] == "grpc":
                    self.assertNotEqual(p.get("appProtocol"), "kubernetes.io/h2c", f"Service {n}: TLS is not h2c")

        def secret_file(path, what):
            mount, volume = self.mount_of(objs, path)
            self.assertIn("secret", volume, f"{what} {path}: not in a Secret volume")
            self.assertEqual(volume["secret"]["secretName"], cert["spec"]["secretName"], f"{what} {path}")
            self.assertNotIn("items", volume["secret"], "cert-manager's key names, as they are")
            self.assertIs(mount.get("readOnly"), True, f"{what}: the Secret is mounted read-only")
            self.assertIn(path[len(mount["mountPath"].rstrip("/")) + 1 :], CERT_MANAGER_KEYS, f"{what} {path}")

        args, _, _ = self.config(objs)
        for flag in ("--tls-cert", "--tls-key"):
            self.assertIsNotNone(flag_value(args, flag), f"the server needs {flag}")
        for flag in SERVER_TLS_FILE_FLAGS:
            if flag_value(args, flag) is not None:
                secret_file(flag_value(args, flag), f"attnserve {flag}")

        runtime = parse_dockerfile(os.path.join(SRC, "Dockerfile"))[-1]
        installed = {os.path.join(split_options(r)[1].split()[-1], os.path.basename(src))
                     for r in runtime.all("COPY") for src in split_options(r)[1].split()[:-1]}
        c = self.container(objs)
        probe_flags = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            with self.subTest(probe=kind):
                probe = c[kind]
                self.assertEqual(set(probe) & {"grpc", "httpGet", "tcpSocket"}, set(), "kubelet probes have no TLS")
                argv = probe["exec"]["command"]
                self.assertIn(argv[0], installed, "the CLI where the Dockerfile installs it")
                self.assertEqual(os.path.basename(argv[0]), "attnserve-cli")
                self.assertIn("health", argv)
                globals_ = argv[1 : argv.index("health")]
                probe_flags[kind] = globals_
                target = flag_value(globals_, "--target")
                self.assertEqual(target, f"127.0.0.1:{grpc_port}", "the served port, in the pod")
                self.assertIsNotNone(flag_value(globals_, "--tls-ca"), "the probe checks the server's certificate")
                self.assertIn(flag_value(globals_, "--server-name"), dns_names, "a name the certificate carries")
                for flag in CLI_TLS_FILE_FLAGS:
                    if flag_value(globals_, flag) is not None:
                        secret_file(flag_value(globals_, flag), f"{kind} {flag}")
                service = argv[argv.index("health") + 1 :]
                self.assertIn(service[0] if service else "", GRPC_HEALTH_SERVICES)
                if kind == "readinessProbe":
                    self.assertEqual(service, ["attnserve.v1.AttentionService"], "turns NOT_SERVING when draining")
                deadline_ms = int(flag_value(globals_, "--timeout-ms", "30000"))
                self.assertLess(deadline_ms, 1000 * probe.get("timeoutSeconds", 1), "the CLI's deadline in the probe's")
        # Last, so that the checks above run before the binaries know these flags.
        assert_flags_exist(self, args, BINARY, "deploy/k8s/overlays/tls container args")
        for kind, globals_ in probe_flags.items():
            assert_flags_exist(self, globals_, CLI, f"deploy/k8s/overlays/tls {kind}")

    def test_tls_probes_against_the_server(self):
        """The tls overlay's server arguments and probe commands, run for real on a throwaway CA
        whose certificate carries the Certificate's dnsNames: every probe passes, plaintext does
        not; and the mTLS variant (--tls-client-ca, probes with the pod's certificate)."""
        if shutil.which("openssl") is None:
            self.skipTest("no openssl to make a test certificate")
        cert = one(self.tls, "Certificate")
        c = self.container(self.tls)
        mount_path = self.mount_of(self.tls, flag_value(c["args"], "--tls-cert"))[0]["mountPath"].rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            make_test_pki(tmp, cert["spec"]["dnsNames"])
            local = [a.replace(mount_path + "/", tmp + "/") for a in self.local_config(self.tls, tmp)]

            def probe_commands(target, client_cert):
                for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                    argv = [a.replace(mount_path + "/", tmp + "/") for a in c[kind]["exec"]["command"]]
                    argv = [CLI] + argv[1:]
                    argv[argv.index("--target") + 1] = target
                    if client_cert:
                        i = argv.index("health")
                        argv[i:i] = ["--tls-cert", f"{tmp}/tls.crt", "--tls-key", f"{tmp}/tls.key"]
                    yield kind, argv

            for variant, extra in (("TLS", []), ("mTLS", [f"--tls-client-ca={tmp}/ca.crt"])):
                what = f"deploy/k8s/overlays/tls ({variant})"
                with running_server(self, local + extra, what, check_health=False) as t:
                    for kind, argv in probe_commands(t, client_cert=bool(extra)):
                        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env())
                        self.assertEqual((out.returncode, out.stdout.strip()), (0, "SERVING"),
                                         f"{variant} {kind}: {shlex.join(argv)}\n{out.stderr}")
                    plain = cli(t, "health")
                    self.assertNotEqual(plain.returncode, 0, f"{variant}: the server answered plaintext")
                    if extra:
                        _, argv = next(probe_commands(t, client_cert=False))
                        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env())
                        self.assertNotEqual(out.returncode, 0, "mTLS: a client without a certificate got in")

    def test_services(self):
        objs = self.base
        pod_labels = self.deployment(objs)["spec"]["template"]["metadata"]["labels"]
        self.assertTrue(selects(self.deployment(objs)["spec"]["selector"]["matchLabels"], pod_labels))
        ports = {p["name"]: p["containerPort"] for p in self.container(objs)["ports"]}
        services = [o for o in objs if o["kind"] == "Service"]
        headless = one(services, "Service", lambda s: s["spec"].get("clusterIP") == "None")
        cluster = one(services, "Service", lambda s: s["spec"].get("clusterIP") != "None")
        self.assertEqual(headless["metadata"]["name"], "attnserve-headless", "the name the README's dns:/// target uses")
        self.assertEqual(cluster["spec"].get("type", "ClusterIP"), "ClusterIP")
        for s in services:
            self.assertTrue(selects(s["spec"]["selector"], pod_labels), f"Service {s['metadata']['name']} selects no pod")
            for p in s["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                target_port = ports.get(target) if isinstance(target, str) else target
                self.assertIn(target_port, ports.values(), f"Service {s['metadata']['name']} port {p['name']}")
                self.assertEqual(p["port"], target_port, "service ports equal the container ports (one port map)")
        self.assertEqual([p["name"] for p in headless["spec"]["ports"]], ["grpc"])
        self.assertEqual(sorted(p["name"] for p in cluster["spec"]["ports"]), ["grpc", "metrics"])

    def test_service_monitor_hpa_pdb(self):
        objs = self.base
        _, metrics_port, _ = self.settings(objs)
        sm = one(objs, "ServiceMonitor")
        endpoint = one([dict(e, kind="e") for e in sm["spec"]["endpoints"]], "e")
        scraped = [s for s in objs if s["kind"] == "Service" and selects(sm["spec"]["selector"]["matchLabels"],
                                                                         s["metadata"].get("labels", {}))
                   and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
        self.assertEqual(len(scraped), 1, "exactly one Service is scraped, so no pod is scraped twice")
        port = one([dict(p, kind="p") for p in scraped[0]["spec"]["ports"]], "p", lambda p: p["name"] == endpoint["port"])
        self.assertEqual(port["port"], metrics_port)
        self.assertEqual(endpoint.get("path", "/metrics"), "/metrics")
        hpa = one(objs, "HorizontalPodAutoscaler")
        self.assertEqual(hpa["spec"]["scaleTargetRef"]["kind"], "Deployment")
        self.assertEqual(hpa["spec"]["scaleTargetRef"]["name"], self.deployment(objs)["metadata"]["name"])
        self.assertLessEqual(hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
        self.assertGreaterEqual(hpa["spec"]["minReplicas"], 2, "one pod draining must not take the service down")
        pod_labels = self.deployment(objs)["spec"]["template"]["metadata"]["labels"]
        self.assertTrue(selects(one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels))

    def test_startup_probe_covers_a_slow_load(self):
        """The kubelet kills a container whose liveness probe fails; a startup probe holds it off
        until the layers are loaded (health answers only then). 300 s or more for a large load."""
        for name, objs in self.variants("base", "gpu overlay", "admin overlay", "keda overlay", "queue-hpa overlay"):
            with self.subTest(objs=name):
                probe = self.container(objs)["startupProbe"]
                self.assertGreaterEqual(probe["periodSeconds"] * probe["failureThreshold"], 300)

    def test_queue_autoscaling(self):
        """overlays/keda and overlays/queue-hpa scale the Deployment on what the real server exports:
        every metric their queries, rules and HPA name is a family of a real scrape (after a request,
        as attnserve_queue_depth's series appear with their first job), the HPA's metric names are
        the ones prometheus-adapter's rules serve, per pod, and the replica bounds keep two pods."""
        families = scraped_families()
        for metric in ("attnserve_inflight_requests", "attnserve_queue_depth"):
            self.assertIn(metric, families, "the server exports its load")
        # KEDA: one ScaledObject on the Deployment, Prometheus triggers on the load gauges.
        so = one(self.keda, "ScaledObject")
        self.assertEqual(so["apiVersion"], "keda.sh/v1alpha1")
        ref = so["spec"]["scaleTargetRef"]
        self.assertEqual((ref.get("kind", "Deployment"), ref["name"]),
                         ("Deployment", self.deployment(self.keda)["metadata"]["name"]))
        self.assertGreaterEqual(so["spec"]["minReplicaCount"], 2, "one pod draining must not take the service down")
        self.assertLessEqual(so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"])
        queried = set()
        for trigger in so["spec"]["triggers"]:
            self.assertEqual(trigger["type"], "prometheus")
            meta = trigger["metadata"]
            self.assertRegex(meta["serverAddress"], r"^https?://")
            self.assertGreater(float(meta["threshold"]), 0)
            names = set(re.findall(r"\b(attnserve_\w+)\b", meta["query"]))
            self.assertTrue(names, meta["query"])
            self.assertEqual(names - families, set(), f"KEDA query names metrics the server lacks: {meta['query']}")
            self.assertRegex(meta["query"], r"^sum\(", "the total over the pods; KEDA divides by the threshold")
            queried |= names
        self.assertEqual(queried, {"attnserve_inflight_requests", "attnserve_queue_depth"})
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        self.assertEqual(behavior, one(self.base, "HorizontalPodAutoscaler")["spec"]["behavior"],
                         "the same slow scale-down as the base HPA")
        # prometheus-adapter + HPA: the HPA asks for per-pod custom metrics the adapter's rules serve.
        with open(os.path.join(DEPLOY, "k8s", "overlays", "queue-hpa", "prometheus-adapter-values.yaml")) as f:
            rules = yaml.safe_load(f)["rules"]["custom"]
        served = {}
        for rule in rules:
            series = re.match(r"^(\w+)\{", rule["seriesQuery"]).group(1)
            self.assertIn(series, families, f"adapter rule on a metric the server lacks: {series}")
            self.assertEqual(rule["resources"]["overrides"], {"namespace": {"resource": "namespace"},
                                                              "pod": {"resource": "pod"}})
            self.assertIn("<<.GroupBy>>", rule["metricsQuery"], "grouped by pod, as the pods API asks")
            served[rule["name"]["as"]] = series
        hpa = one(self.queue_hpa, "HorizontalPodAutoscaler")
        self.assertEqual(hpa["spec"]["scaleTargetRef"]["name"], self.deployment(self.queue_hpa)["metadata"]["name"])
        self.assertGreaterEqual(hpa["spec"]["minReplicas"], 2)
        asked = set()
        for m in hpa["spec"]["metrics"]:
            self.assertEqual(m["type"], "Pods", "per-pod custom metrics, not CPU")
            self.assertIn(m["pods"]["metric"]["name"], served, "a metric no adapter rule serves")
            self.assertEqual(m["pods"]["target"]["type"], "AverageValue")
            asked.add(served[m["pods"]["metric"]["name"]])
        self.assertEqual(asked, {"attnserve_inflight_requests", "attnserve_queue_depth"})

    def test_gpu_overlay(self):
        c = self.container(self.gpu)
        self.assertGreaterEqual(int(c["resources"]["limits"]["nvidia.com/gpu"]), 1)
        self.assertEqual(flag_value(c["args"], "--device"), "cuda")
        self.assertIn("--exit-on-device-loss", c["args"], "a lost device restarts the container")
        self.assertNotIn("--exit-on-device-loss", self.container(self.base)["args"])
        self.assertRegex(c["image"], r":cuda$", "the CUDA image (docker build --target cuda)")
        self.assertNotIn("nvidia.com/gpu", self.container(self.base)["resources"]["limits"])

    def test_routes_are_their_own_configmap_mounted_as_a_directory(self):
        """The split in a ConfigMap of its own, mounted read-only without subPath (a subPath mount
        never sees the kubelet's updates), naming the config's layers; the config itself has no
        routes (the server refuses both), in the base and every overlay."""
        for name, objs in self.variants():
            with self.subTest(objs=name):
                path, mount, _, cm, text = self.routes_file(objs)
                self.assertNotIn("subPath", mount, "a subPath mount is never updated: the pods would not follow")
                self.assertNotIn("subPathExpr", mount)
                self.assertIs(mount.get("readOnly"), True)
                config_mount, _ = self.mount_of(objs, flag_value(self.container(objs)["args"], "--config"))
                self.assertNotEqual(mount["name"], config_mount["name"], "the routes change apart from the config")
                self.assertNotEqual(cm["metadata"]["name"], "attnserve-config")
                _, _, conf = self.config(objs)
                self.assertNotIn("routes", conf, "--routes-file excludes the config's routes:")
                routes = yaml.safe_load(text)
                self.assertEqual(list(routes), ["routes"])
                self.assertTrue(set(routes["routes"]) <= set(conf.get("layers", {})) | {"*"}, routes)
                self.assertIn("summed", " ".join(routes["routes"].values()), "an A/B split, not one form")

    def test_routes_configmap_change_reaches_the_running_server(self):
        """The Deployment's args on this machine, the routes ConfigMap laid out as the kubelet
        mounts it (`..data` symlink), then updated as the kubelet updates it: the server applies
        the new split (its metrics say so) without a restart."""
        _, _, _, cm, text = self.routes_file(self.base)
        key = next(iter(cm["data"]))
        with tempfile.TemporaryDirectory() as tmp:
            args = self.local_config(self.base, tmp)
            mounted = os.path.join(tmp, "routes")
            os.makedirs(os.path.join(mounted, "..v1"))
            with open(os.path.join(mounted, "..v1", key), "w") as f:
                f.write(text)
            os.symlink("..v1", os.path.join(mounted, "..data"))
            os.symlink(os.path.join("..data", key), os.path.join(mounted, key))
            args = [f"--routes-file={os.path.join(mounted, key)}" if a.startswith("--routes-file") else a
                    for a in args]
            port_file = os.path.join(tmp, "metrics_port")
            args.append(f"--metrics-port-file={port_file}")

            def weight(form):
                with open(port_file) as f:
                    metrics_port = int(f.read())
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                m = re.search(r'^attnserve_route_weight\{form="%s",layer="demo",math="fp32"\} (\S+)$' % form, body, re.M)
                return float(m.group(1)) if m else None

            with running_server(self, args, "deploy/k8s Deployment + both ConfigMaps"):
                self.assertEqual(weight("summed"), 0.1)
                os.makedirs(os.path.join(mounted, "..v2"))
                with open(os.path.join(mounted, "..v2", key), "w") as f:
                    f.write(text.replace("factored:90,summed:10", "factored:50,summed:50"))
                os.symlink("..v2", os.path.join(mounted, "..data_tmp"))
                os.rename(os.path.join(mounted, "..data_tmp"), os.path.join(mounted, "..data"))
                deadline = time.monotonic() + 10
                while weight("summed") != 0.5 and time.monotonic() < deadline:
                    time.sleep(0.1)
                self.assertEqual(weight("summed"), 0.5, "the kubelet's update did not reach the server")

    def test_configmap_config_starts_the_server(self):
        """The ConfigMap's YAML and the Deployment's args, accepted by the real server."""
        _, text, _ = self.config(self.base)
        self.assertIsNotNone(text, "the Deployment passes no --config")
        self.assertIn("layers", yaml.safe_load(text))
        with tempfile.TemporaryDirectory() as tmp:
            local = self.local_config(self.base, tmp)
            self.assertNotIn("/etc/attnserve", " ".join(local))
            start_and_stop_server(self, local, "deploy/k8s Deployment + ConfigMap")

    def test_admin_api_on_the_real_server(self):
        """The base (ConfigMap config, no token) refuses a load with PERMISSION_DENIED; the admin
        overlay, its token in the variable its secretKeyRef fills, takes one sent with the token.
        A token under 16 bytes stops the server at start-up."""
        env = self.admin_token_env(self.admin)
        self.assertEqual(len(env), 1)
        with tempfile.TemporaryDirectory() as tmp:
            closed = self.local_config(self.base, tmp)
            opened = self.local_config(self.admin, tmp)
            check_admin_api(self, closed, opened, env[0]["name"], "deploy/k8s ConfigMap")
            short = subprocess.run([BINARY] + opened + ["--listen=127.0.0.1:0"], capture_output=True, text=True,
                                   timeout=60, env=child_env(**{env[0]["name"]: "x" * 15}))
            self.assertNotEqual(short.returncode, 0, "a 15-byte admin token must be refused at start-up")
            self.assertNotIn("listening on", short.stdout)

    def test_matches_kubectl_kustomize(self):
        """This file's renderer against the real one, where kubectl is installed."""
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed; the manifests are checked through this file's renderer")
        paths = {"base": os.path.join(DEPLOY, "k8s"), "gpu overlay": os.path.join(DEPLOY, "k8s", "overlays", "gpu"),
                 "admin overlay": os.path.join(DEPLOY, "k8s", "overlays", "admin"),
                 "tls overlay": os.path.join(DEPLOY, "k8s", "overlays", "tls"),
                 "keda overlay": os.path.join(DEPLOY, "k8s", "overlays", "keda"),
                 "queue-hpa overlay": os.path.join(DEPLOY, "k8s", "overlays", "queue-hpa")}
        for name, mine in self.variants():
            with self.subTest(objs=name):
                out = subprocess.run([kubectl, "kustomize", paths[name]], capture_output=True, text=True, timeout=60)
                self.assertEqual(out.returncode, 0, out.stderr)
                theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout)}
                ours = {(o["kind"], o["metadata"]["name"]): o for o in mine}
                self.assertEqual(sorted(theirs), sorted(ours))
                for key in ours:
                    self.assertEqual(json.dumps(theirs[key], sort_keys=True), json.dumps(ours[key], sort_keys=True),
                                     key)


class PrometheusRulesTest(unittest.TestCase):
    """The A/B alerts (docs/ab.md): one rules file, unit-tested by promtool, the same groups in the
    Kubernetes PrometheusRule, loaded by the compose Prometheus and its image."""

    RULES = os.path.join(DEPLOY, "prometheus", "rules.yaml")
    PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

    def promtool(self, *args):
        if not os.access(self.PROMTOOL, os.X_OK):
            self.fail("promtool is missing: scripts/setup installs Debian's prometheus")
        return subprocess.run([self.PROMTOOL, *args], capture_output=True, text=True, timeout=120,
                              cwd=os.path.dirname(self.RULES))

    def test_promtool_checks_the_rules_and_runs_their_unit_tests(self):
        out = self.promtool("check", "rules", "rules.yaml")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        out = self.promtool("test", "rules", "rules_test.yaml")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("SUCCESS", out.stdout + out.stderr)

    def test_the_alerts_the_design_asks_for(self):
        with open(self.RULES) as f:
            groups = yaml.safe_load(f)["groups"]
        alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
        wanted = {"AttnserveShadowDivergenceHigh": "attnserve_shadow_divergence_bucket",
                  "AttnserveFormErrorRatioAboveOther": "attnserve:form_error_ratio:rate10m",
                  "AttnserveRoutesGenerationDisagree": "attnserve_routes_generation"}
        self.assertEqual(sorted(alerts), sorted(wanted))
        for name, series in wanted.items():
            rule = alerts[name]
            self.assertIn(series, rule["expr"], name)
            self.assertRegex(rule.get("for", ""), r"^\d+m$", f"{name}: a 'for' keeps one bad scrape from paging")
            self.assertIn(rule["labels"].get("severity"), ("warning", "critical"), name)
            self.assertIn("docs/ab.md", rule["annotations"]["description"], name)
        with open(os.path.join(SRC, "docs", "ab.md")) as f:
            headings = {line.lstrip("#").strip() for line in f if line.startswith("#")}
        for rule in alerts.values():
            for section in re.findall(r'docs/ab\.md, "([^"]+)"', rule["annotations"]["description"]):
                self.assertIn(section, headings, "an alert points at a section docs/ab.md lacks")

    def test_kubernetes_prometheus_rule_holds_the_same_groups(self):
        with open(self.RULES) as f:
            groups = yaml.safe_load(f)["groups"]
        rule = one(kustomize(os.path.join(DEPLOY, "k8s")), "PrometheusRule")
        self.assertEqual(rule["apiVersion"], "monitoring.coreos.com/v1")
        self.assertEqual(rule["spec"]["groups"], groups,
                         "deploy/k8s/base/prometheusrule.yaml differs from deploy/prometheus/rules.yaml")

    def test_prometheus_loads_the_rules_in_compose_and_its_image(self):
        config_path = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
        with open(config_path) as f:
            config = yaml.safe_load(f)
        self.assertIn("rules.yaml", config.get("rule_files", []))
        out = self.promtool("check", "config", "prometheus.yml")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("1 rule files found", out.stdout + out.stderr)
        with open(os.path.join(DEPLOY, "compose.yaml")) as f:
            compose = yaml.safe_load(f)
        volumes = compose["services"]["prometheus"]["volumes"]
        self.assertIn("./prometheus/rules.yaml:/etc/prometheus/rules.yaml:ro", volumes,
                      "the rules beside the config Prometheus reads (/etc/prometheus/prometheus.yml)")
        stage = parse_dockerfile(os.path.join(DEPLOY, "prometheus", "Dockerfile"))[0]
        copies = stage.all("COPY")
        self.assertTrue(any("rules.yaml" in c.split()[:-1] and c.split()[-1] == "/etc/prometheus/" for c in copies),
                        copies)


# ---------------------------------------------------------------------------------------------
# Compose


class ComposeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(DEPLOY, "compose.yaml")) as f:
            cls.compose = yaml.safe_load(f)
        cls.services = cls.compose["services"]
        cls.server = cls.services["attnserve"]

    def command(self):
        return list(self.server.get("command", []))

    def bind_mounts(self, service):
        """[(host path, container path)] of a service's bind mounts."""
        mounts = []
        for v in self.services[service].get("volumes", []):
            parts = v.split(":")
            if parts[0].startswith((".", "/")):
                mounts.append((os.path.normpath(os.path.join(DEPLOY, parts[0])), parts[1]))
        return mounts

    def test_services(self):
        self.assertEqual(sorted(self.services), ["attnserve", "grafana", "prometheus"])
        build = self.server["build"]
        self.assertEqual(os.path.normpath(os.path.join(DEPLOY, build["context"])), SRC)
        self.assertTrue(os.path.isfile(os.path.join(SRC, build.get("dockerfile", "Dockerfile"))))
        stages = parse_dockerfile(os.path.join(SRC, build.get("dockerfile", "Dockerfile")))
        self.assertEqual(build.get("target"), stages[-1].name, "the CPU runtime stage")

    def test_flags_exist(self):
        assert_flags_exist(self, self.command(), BINARY, "deploy/compose.yaml attnserve command")

    def test_ports(self):
        cmd = self.command()
        grpc_port = port_of(flag_value(cmd, "--listen", default_of("--listen")))
        metrics_port = port_of(flag_value(cmd, "--metrics-listen", default_of("--metrics-listen")))
        published = {int(p.split(":")[-1]): int(p.split(":")[-2]) for p in self.server["ports"]}
        self.assertEqual(set(published), {grpc_port, metrics_port}, "container ports: the server's gRPC and metrics")
        exposed = {int(p) for rest in parse_dockerfile(os.path.join(SRC, "Dockerfile"))[-1].all("EXPOSE")
                   for p in rest.split()}
        self.assertEqual(set(published), exposed, "the image's EXPOSE")

    def test_grace_period_exceeds_drain(self):
        drain = float(flag_value(self.command(), "--drain-timeout-s", default_of("--drain-timeout-s")))
        grace = self.server.get("stop_grace_period", "10s")
        m = re.fullmatch(r"(\d+)s", grace)
        self.assertIsNotNone(m, f"stop_grace_period {grace}: write it in seconds")
        self.assertGreater(int(m.group(1)), drain)

    def test_mounted_files_exist(self):
        for service in self.services:
            for host, _ in self.bind_mounts(service):
                self.assertTrue(os.path.exists(host), f"{service} mounts {os.path.relpath(host, SRC)}, which does not exist")

    def test_prometheus_scrapes_attnserve(self):
        metrics_port = port_of(flag_value(self.command(), "--metrics-listen", default_of("--metrics-listen")))
        prom = self.services["prometheus"]
        config_in_container = flag_value(prom.get("command", []), "--config.file", "/etc/prometheus/prometheus.yml")
        host = [h for h, c in self.bind_mounts("prometheus") if c == config_in_container]
        self.assertEqual(len(host), 1, f"Prometheus's --config.file {config_in_container} is not mounted")
        with open(host[0]) as f:
            config = yaml.safe_load(f)
        targets = [t for job in config.get("scrape_configs", []) for sc in job.get("static_configs", [])
                   for t in sc.get("targets", []) if job.get("metrics_path", "/metrics") == "/metrics"]
        self.assertIn(f"attnserve:{metrics_port}", targets, "a scrape target of the compose service's metrics port")

    def test_grafana_provisioning(self):
        mounts = dict((c, h) for h, c in self.bind_mounts("grafana"))
        self.assertIn("/etc/grafana/provisioning", mounts)
        provisioning = mounts["/etc/grafana/provisioning"]
        prom_port = int(self.services["prometheus"]["ports"][0].split(":")[-1])
        datasources = []
        for root, _, files in os.walk(os.path.join(provisioning, "datasources")):
            for f in files:
                if f.endswith((".yaml", ".yml")):
                    datasources += load_all(os.path.join(root, f))[0].get("datasources", [])
        prom = [d for d in datasources if d.get("type") == "prometheus"]
        self.assertEqual(len(prom), 1, "one Prometheus data source")
        self.assertEqual(prom[0]["url"].rstrip("/"), f"http://prometheus:{prom_port}")
        providers = []
        for root, _, files in os.walk(os.path.join(provisioning, "dashboards")):
            for f in files:
                if f.endswith((".yaml", ".yml")):
                    providers += load_all(os.path.join(root, f))[0].get("providers", [])
        paths = {p["options"]["path"].rstrip("/") for p in providers}
        dashboards = [c for c in mounts if c.endswith(".json")]
        self.assertTrue(dashboards, "no dashboard is mounted")
        for d in dashboards:
            self.assertIn(os.path.dirname(d), paths, f"{d} is not under a dashboard provider's path")
            with open(mounts[d]) as f:
                dashboard = json.load(f)
            uids = {json.dumps(x.get("uid")) for x in re.findall(r'"datasource":\s*(\{[^{}]*\})', json.dumps(dashboard))
                    for x in [json.loads(x)]}
            known = {json.dumps(d.get("uid")) for d in datasources} | {json.dumps(None)}
            unknown = [u for u in uids if u not in known and "$" not in u]
            self.assertEqual(unknown, [], "the dashboard names data source uids that are not provisioned")

    def test_command_starts_the_server(self):
        start_and_stop_server(self, self.command(), "deploy/compose.yaml attnserve command")

    def test_ports_published_on_loopback_only(self):
        """Every published port of every service binds the host's 127.0.0.1, not all interfaces."""
        for name, service in self.services.items():
            self.assertNotEqual(service.get("network_mode"), "host", f"{name}: host networking publishes every port")
            self.assertTrue(service.get("ports"), f"{name} publishes no port")
            for p in service.get("ports", []):
                if isinstance(p, dict):  # long syntax
                    host_ip, published = p.get("host_ip"), p.get("published")
                else:
                    m = re.fullmatch(r"(?:(\[[^\]]*\]|[^:]*):)?(?:([\d-]*):)?([\d-]+)(?:/\w+)?", str(p))
                    self.assertIsNotNone(m, f"{name}: cannot read port entry {p!r}")
                    host_ip, published = m.group(1), m.group(2)
                self.assertEqual(host_ip, "127.0.0.1", f"{name} publishes {p!r} beyond the loopback address")
                self.assertTrue(published, f"{name}: {p!r} publishes on a random host port")

    def test_compose_tools_accept_the_file(self):
        """Debian's docker-compose 1.29 (what scripts/docker-test runs; Debian has no compose
        plugin) takes the file with scripts/docker-test's override: no top-level `name:` or
        `version:`; `docker-compose config` where it is installed."""
        self.assertEqual(sorted(set(self.compose) - {"services", "volumes", "networks", "configs", "secrets"}), [],
                         "top-level keys docker-compose 1.29 refuses")
        override_path = os.path.join(SRC, "tests", "deploy", "compose.docker-test.yaml")
        with open(override_path) as f:
            override = yaml.safe_load(f)
        self.assertEqual(sorted(override["services"]), ["attnserve", "prometheus"], "Grafana is not in Debian")
        for name, service in override["services"].items():
            self.assertEqual(list(service), ["image"], f"the override only swaps {name}'s image")
        with open(os.path.join(SRC, "scripts", "docker-test")) as f:
            script = f.read()
        for image in (override["services"]["attnserve"]["image"], override["services"]["prometheus"]["image"]):
            self.assertIn(image, script, "the images scripts/docker-test builds")
        compose = shutil.which("docker-compose")
        if compose is None:
            print("note: no docker-compose here (scripts/setup --docker): its parse of the file is not checked",
                  file=sys.stderr)
            return
        out = subprocess.run([compose, "-p", "attnserve-check", "-f", os.path.join(DEPLOY, "compose.yaml"), "-f",
                              override_path, "config", "-q"], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_prometheus_image(self):
        """deploy/prometheus/Dockerfile (Debian's prometheus, for an offline compose): runs
        /usr/bin/prometheus as non-root with the TSDB in the volume the compose file mounts, and
        Debian's Prometheus knows every flag the compose file passes."""
        stages = parse_dockerfile(os.path.join(DEPLOY, "prometheus", "Dockerfile"))
        self.assertEqual(len(stages), 1)
        stage = stages[0]
        self.assertEqual(stage.base, "debian:bookworm-slim")
        self.assertEqual(exec_form(stage.last("ENTRYPOINT")), ["/usr/bin/prometheus"])
        self.assertNotIn(stage.last("USER").split(":")[0], ("0", "root"))
        command = self.services["prometheus"]["command"]
        storage = flag_value(command, "--storage.tsdb.path")
        self.assertIn(storage, exec_form(stage.last("VOLUME")))
        self.assertIn(f"prometheus-data:{storage}", self.services["prometheus"]["volumes"])
        self.assertIn(int(self.services["prometheus"]["ports"][0].split(":")[-1]),
                      {int(p) for p in stage.last("EXPOSE").split()})
        prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
        if not os.path.exists(prometheus):
            self.fail("Debian's prometheus is not installed (scripts/setup)")
        out = subprocess.run([prometheus, "--help"], capture_output=True, text=True, timeout=60)
        known = set(re.findall(r"(--[a-z][a-z0-9.-]*)", out.stdout + out.stderr))
        self.assertEqual([f for f in flag_names(command) if f not in known], [],
                         "flags Debian's Prometheus does not know")

    def test_admin_api_closed(self):
        """No admin token in the compose file: the real server, started with its command, refuses
        a load with PERMISSION_DENIED; given a token in $ATTNSERVE_ADMIN_TOKEN it takes one sent
        with attnserve-cli --admin-token."""
        env = self.server.get("environment", {})
        names = [e.split("=", 1)[0] for e in env] if isinstance(env, list) else list(env)
        self.assertNotIn("ATTNSERVE_ADMIN_TOKEN", names)
        self.assertEqual([f for f in flag_names(self.command()) if f in ("--admin-token", "--admin-listen")], [],
                         "the compose file keeps the admin API closed")
        check_admin_api(self, self.command(), self.command(), "ATTNSERVE_ADMIN_TOKEN", "deploy/compose.yaml")


class KServeTest(unittest.TestCase):
    """deploy/kserve: attnserve as a KServe serving runtime for the Open Inference Protocol over
    gRPC (grpc-v2), and an InferenceService that uses it."""

    @classmethod
    def setUpClass(cls):
        def load(name):
            with open(os.path.join(DEPLOY, "kserve", name)) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            assert len(docs) == 1, f"deploy/kserve/{name}: expected one document, got {len(docs)}"
            return docs[0]

        cls.runtime = load("servingruntime.yaml")
        cls.isvc = load("inferenceservice.yaml")
        cls.container = cls.runtime["spec"]["containers"][0]
        cls.args = cls.container.get("args", [])

    def test_kinds_and_references(self):
        self.assertEqual((self.runtime["apiVersion"], self.runtime["kind"]), ("serving.kserve.io/v1alpha1",
                                                                              "ServingRuntime"))
        self.assertEqual((self.isvc["apiVersion"], self.isvc["kind"]), ("serving.kserve.io/v1beta1",
                                                                        "InferenceService"))
        model = self.isvc["spec"]["predictor"]["model"]
        self.assertEqual(model["runtime"], self.runtime["metadata"]["name"])
        self.assertIn(model["modelFormat"]["name"], [f["name"] for f in self.runtime["spec"]["supportedModelFormats"]])
        self.assertEqual(model["protocolVersion"], "grpc-v2")
        self.assertTrue(self.runtime["spec"]["supportedModelFormats"][0]["autoSelect"])
        self.assertEqual(self.runtime["spec"]["protocolVersions"], ["grpc-v2"])
        self.assertEqual(self.container["name"], "kserve-container")

    def test_h2c_port_is_the_grpc_listener_and_probes_use_grpc_health(self):
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.assertEqual(list(ports), ["h2c"], "KServe routes gRPC to the one port named h2c")
        self.assertEqual(ports["h2c"], port_of(flag_value(self.args, "--listen", "0.0.0.0:50051")))
        readiness = self.container["readinessProbe"]["grpc"]
        self.assertEqual(readiness["port"], ports["h2c"])
        self.assertEqual(readiness.get("service"), "inference.GRPCInferenceService")
        self.assertEqual(self.container["livenessProbe"]["grpc"]["port"], ports["h2c"])

    def test_startup_probe_covers_a_slow_load(self):
        """Without a startup probe a load longer than the liveness probe's patience (~30 s) would
        crash-loop; this one holds it off for 300 s or more, on the served port."""
        probe = self.container["startupProbe"]
        self.assertEqual(probe["grpc"]["port"], port_of(flag_value(self.args, "--listen", "0.0.0.0:50051")))
        self.assertGreaterEqual(probe["periodSeconds"] * probe["failureThreshold"], 300)

    def test_flags_exist_and_grace_exceeds_drain(self):
        assert_flags_exist(self, self.args, BINARY, "deploy/kserve/servingruntime.yaml args")
        drain = int(flag_value(self.args, "--drain-timeout-s", default_of("--drain-timeout-s")))
        self.assertGreater(self.isvc["spec"]["predictor"]["terminationGracePeriodSeconds"], drain)

    def test_security(self):
        sc = self.container["securityContext"]
        self.assertTrue(sc["runAsNonRoot"])
        self.assertFalse(sc["allowPrivilegeEscalation"])
        self.assertTrue(sc["readOnlyRootFilesystem"])
        self.assertEqual(sc["capabilities"]["drop"], ["ALL"])

    def test_args_start_a_server_whose_oip_service_is_serving(self):
        with running_server(self, self.args, "deploy/kserve ServingRuntime") as target:
            health = cli(target, "health", "inference.GRPCInferenceService")
            self.assertEqual(health.stdout.strip(), "SERVING", health.stderr)


class KServeHttpTest(unittest.TestCase):
    """deploy/kserve/v2-http: attnserve as a KServe serving runtime for the Open Inference
    Protocol over HTTP/REST (v2), and an InferenceService that uses it."""

    @classmethod
    def setUpClass(cls):
        def load(name):
            with open(os.path.join(DEPLOY, "kserve", "v2-http", name)) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            assert len(docs) == 1, f"deploy/kserve/v2-http/{name}: expected one document, got {len(docs)}"
            return docs[0]

        cls.runtime = load("servingruntime.yaml")
        cls.isvc = load("inferenceservice.yaml")
        cls.container = cls.runtime["spec"]["containers"][0]
        cls.args = cls.container.get("args", [])

    def test_kinds_and_references(self):
        self.assertEqual((self.runtime["apiVersion"], self.runtime["kind"]), ("serving.kserve.io/v1alpha1",
                                                                              "ServingRuntime"))
        self.assertEqual((self.isvc["apiVersion"], self.isvc["kind"]), ("serving.kserve.io/v1beta1",
                                                                        "InferenceService"))
        model = self.isvc["spec"]["predictor"]["model"]
        self.assertEqual(model["runtime"], self.runtime["metadata"]["name"])
        self.assertIn(model["modelFormat"]["name"], [f["name"] for f in self.runtime["spec"]["supportedModelFormats"]])
        self.assertEqual(model["protocolVersion"], "v2")
        self.assertEqual(self.runtime["spec"]["protocolVersions"], ["v2"])
        self.assertEqual(self.container["name"], "kserve-container")
        # Two runtimes for one model format: only the gRPC one is picked without a runtime named.
        self.assertFalse(self.runtime["spec"]["supportedModelFormats"][0]["autoSelect"])

    def test_http1_port_is_the_http_listener_and_probes_use_its_health(self):
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.assertEqual(list(ports), ["http1"], "KServe routes HTTP/1.1 to the one port named http1")
        http_port = port_of(flag_value(self.args, "--http-listen"))
        self.assertEqual(ports["http1"], http_port)
        self.assertEqual(self.container["readinessProbe"]["httpGet"], {"path": "/v2/health/ready", "port": http_port})
        self.assertEqual(self.container["livenessProbe"]["httpGet"], {"path": "/v2/health/live", "port": http_port})
        probe = self.container["startupProbe"]
        self.assertEqual(probe["httpGet"]["port"], http_port)
        self.assertGreaterEqual(probe["periodSeconds"] * probe["failureThreshold"], 300)

    def test_flags_exist_and_grace_exceeds_drain(self):
        assert_flags_exist(self, self.args, BINARY, "deploy/kserve/v2-http/servingruntime.yaml args")
        drain = int(flag_value(self.args, "--drain-timeout-s", default_of("--drain-timeout-s")))
        self.assertGreater(self.isvc["spec"]["predictor"]["terminationGracePeriodSeconds"], drain)

    def test_security(self):
        sc = self.container["securityContext"]
        self.assertTrue(sc["runAsNonRoot"])
        self.assertFalse(sc["allowPrivilegeEscalation"])
        self.assertTrue(sc["readOnlyRootFilesystem"])
        self.assertEqual(sc["capabilities"]["drop"], ["ALL"])

    def test_args_start_a_server_whose_probe_paths_answer(self):
        port = free_port()
        with running_server(self, self.args + [f"--http-listen=127.0.0.1:{port}"], "deploy/kserve/v2-http"):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                path = self.container[probe]["httpGet"]["path"]
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                    self.assertEqual(r.status, 200, f"{probe} {path}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
