#!/usr/bin/python3
"""The soak test with faults (CTest label "soak"; docs/reliability.md, "Soak").

Runs the real attnserve on loopback (ephemeral ports, a temporary folder) under saturating load
from four soak_client processes (tests/soak/soak_client.cc) for ATTNSERVE_SOAK_SECONDS (default
120), with Debian's Prometheus scraping /metrics every second through basic auth, and faults all
the while:

  - both forms, routed requests with sticky keys, compare=true, shadows (--shadow-rate 0.2);
  - calls whose 1-5 ms deadline expires in the queue, calls the client cancels mid-call;
  - an admin client: every 1.5 s a LoadLayer, replace, UnloadLayer or SetRouting (and refused
    admin calls), while the mix clients call the layer being churned;
  - large requests that exceed --max-memory-mb (256) together, a full queue
    (--max-queue-requests 4), hostile requests ([1, 6600, 768] summed, wrong d_model, a NaN, a
    5000-byte unknown layer name, a layer name that is not UTF-8);
  - a raw HTTP/2 client that sends Forward calls with 1 MiB answers and never reads them, and an
    HTTP/2 connection that never reads at all;
  - two slowloris connections on the metrics port (a request sent one byte every 0.5 s).

Then it checks, and fails on any miss:

  - every client: sent = OK + each documented status code, nothing in flight, every kind of call
    ended only with its expected codes, no wrong answer (soak_client checks answers);
  - the server's attnserve_requests_total against the clients: exact per code for every layer
    the calls with generous deadlines use, exact per (layer, form) for OK; for the "chaos" layer
    (tiny deadlines, cancels), which gRPC may end before the handler counts it, bounds; the
    stalled reader's calls all counted;
  - Prometheus's attnserve_requests_total (after one more scrape) equals the server's own scrape;
  - the server's RSS: sampled every second (reported), and at 12 quiet points, where the clients
    pause (SIGUSR1) until the server is idle and the RSS less the loaded layers' weights is what
    it retains. The Theil-Sen slope (median of pairwise slopes) of the quiet points of the second half of the load is
    below ATTNSERVE_SOAK_RSS_SLOPE_MIB_PER_MIN (default 2 MiB/min; reported, not asserted, for a
    sanitizer build, whose allocator keeps freed memory in quarantine). The server runs with
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=16384 (ATTNSERVE_SOAK_GLIBC_TUNABLES) so that
    its idle RSS follows live memory;
  - every scrape succeeded: min_over_time(up[...]) == 1, despite the slowloris connections;
  - SIGTERM drains to exit status 0 within --drain-timeout-s (10 s) + 5 s (the stalled reader
    holds the drain to its deadline).

Environment: ATTNSERVE_BINARY, ATTNSERVE_CLI_BINARY, ATTNSERVE_SOAK_CLIENT, ATTNSERVE_SOURCE_DIR
(set by CTest); ATTNSERVE_SOAK_SECONDS; ATTNSERVE_SOAK_BINARY (another server binary, e.g.
build-asan/server/attnserve); ATTNSERVE_SOAK_RSS_SLOPE_MIB_PER_MIN; ATTNSERVE_SOAK_GLIBC_TUNABLES
("" = glibc's defaults); ATTNSERVE_SOAK_REPORT=FILE
(the figures as JSON); ATTNSERVE_SOAK_KEEP=1 (keep the temporary folder: logs, client output).
Every process it starts dies with it (PR_SET_PDEATHSIG).
"""

import array
import base64
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from harness import bcrypt_hash, die_with_parent, free_port, read, stop, wait_for  # noqa: E402

SRC = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
BINARY = (os.environ.get("ATTNSERVE_SOAK_BINARY") or os.environ.get("ATTNSERVE_BINARY")
          or os.path.join(SRC, "build", "server", "attnserve"))
CLI = os.environ.get("ATTNSERVE_CLI_BINARY", os.path.join(SRC, "build", "client", "attnserve-cli"))
CLIENT = os.environ.get("ATTNSERVE_SOAK_CLIENT", os.path.join(SRC, "build", "tests", "soak", "soak_client"))
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MODEL = os.path.join(SRC, "tests", "data", "torch-mha", "small.gpt2.safetensors")

SECONDS = float(os.environ.get("ATTNSERVE_SOAK_SECONDS", "120"))
RSS_SLOPE_BOUND = float(os.environ.get("ATTNSERVE_SOAK_RSS_SLOPE_MIB_PER_MIN", "2.0"))
REPORT = os.environ.get("ATTNSERVE_SOAK_REPORT")
# The server's glibc malloc with a fixed 16 KiB mmap threshold: every block from 16 KiB up is
# mapped and unmapped, not kept in an arena, so the RSS of the idle server follows live memory
# to within a megabyte and a 120 s run can see a slow leak. (glibc's default threshold rises to
# 32 MiB as blocks are freed, and the idle RSS then wanders by +-5 MiB.) "" = glibc's default.
GLIBC_TUNABLES = os.environ.get("ATTNSERVE_SOAK_GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=16384")
KEEP = bool(os.environ.get("ATTNSERVE_SOAK_KEEP"))

