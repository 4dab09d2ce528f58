"""What the Python tests that run real processes share (tests/e2e, tests/soak, tests/oip):
children that die with the test, free loopback ports, waiting on a condition, stopping a
server, and the bcrypt hash of the metrics endpoint's basic auth."""

import ctypes
import signal
import socket
import subprocess
import time
import urllib.error
import warnings


def die_with_parent():
    """Runs in the child before exec: SIGTERM when this test process dies, however it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    with open(path) as f:
        return f.read()


def log_tail(path, chars=4000):
    """The last `chars` of a log file, for a failure message; "(no log)" when there is none."""
    try:
        return read(path)[-chars:]
    except OSError:
        return "(no log)"


def bcrypt_hash(password):
    """What `htpasswd -nBC 6` writes, through libxcrypt (Debian's Python still has crypt)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 6))


def stop(proc, timeout=15):
    """SIGTERM, then SIGKILL after `timeout` seconds; nothing when it has already exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def wait_for(predicate, timeout, what):
    """The first truthy value of predicate() within `timeout` seconds, polled every 0.2 s;
    connection errors count as not yet. AssertionError naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
