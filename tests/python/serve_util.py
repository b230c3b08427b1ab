"""Starting and stopping `troupe serve` for the HTTP / WebSocket tests (bounded waits, always stopped)."""
import contextlib
import http.client
import os
import pathlib
import signal
import socket
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "default.gguf"
TROUPE = os.environ.get("TROUPE_BIN", str(ROOT / "build" / "troupe"))


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