ADMIN_TOKEN = "soak-test-admin-token-0123456789"
SCRAPE_USER, SCRAPE_PASSWORD = "prometheus", "scrape-password-soak"
DRAIN_TIMEOUT_S = 10
DRAIN_MARGIN_S = 5  # after the drain's deadline: cancelling what is left, stopping the workers, exit
MAX_MEMORY_MB = 256
MAX_QUEUE_REQUESTS = 4
SHADOW_RATE = 0.2
LAYERS = {
    "demo": "random:d_model=768,heads=12,seed=1",    # the mix clients' main layer, and the hostile requests
    "chaos": "random:d_model=256,heads=4,seed=5",    # tiny deadlines and cancels only
    "slowread": "random:d_model=256,heads=4,seed=7",  # the stalled reader's calls only
}
# "gpt2" is loaded over the API from --model-dir before the load starts; "churn" and "big" come
# and go with the admin client.
CLIENTS = [  # role, seed, concurrency
    ("mix", 1, 8),
    ("mix", 2, 8),
    ("chaos", 3, 8),
    ("admin", 4, 1),
]
STALLED_CALLS = 4           # Forward calls on one connection whose answers are never read
STALLED_SHAPE = (1, 1024, 256)  # 1 MiB each way
START_TIMEOUT_S = 90
# Quiet points: this many times during the load, evenly spaced, every client pauses until the
# server is idle, and the server's RSS then, less its layers' weights and the scratch its backend
# keeps by design (attnserve_backend_retained_bytes), is what it retains: the leak signal. (Under load the RSS swings by up to ~250 MiB with what is in flight, and the admin
# client's 80 MB layer comes and goes.) The slope is fitted to the quiet points of the second half.
QUIET_POINTS = 12


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def basic_auth():
    return "Basic " + base64.b64encode(f"{SCRAPE_USER}:{SCRAPE_PASSWORD}".encode()).decode()


def http_get(url, timeout=10, auth=False):
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", basic_auth())
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.read().decode()


# Kinds of Forward call (soak_client) that gRPC answers before the service's handler runs, so
# attnserve_requests_total never counts them: a request that does not parse (invalid UTF-8 in
# the layer name) gets UNIMPLEMENTED with an empty message from gRPC 1.51's callback API.
NOT_COUNTED_KINDS = {"hostile.invalid_utf8"}
# Codes clients may see that docs/service.md's table does not list, with the reason: none now
# (UNIMPLEMENTED for a request that does not parse is listed there).
KNOWN_UNDOCUMENTED = {}


def documented_codes():
    """The status codes of docs/service.md's table, plus OK and CANCELLED (named below it)."""
    codes = set(re.findall(r"^\| `([A-Z_]+)` \|", read(os.path.join(SRC, "docs", "service.md")), re.M))
    if "INVALID_ARGUMENT" not in codes:
        raise AssertionError("docs/service.md: no status code table found")
    return codes | {"OK", "CANCELLED"} | set(KNOWN_UNDOCUMENTED)


# --- The metrics text format --------------------------------------------------------------------

LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def requests_total(scrape):
    """{(layer, form, code): value} of attnserve_requests_total in a scrape."""
    out = {}
    for line in scrape.splitlines():
        if not line.startswith("attnserve_requests_total{"):
            continue
        labels_text, value = line[len("attnserve_requests_total{"):].rsplit("} ", 1)
        labels = dict(LABEL.findall(labels_text))
        out[(labels.get("layer", ""), labels.get("form", ""), labels.get("code", ""))] = float(value)
    return out


# --- Raw HTTP/2: a gRPC client that never reads its answers --------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8


def h2_frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", ftype, flags, stream) + payload


