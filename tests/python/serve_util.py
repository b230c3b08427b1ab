"""Starting and stopping `troupe serve` for the HTTP / WebSocket tests (bounded waits, always stopped)."""
import contextlib
import http.client
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "default.gguf"
TROUPE = os.environ.get("TROUPE_BIN", str(ROOT / "build" / "troupe"))


def request(port, method, path, body=None, timeout=120):
    """(status, the JSON body, or its text when it is not JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data.decode()


def metrics(port):
    """Every troupe_* series of /metrics, keyed by name and labels as written."""
    st, text = request(port, "GET", "/metrics")
    assert st == 200
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(troupe_\w+)(\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ok(port):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(*args, start_timeout=60):
    """Yields (port, proc) for `troupe serve -t 2 ARGS` on a free loopback port, ready on /health."""
    port = free_port()
    proc = subprocess.Popen([TROUPE, "serve", "--host", "127.0.0.1", "--port", str(port), "-t", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not health_ok(port):
            if proc.poll() is not None:
                pytest.fail("troupe serve exited: " + proc.stdout.read())
            if time.monotonic() > deadline:
                pytest.fail(f"troupe serve did not answer /health within {start_timeout} s")
            time.sleep(0.1)
        yield port, proc
    finally:
        stop(proc)
