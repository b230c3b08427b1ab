"""Helpers the benchmark scripts share: a free port, GET, Prometheus counters, bounded waits, stopping a server."""
import http.client
import re
import signal
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read().decode()
    c.close()
    return r.status, body


def metrics(port, names):
    """The named /metrics families, each summed over its labels (0 when absent)."""
    out = dict.fromkeys(names, 0.0)
    for line in get(port, "/metrics")[1].splitlines():
        m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def metric(port, name):
    return metrics(port, [name])[name]


def wait(cond, timeout, what):
    """Polls cond() every 0.1 s (connection errors count as not yet) and exits after timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out: {what}")


def stop(proc, timeout=15):
    """SIGTERM, then SIGKILL if the process has not exited within timeout seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