def hpack_int(value, prefix_bits):
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name, value):
    """A literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def pb_varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pb_field_bytes(field, data):
    return pb_varint(field << 3 | 2) + pb_varint(len(data)) + data


def pb_field_varint(field, n):
    return pb_varint(field << 3) + pb_varint(n)


def forward_request(layer, shape, form, seed):
    """attnserve.v1.ForwardRequest {layer, form, input: Tensor {FLOAT32, shape, data}}."""
    rng = random.Random(seed)
    count = shape[0] * shape[1] * shape[2]
    values = array.array("f", (rng.uniform(-1, 1) for _ in range(count))).tobytes()
    tensor = (pb_field_varint(1, 1) + pb_field_bytes(2, b"".join(pb_varint(d) for d in shape))
              + pb_field_bytes(3, values))
    return pb_field_bytes(1, layer.encode()) + pb_field_varint(2, form) + pb_field_bytes(3, tensor)


class StalledReader:
    """One HTTP/2 connection: sends `calls` gRPC Forward calls (reading only what it needs to
    send them: SETTINGS, WINDOW_UPDATE, PING), then never reads again, so the server's answers
    stall in flow control. Kept open until the server has drained."""

    def __init__(self, port, layer, shape, calls):
        self.port, self.layer, self.shape, self.calls = port, layer, shape, calls
        self.sock = None
        self.sent = 0
        self.response_bytes = 0  # answer bytes that arrived while it still read
        self.events = []

    def start(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.sock = s
        s.sendall(H2_PREFACE + h2_frame(SETTINGS, 0, 0))
        self.conn_window, self.initial_window, self.max_frame = 65535, 65535, 16384
        self.windows = {}
        self.buffer = b""
        for i in range(self.calls):
            sid = 1 + 2 * i
            body = forward_request(self.layer, self.shape, 1, seed=i)
            headers = b"".join(hpack_literal(k, v) for k, v in (
                (b":method", b"POST"), (b":scheme", b"http"),
                (b":path", b"/attnserve.v1.AttentionService/Forward"),
                (b":authority", f"127.0.0.1:{self.port}".encode()), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), (b"grpc-timeout", b"300S")))
            s.sendall(h2_frame(HEADERS, 0x4, sid, headers))  # END_HEADERS
            self.windows[sid] = self.initial_window
            message = b"\x00" + struct.pack(">I", len(body)) + body
            offset = 0
            while offset < len(message):
                n = min(len(message) - offset, self.max_frame, self.conn_window, self.windows[sid])
                if n <= 0:
                    self.read_frame()
                    continue
                last = offset + n == len(message)
                s.sendall(h2_frame(DATA, 0x1 if last else 0, sid, message[offset:offset + n]))  # END_STREAM
                offset += n
                self.conn_window -= n
                self.windows[sid] -= n
            self.sent += 1
        # From here on, nothing is read: the answers stall once 64 KiB have arrived.

    def read_frame(self):
        while len(self.buffer) < 9:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the server closed the stalled reader's connection while it sent")
            self.buffer += chunk
        length = int.from_bytes(self.buffer[:3], "big")
        while len(self.buffer) < 9 + length:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the server closed the stalled reader's connection while it sent")
            self.buffer += chunk
        ftype, flags, sid = self.buffer[3], self.buffer[4], int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
        payload = self.buffer[9:9 + length]
        self.buffer = self.buffer[9 + length:]
        if ftype == SETTINGS and not flags & 0x1:
            for k in range(0, len(payload), 6):
                ident, value = struct.unpack(">HI", payload[k:k + 6])
                if ident == 0x4:  # INITIAL_WINDOW_SIZE
                    for stream in self.windows:
                        self.windows[stream] += value - self.initial_window
                    self.initial_window = value
                elif ident == 0x5:  # MAX_FRAME_SIZE
                    self.max_frame = value
            self.sock.sendall(h2_frame(SETTINGS, 0x1, 0))
        elif ftype == WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.conn_window += increment
            elif sid in self.windows:
                self.windows[sid] += increment
        elif ftype == PING and not flags & 0x1:
            self.sock.sendall(h2_frame(PING, 0x1, 0, payload))
        elif ftype == GOAWAY:
            raise AssertionError(f"GOAWAY on the stalled reader's connection: {payload[8:]!r}")
        elif ftype in (DATA, HEADERS):
            self.response_bytes += length
        elif ftype == RST_STREAM:
            self.events.append(f"RST_STREAM on stream {sid}")

    def close(self):
        if self.sock is not None:
            self.sock.close()


def open_idle_http2(port):
    """An HTTP/2 connection that sends its preface and SETTINGS, then nothing, and never reads."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(H2_PREFACE + h2_frame(SETTINGS, 0, 0))
    return s


def closed_by_peer(sock):
    """True when the peer closed `sock` (reads what is pending without blocking)."""
    try:
        while True:
            ready, _, _ = select.select([sock], [], [], 0)
            if not ready:
                return False
            if not sock.recv(1 << 20):
                return True
    except OSError:
        return True


# --- Slowloris on the metrics port ---------------------------------------------------------------

class Slowloris(threading.Thread):
    """Sends a never-ending HTTP request one byte every 0.5 s; reconnects when the server hangs up."""

    def __init__(self, port, stop_event):
        super().__init__(daemon=True)
        self.port, self.stop_event = port, stop_event
        self.connections = 0
        self.lifetimes = []   # seconds each connection lasted until the server closed it
        self.answers = set()  # first line of anything the server sent back

    def run(self):
        payload = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + basic_auth().encode()
                   + b"\r\nX-Slow: " + b"a" * 1000000)
        while not self.stop_event.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                self.stop_event.wait(0.5)
                continue
            self.connections += 1
            opened = time.monotonic()
            closed = False
            for i in range(len(payload)):
                if self.stop_event.is_set():
                    break
                try:
                    ready, _, _ = select.select([s], [], [], 0)
                    if ready:
                        data = s.recv(4096)
                        if not data:
                            closed = True
                            break
                        self.answers.add(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                    s.send(payload[i:i + 1])
                except OSError:
                    closed = True
                    break
                self.stop_event.wait(0.5)
            if closed:
                self.lifetimes.append(time.monotonic() - opened)
            s.close()


# --- RSS ----------------------------------------------------------------------------------------

def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise OSError(f"no VmRSS for {pid}")


class RssSampler(threading.Thread):
    """VmRSS of the server every second, and the CPU time it used."""

    def __init__(self, pid, stop_event):
        super().__init__(daemon=True)
        self.pid, self.stop_event = pid, stop_event
        self.samples = []  # (monotonic time, MiB)
        self.cpu = []      # (monotonic time, CPU seconds: user + system)

    def run(self):
        ticks = os.sysconf("SC_CLK_TCK")
        while not self.stop_event.is_set():
            try:
                self.samples.append((time.monotonic(), rss_mib(self.pid)))
                with open(f"/proc/{self.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    self.cpu.append((time.monotonic(), (int(fields[11]) + int(fields[12])) / ticks))
            except OSError:
                return
            self.stop_event.wait(1.0)


def slope_per_minute(points):
    """Least-squares slope of [(seconds, MiB)] in MiB/min (reported for the raw samples)."""
    n = len(points)
    if n < 3:
        return float("nan")
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 60.0


def robust_slope_per_minute(points):
    """Theil-Sen slope of [(seconds, MiB)] in MiB/min: the median of the slopes between every
    pair of points. A leak moves every pair; a one-time step (an allocator arena that grew once
    and stays flat after) moves only the pairs across it, and at the ends of the window those are
    a minority, where least squares read a flat 8 MiB step as 6.7 MiB/min."""
    pairs = sorted((v2 - v1) / (t2 - t1) * 60.0
                   for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:] if t2 > t1)
    if len(points) < 3 or not pairs:
        return float("nan")
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2


# --- The run ------------------------------------------------------------------------------------

class Soak:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="attnserve_soak_")
        self.server = self.prometheus = None
        self.logs = []
        self.failures = []
        self.figures = {"load_seconds": SECONDS, "binary": BINARY}

    def check(self, ok, what):
        if not ok:
            self.failures.append(what)
            log("FAIL: " + what)
        return ok

    def open_log(self, name):
        f = open(os.path.join(self.dir, name), "w")
        self.logs.append(f)
        return f

    def log_tail(self, name, chars=4000):
        try:
            return read(os.path.join(self.dir, name))[-chars:]
        except OSError:
            return "(no log)"

    def cli(self, *args):
        return subprocess.run([CLI, "--target", self.target, "--timeout-ms", "30000", "--admin-token", ADMIN_TOKEN,
                               *args], capture_output=True, text=True, timeout=60)

    def start_server(self):
        models = os.path.join(self.dir, "models")
        os.makedirs(models)
        shutil.copy(MODEL, models)
        web_config = os.path.join(self.dir, "web.yml")
        with open(web_config, "w") as f:
            f.write(f"basic_auth_users:\n  {SCRAPE_USER}: '{bcrypt_hash(SCRAPE_PASSWORD)}'\n")
        port_file, metrics_port_file = os.path.join(self.dir, "port"), os.path.join(self.dir, "metrics_port")
        cmd = [BINARY, "--listen", "127.0.0.1:0", "--port-file", port_file,
               "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", metrics_port_file,
               "--metrics-web-config", web_config, "--admin-token", ADMIN_TOKEN, "--model-dir", models,
               "--max-memory-mb", str(MAX_MEMORY_MB), "--max-queue-requests", str(MAX_QUEUE_REQUESTS),
               "--shadow-rate", str(SHADOW_RATE), "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
               "--threads", "1", "--log-level", "info"]  # info: the drain's stages, with times
        for name, source in LAYERS.items():
            cmd += ["--layer", f"{name}={source}"]
        self.figures["server_command"] = " ".join(os.path.basename(c) if c == BINARY else c for c in cmd)
        env = dict(os.environ)
        env.pop("GLIBC_TUNABLES", None)
        if GLIBC_TUNABLES:
            env["GLIBC_TUNABLES"] = GLIBC_TUNABLES
        self.figures["server_glibc_tunables"] = GLIBC_TUNABLES
        self.server = subprocess.Popen(cmd, stdout=self.open_log("server.log"), stderr=subprocess.STDOUT,
                                       preexec_fn=die_with_parent, env=env)

        def ports():
            if self.server.poll() is not None:
                raise AssertionError(f"attnserve exited with {self.server.returncode}: " + self.log_tail("server.log"))
            if os.path.exists(port_file) and os.path.exists(metrics_port_file):
                return int(read(port_file)), int(read(metrics_port_file))
            return None
        self.port, self.metrics_port = wait_for(ports, START_TIMEOUT_S, "attnserve's port files")
        self.target = f"127.0.0.1:{self.port}"
        wait_for(lambda: self.cli("health").returncode == 0, START_TIMEOUT_S, "attnserve SERVING")
        out = self.cli("load", "gpt2", "safetensors:small.gpt2.safetensors,heads=4")
        if out.returncode != 0:
            raise AssertionError("attnserve-cli load gpt2 from the model dir: " + out.stdout + out.stderr)
        # GCC links a sanitizer's runtime as a shared library (it shows in the maps); clang links
        # it into the executable, whose symbols then hold its entry point.
        with open(f"/proc/{self.server.pid}/maps") as f:
            maps = f.read()
        with open(f"/proc/{self.server.pid}/exe", "rb") as f:
            exe = f.read()
        self.sanitized = [s for s in ("asan", "tsan", "msan")
                          if f"lib{s}" in maps or f"{s}_rtl" in maps or f"__{s}_init".encode() in exe]
        self.figures["sanitizer_runtime"] = self.sanitized

    def start_prometheus(self):
        self.prom_port = free_port()
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: attnserve\n    metrics_path: /metrics\n"
                    f"    basic_auth:\n      username: {SCRAPE_USER}\n      password: {SCRAPE_PASSWORD}\n"
                    f"    static_configs:\n      - targets: ['127.0.0.1:{self.metrics_port}']\n")
        cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
               f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn",
               "--storage.tsdb.retention.time=1d"]
        self.prometheus = subprocess.Popen(cmd, stdout=self.open_log("prometheus.log"), stderr=subprocess.STDOUT,
                                           cwd=self.dir, preexec_fn=die_with_parent)
        self.prom = f"http://127.0.0.1:{self.prom_port}"

        def ready():
            if self.prometheus.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.prometheus.returncode}: "
                                     + self.log_tail("prometheus.log"))
            return http_get(self.prom + "/-/ready") is not None
        wait_for(ready, START_TIMEOUT_S, "Prometheus ready")
        wait_for(lambda: self.query_values("up") == {(): 1.0}, 60, "the first scrape of attnserve")
        self.first_scrape = time.time()

    def query(self, promql):
        url = self.prom + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            answer = json.loads(http_get(url))
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus refused {promql!r}: {e.read().decode()}") from None
        if answer.get("status") != "success":
            raise AssertionError(f"Prometheus: {promql!r}: {answer}")
        return answer["data"]["result"]

    def query_values(self, promql):
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "instance", "job"))):
                float(r["value"][1]) for r in self.query(promql)}

    def scrape(self):
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics", auth=True)

    def run(self):
        for tool in (BINARY, CLI, CLIENT, PROMETHEUS):
            if not os.access(tool, os.X_OK):
                raise AssertionError(f"{tool} is missing: build the project and run scripts/setup")
        log(f"server {BINARY}, {SECONDS:g} s of load, folder {self.dir}")
        self.figures["load_average_1min_at_start"] = round(os.getloadavg()[0], 2)
        self.start_server()
        self.start_prometheus()
        log(f"attnserve on {self.target} (metrics {self.metrics_port}), Prometheus on {self.prom_port}")

        stop_sampling, stop_slowloris = threading.Event(), threading.Event()
        rss = RssSampler(self.server.pid, stop_sampling)
        rss.start()
        slowloris = [Slowloris(self.metrics_port, stop_slowloris) for _ in range(2)]
        for s in slowloris:
            s.start()
        idle = open_idle_http2(self.port)
        stalled = StalledReader(self.port, "slowread", STALLED_SHAPE, STALLED_CALLS)
        stalled.start()

        load_start = time.monotonic()
        clients = []
        for role, seed, concurrency in CLIENTS:
            name = f"{role}-{seed}"
            cmd = [CLIENT, "--target", self.target, "--role", role, "--seed", str(seed), "--concurrency",
                   str(concurrency), "--duration-s", str(SECONDS), "--admin-token", ADMIN_TOKEN,
                   "--model-file", "small.gpt2.safetensors", "--pause-file", os.path.join(self.dir, name + ".paused")]
            out, err = self.open_log(name + ".json"), self.open_log(name + ".log")
            clients.append((name, subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=die_with_parent)))
        log(f"{len(clients)} clients started; the stalled reader sent {stalled.sent} calls")

        if not self.sanitized:  # a sanitizer's RSS says nothing, and its server drains a pause slowly
            self.quiet_points(clients, load_start)

        results = {}
        for name, proc in clients:
            try:
                rc = proc.wait(timeout=SECONDS + 150)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            try:
                lines = [l for l in read(os.path.join(self.dir, name + ".json")).splitlines() if l.strip()]
                results[name] = json.loads(lines[-1])
            except (OSError, ValueError, IndexError):
                results[name] = None
            self.check(rc == 0, f"client {name} exited with {rc}: {self.log_tail(name + '.log', 1500)}")
        load_end = time.monotonic()
        stop_sampling.set()
        rss.join()
        stop_slowloris.set()
        for s in slowloris:
            s.join(timeout=5)
        log(f"load ended after {load_end - load_start:.1f} s")
        self.check(self.server.poll() is None, f"attnserve died during the load: {self.log_tail('server.log')}")

        # The server's own scrape, then Prometheus after one more scrape of its own.
        server_scrape = self.scrape()
        scraped_at = time.time()
        server_counts = requests_total(server_scrape)
        wait_for(lambda: self.query_values("timestamp(up)").get((), 0) > scraped_at + 0.5, 30,
                 "a Prometheus scrape after the server's own")
        prom_counts = {(dict(k).get("layer", ""), dict(k).get("form", ""), dict(k).get("code", "")): v
                       for k, v in self.query_values("attnserve_requests_total").items()}
        window = max(1, int(time.time() - self.first_scrape))
        up_min = self.query_values(f"min_over_time(up[{window}s])").get(())
        scrapes = self.query_values(f"count_over_time(up[{window}s])").get(())
        scrape_max = self.query_values(f"max_over_time(scrape_duration_seconds[{window}s])").get(())
        idle_closed = closed_by_peer(idle)

        # The drain, with the stalled reader's answers still stuck.
        self.server.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        try:
            drain_rc = self.server.wait(timeout=DRAIN_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            drain_rc = "killed after %d s" % (DRAIN_TIMEOUT_S + 30)
        drain_s = time.monotonic() - sigterm_at
        stalled.close()
        idle.close()
        stop(self.prometheus)

        self.evaluate(results, server_counts, prom_counts, rss.samples, rss.cpu, load_start, load_end, up_min, scrapes,
                      scrape_max, window, slowloris, stalled, idle_closed, drain_rc, drain_s)

    def server_idle(self):
        """What the server holds by design when it has answered every call and holds no memory
        reservation (shadows included), in MiB, from its own /metrics: the layers' weights and
        the scratch the backend keeps for reuse (attnserve_backend_retained_bytes, which grows
        in steps as larger batches come); None while it is busy."""
        values = {}
        retained = 0.0
        for line in self.scrape().splitlines():
            if line.startswith("attnserve_backend_retained_bytes "):
                retained = float(line.rsplit(" ", 1)[1])
            for name in ("attnserve_inflight_requests", "attnserve_memory_reserved_bytes", "attnserve_layer_bytes"):
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    values[name] = values.get(name, 0) + float(line.rsplit(" ", 1)[1])
        if len(values) < 3 or values["attnserve_inflight_requests"] or values["attnserve_memory_reserved_bytes"]:
            return None
        return (values["attnserve_layer_bytes"] + retained) / (1 << 20)

    def quiet_points(self, clients, load_start):
        """QUIET_POINTS times during the load: pauses every client (SIGUSR1: no new calls, those
        in flight end and are read; each acknowledges in its pause file once none is in flight,
        the admin client between two admin calls), waits until the server is idle (shadows),
        records its RSS (what it retains), and resumes the clients (SIGUSR2)."""
        self.quiet = []  # (seconds into the load, RSS MiB, held by design MiB, seconds the pause took)
        every = SECONDS / (QUIET_POINTS + 1)
        for k in range(1, QUIET_POINTS + 1):
            time.sleep(max(0.0, load_start + k * every - time.monotonic()))
            running = [p for _, p in clients if p.poll() is None]
            if len(running) < len(clients):
                return
            paused = time.monotonic()
            for p in running:
                p.send_signal(signal.SIGUSR1)
            try:
                def acknowledged():
                    for name, p in clients:
                        if p.poll() is None:
                            try:
                                if read(os.path.join(self.dir, name + ".paused")).strip() != str(k):
                                    return False
                            except OSError:
                                return False
                    return True
                try:
                    wait_for(acknowledged, 60, f"every client paused (quiet point {k})")
                except AssertionError as e:
                    self.check(False, str(e))
                    return
                try:
                    weights = wait_for(lambda: (lambda w: None if w is None else [w])(self.server_idle()), 30,
                                       "the server idle while the clients are paused")[0]
                except AssertionError as e:
                    self.check(False, str(e))
                    return
                time.sleep(0.3)  # the last answers leave the server's buffers
                values = []
                for _ in range(3):
                    values.append(rss_mib(self.server.pid))
                    time.sleep(0.2)
                self.quiet.append((paused - load_start, min(values), weights, time.monotonic() - paused))
            finally:
                for p in running:
                    if p.poll() is None:
                        p.send_signal(signal.SIGUSR2)

    def evaluate(self, results, server_counts, prom_counts, samples, cpu_samples, load_start, load_end, up_min, scrapes,
                 scrape_max, window, slowloris, stalled, idle_closed, drain_rc, drain_s):
        documented = documented_codes()
        f = self.figures
        f["load_seconds_measured"] = round(load_end - load_start, 1)
        f["clients"] = {}
        mix_codes, mix_ok, chaos_codes = {}, {}, {}
        for name, r in results.items():
            if not self.check(r is not None and r.get("final"), f"client {name}: no final JSON summary"):
                continue
            codes = r["codes"]
            f["clients"][name] = {"sent": r["sent"], "codes": codes}
            self.check(r["in_flight"] == 0, f"client {name}: {r['in_flight']} calls never ended")
            self.check(r["sent"] == r["ended"] == sum(codes.values()),
                       f"client {name}: sent {r['sent']}, ended {r['ended']}, codes sum to {sum(codes.values())}")
            undocumented = set(codes) - documented
            self.check(not undocumented, f"client {name}: undocumented status codes {sorted(undocumented)}")
            for kind, k in r.get("kinds", {}).items():
                unexpected = {c: n for c, n in k["codes"].items() if c not in k["allowed"]}
                self.check(not unexpected, f"client {name}, {kind}: unexpected codes {unexpected} "
                                           f"(first messages: {k['first_message']})")
            for step, k in r.get("steps", {}).items():
                unexpected = {c: n for c, n in k["codes"].items() if c != k["expected"]}
                self.check(not unexpected, f"client {name}, admin step '{step}': expected {k['expected']}, "
                                           f"got {unexpected} ({k['first_message']})")
            self.check(r.get("wrong_outputs", 0) == 0,
                       f"client {name}: {r.get('wrong_outputs')} wrong answers: {r.get('wrong_output_notes')}")
            role = r["role"]
            for c, n in codes.items():
                if role == "mix":
                    mix_codes[c] = mix_codes.get(c, 0) + n
                elif role == "chaos":
                    chaos_codes[c] = chaos_codes.get(c, 0) + n
            if role == "mix":
                for key, n in r["ok_by_layer_form"].items():
                    mix_ok[key] = mix_ok.get(key, 0) + n
                for kind in NOT_COUNTED_KINDS & set(r["kinds"]):
                    for c, n in r["kinds"][kind]["codes"].items():
                        mix_codes[c] -= n
                        f.setdefault("not_counted_by_the_server", {})[c] = (
                            f.setdefault("not_counted_by_the_server", {}).get(c, 0) + n)
        forward_codes = {}
        for r in results.values():
            if r and r["role"] != "admin":
                for c, n in r["codes"].items():
                    forward_codes[c] = forward_codes.get(c, 0) + n
        f["forward_calls_by_code"] = dict(sorted(forward_codes.items()))
        f["forward_calls"] = sum(forward_codes.values())
        f["kinds"] = {}
        for name, r in results.items():
            for kind, k in (r or {}).get("kinds", {}).items():
                agg = f["kinds"].setdefault(kind, {"sent": 0, "codes": {}, "first_message": {}, "message_kinds": {}})
                agg["sent"] += k["sent"]
                for c, n in k["codes"].items():
                    agg["codes"][c] = agg["codes"].get(c, 0) + n
                for c, m in k["first_message"].items():
                    agg["first_message"].setdefault(c, m)
                for c, kinds in k.get("message_kinds", {}).items():
                    for text, n in kinds.items():
                        agg["message_kinds"].setdefault(c, {})
                        agg["message_kinds"][c][text] = agg["message_kinds"][c].get(text, 0) + n
            if (r or {}).get("chaos_modes"):
                f["chaos_modes"] = {m: {"sent": t["sent"], "codes": t["codes"]} for m, t in r["chaos_modes"].items()}
            if (r or {}).get("steps"):
                f["admin_steps"] = {s: {"sent": t["sent"], "codes": t["codes"]} for s, t in r["steps"].items()}

        # The server's counts against the clients'.
        def server_sum(pred):
            out = {}
            for (layer, form, code), v in server_counts.items():
                if pred(layer, form, code):
                    out[code] = out.get(code, 0) + int(v)
            return out
        server_mix = {c: n for c, n in server_sum(lambda layer, form, code: layer not in ("chaos", "slowread")).items()
                      if n}
        self.check(server_mix == {c: n for c, n in mix_codes.items() if n},
                   f"requests_total per code (layers of the mix clients) {server_mix} != the mix clients' {mix_codes}")
        server_ok = {f"{layer}/{form}": int(v) for (layer, form, code), v in server_counts.items()
                     if code == "OK" and v and layer not in ("chaos", "slowread")}
        self.check(server_ok == mix_ok, f"OK per layer/form on the server {server_ok} != the mix clients' {mix_ok}")
        server_chaos = server_sum(lambda layer, form, code: layer == "chaos")
        early = ("CANCELLED", "DEADLINE_EXCEEDED")
        for code in set(server_chaos) | set(chaos_codes):
            if code not in early:
                self.check(server_chaos.get(code, 0) >= chaos_codes.get(code, 0),
                           f"chaos layer: the server counted {server_chaos.get(code, 0)} {code}, "
                           f"the client saw {chaos_codes.get(code, 0)}")
        self.check(sum(server_chaos.values()) <= sum(chaos_codes.values()),
                   f"chaos layer: the server counted {sum(server_chaos.values())} calls, the client sent "
                   f"{sum(chaos_codes.values())}")
        self.check(sum(server_chaos.get(c, 0) for c in early) <= sum(chaos_codes.get(c, 0) for c in early),
                   f"chaos layer: server CANCELLED + DEADLINE_EXCEEDED {server_chaos} > the client's {chaos_codes}")
        f["server_requests_total_by_code"] = dict(sorted(server_sum(lambda *_: True).items()))
        f["server_chaos_by_code"] = server_chaos
        f["chaos_never_reached_the_handler"] = sum(chaos_codes.values()) - sum(server_chaos.values())
        server_stalled = server_sum(lambda layer, form, code: layer == "slowread")
        f["stalled_reader"] = {"calls": stalled.sent, "server_codes": server_stalled,
                               "answer_bytes_received_while_sending": stalled.response_bytes,
                               "events": stalled.events, "idle_http2_connection_closed_by_server": idle_closed}
        self.check(sum(server_stalled.values()) == stalled.sent,
                   f"the stalled reader sent {stalled.sent} calls, the server counted {server_stalled}")

        # Prometheus against the server's own scrape.
        self.check(prom_counts == server_counts,
                   "Prometheus's attnserve_requests_total differs from the server's scrape: " + str(
                       {k: (prom_counts.get(k), server_counts.get(k)) for k in set(prom_counts) | set(server_counts)
                        if prom_counts.get(k) != server_counts.get(k)}))
        f["prometheus_ok_equals_server"] = {f"{l}/{fo}": v for (l, fo, c), v in prom_counts.items() if c == "OK"}

        # Scrapes.
        f["scrapes"] = {"window_s": window, "count": scrapes, "min_up": up_min, "max_scrape_duration_s": scrape_max}
        self.check(up_min == 1.0, f"a Prometheus scrape failed: min_over_time(up[{window}s]) = {up_min}")
        self.check(scrapes is not None and scrapes >= 0.8 * window, f"only {scrapes} scrapes in {window} s")
        f["slowloris"] = {"connections": sum(s.connections for s in slowloris),
                          "closed_by_server_after_s": sorted(round(t, 1) for s in slowloris for t in s.lifetimes),
                          "answers": sorted(set().union(*(s.answers for s in slowloris)))}
        self.check(all(s.connections >= 1 for s in slowloris), "a slowloris thread never connected")

        # RSS. Under load it swings with what is in flight; the quiet points are what the server
        # retains, and their slope over the second half is the leak measure.
        rel = [(t - load_start, v) for t, v in samples if load_start <= t <= load_end]
        half = [(t, v) for t, v in rel if t >= SECONDS / 2]
        quiet = getattr(self, "quiet", [])
        # RSS less the weights of the layers loaded then (the admin client's 80 MB layer comes and goes).
        quiet_half = [(t, v - w) for t, v, w, _ in quiet if t >= SECONDS / 2]
        slope = robust_slope_per_minute(quiet_half)
        f["rss_mib"] = {"samples": len(rel), "at_load_start": round(rel[0][1], 1) if rel else None,
                        "at_end": round(rel[-1][1], 1) if rel else None,
                        "max": round(max(v for _, v in rel), 1) if rel else None,
                        "slope_all_samples_second_half_mib_per_min": round(slope_per_minute(half), 3),
                        # [seconds into the load, RSS, weights, RSS - weights, seconds the pause took]
                        "quiet_points": [[round(t, 1), round(v, 1), round(w, 1), round(v - w, 1), round(d, 1)]
                                         for t, v, w, d in quiet],
                        "slope_quiet_second_half_mib_per_min": round(slope, 3),
                        "least_squares_slope_quiet_second_half_mib_per_min": round(slope_per_minute(quiet_half), 3),
                        "bound_mib_per_min": RSS_SLOPE_BOUND, "asserted": not self.sanitized,
                        "trace": [[round(t, 1), round(v, 1)] for t, v in rel]}
        f["quiet_seconds_total"] = round(sum(d for _, _, _, d in quiet), 1)
        cpu = [(t, c) for t, c in cpu_samples if load_start <= t <= load_end]
        if len(cpu) >= 2:
            f["server_cpu_share_of_one_core"] = round((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]), 2)
        f["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        if self.sanitized:
            log(f"RSS slope {slope:.3f} MiB/min reported, not asserted: the server runs {self.sanitized}")
        else:
            self.check(len(quiet_half) >= QUIET_POINTS // 2 - 1 and slope < RSS_SLOPE_BOUND,
                       f"the idle RSS grows {slope:.3f} MiB/min over the second half ({len(quiet_half)} quiet "
                       f"points: {quiet_half}), bound {RSS_SLOPE_BOUND} MiB/min")

        # The drain.
        f["drain"] = {"exit_status": drain_rc, "seconds": round(drain_s, 2), "drain_timeout_s": DRAIN_TIMEOUT_S}
        self.check(drain_rc == 0, f"attnserve exited with {drain_rc} after SIGTERM: {self.log_tail('server.log')}")
        # The stalled reader's answers hold the drain to its deadline; stopping takes ~1 s more.
        self.check(drain_s <= DRAIN_TIMEOUT_S + DRAIN_MARGIN_S,
                   f"the drain took {drain_s:.1f} s (--drain-timeout-s {DRAIN_TIMEOUT_S} + {DRAIN_MARGIN_S} s); "
                   f"the server's last lines: {self.log_tail('server.log', 800)}")
        server_log = read(os.path.join(self.dir, "server.log"))
        f["server_log"] = {"lines": server_log.count("\n"),
                           "error_lines": [l[:300] for l in server_log.splitlines()
                                           if re.search(r"\b(error|critical)\b", l, re.I)][:20]}
        self.check("unexpected exception" not in server_log, "the server logged an unexpected exception")

    def close(self):
        stop(self.prometheus)
        stop(self.server)
        for f in self.logs:
            f.close()
        if KEEP or self.failures:
            log(f"logs kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def main():
    soak = Soak()
    try:
        soak.run()
    except AssertionError as e:
        soak.failures.append(str(e))
        log("FAIL: " + str(e))
    finally:
        soak.close()
    report = json.dumps(soak.figures, indent=1, default=str)
    print(report)
    if REPORT:
        with open(REPORT, "w") as f:
            f.write(report + "\n")
    if soak.failures:
        print(f"\nsoak: {len(soak.failures)} failed checks:", file=sys.stderr)
        for failure in soak.failures:
            print("  - " + failure[:3000], file=sys.stderr)
        return 1
    print("\nsoak: every check passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
