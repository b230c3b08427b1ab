"""`troupe serve`: API keys, GET /metrics (Prometheus text format 0.0.4) and --config.

The metrics are checked against what the client itself saw: usage.prompt_tokens and
completion_tokens of each response, the status codes it received, the number of generations it
ran. The exposition is parsed by a small strict parser written here from the format's spec.
"""

import http.client
import json
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from serve_util import MODEL, ROOT, TROUPE, free_port, stop  # noqa: E402,F401
API_KEY, ADMIN_KEY = "k1", "adm"

pytestmark = pytest.mark.skipif(not (pathlib.Path(TROUPE).exists() and MODEL.exists()),
                                reason="needs build/troupe and models/default.gguf")



def request(port, method, path, body=None, key=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, ctype, (json.loads(raw) if raw and "json" in ctype else raw.decode())


def start_server(args, stderr_path):
    """Starts `troupe serve --port 0 ...` (unless args name a port) and returns (proc, port)."""
    err = open(stderr_path, "w")
    proc = subprocess.Popen([TROUPE, "serve", "-t", "2", *args], stdout=subprocess.PIPE, stderr=err, text=True)
    err.close()
    deadline = time.monotonic() + 60
    line = proc.stdout.readline()  # "troupe serve: listening on http://HOST:PORT (model ...)"
    m = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        proc.kill()
        proc.wait()
        pytest.fail(f"troupe serve did not start: {line!r} {pathlib.Path(stderr_path).read_text()}")
    port = int(m.group(1))
    while time.monotonic() < deadline:
        try:
            if request(port, "GET", "/health", timeout=2)[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("troupe serve did not answer /health")


stop_server = stop


# --- a strict parser of the Prometheus text exposition format 0.0.4 -------------------------------

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ([-+]?(?:[0-9.eE+-]+|Inf|NaN))$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """-> ({(name, frozenset(labels)): value}, {family: type}). Asserts the format's rules: HELP
    and TYPE before a family's samples, each family once, histogram buckets cumulative and ending
    in +Inf equal to _count."""
    samples, types, seen_families = {}, {}, []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, fam, typ = line.split(" ")
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert fam not in types, f"family {fam} declared twice"
            types[fam] = typ
            seen_families.append(fam)
            continue
        assert line and not line.startswith("#"), f"unexpected line {line!r}"
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels_text, value = m.group(1), m.group(3) or "", m.group(4)
        labels = dict(LABEL.findall(labels_text))
        assert ",".join(f'{k}="{v}"' for k, v in labels.items()) == labels_text, line
        fam = re.sub(r"_(bucket|sum|count)$", "", name) if re.sub(r"_(bucket|sum|count)$", "", name) in types else name
        assert fam == seen_families[-1], f"{name} outside its family's block"
        if types[fam] == "counter":
            assert name.endswith("_total"), name
        key = (name, frozenset(labels.items()))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)
    for fam, typ in types.items():
        if typ != "histogram":
            continue
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == fam + "_bucket"))
        assert buckets and math.isinf(buckets[-1][0]), fam
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{fam} buckets not cumulative"
        assert buckets[-1][1] == samples[(fam + "_count", frozenset())]
        assert samples[(fam + "_sum", frozenset())] >= 0
    return samples, types


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(port):
    status, ctype, text = request(port, "GET", "/metrics", key=ADMIN_KEY)
    assert status == 200
    assert ctype.startswith("text/plain; version=0.0.4")
    return parse_prometheus(text)[0]


# --- the server with keys -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, port = start_server(["--port", "0", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY],
                              tmp_path_factory.mktemp("srv") / "stderr.txt")
    yield port
    stop_server(proc)


COMPLETION = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def test_refused_without_a_valid_key_and_no_model_work(server):
    before = scrape(server)
    for key in (None, "wrong", API_KEY + "x", API_KEY[:-1], ""):
        status, _, body = request(server, "POST", "/v1/completions", COMPLETION, key=key)
        assert status == 401, key
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    after = scrape(server)
    assert value(after, "troupe_requests_total", code="401") - value(before, "troupe_requests_total", code="401") == 5
    for name, labels in (("troupe_prompt_tokens_total", {}), ("troupe_generation_tokens_total", {}),
                         ("troupe_scheduler_steps_total", {"model": "default"}), ("troupe_time_to_first_token_seconds_count", {})):
        assert (name, frozenset(labels.items())) in after, name
        assert value(after, name, **labels) == value(before, name, **labels), name


def test_key_checked_before_the_body_is_read(server):
    # Headers only, announcing a body that never comes: the 401 must arrive without it.
    with socket.create_connection(("127.0.0.1", server), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n")
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 401")


def test_open_and_admin_endpoints(server):
    assert request(server, "GET", "/health")[0] == 200
    assert request(server, "GET", "/metrics")[0] == 401
    assert request(server, "GET", "/metrics", key=API_KEY)[0] == 401  # an admin key is configured
    assert request(server, "GET", "/v1/models", key=API_KEY)[0] == 200
    assert request(server, "GET", "/v1/models", key=ADMIN_KEY)[0] == 200  # admin keys work everywhere
    assert request(server, "GET", "/v1/models")[0] == 401
    # The scheme is case-insensitive (RFC 9110); the key is not.
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    for auth, want in (("bearer " + API_KEY, 200), ("BEARER " + API_KEY, 200), ("Bearer " + API_KEY.upper(), 401),
                       ("Basic " + API_KEY, 401), (API_KEY, 401)):
        conn.request("GET", "/v1/models", headers={"Authorization": auth})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == want, auth
        if want == 401:  # the connection closes after a refusal
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    conn.close()


def stream_completion(port, body):
    """A streaming completion with usage; returns the usage chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + API_KEY})
    resp = conn.getresponse()
    assert resp.status == 200
    usage = None
    for raw in resp.read().decode().split("\n\n"):
        if raw.startswith("data: ") and raw != "data: [DONE]":
            chunk = json.loads(raw[6:])
            usage = chunk.get("usage") or usage
    conn.close()
    return usage


def test_metrics_reflect_the_requests(server):
    before = scrape(server)
    t0 = time.monotonic()
    usages = []
    for prompt, n in (("The capital of France is", 3), ("One, two, three,", 6), ("Hello", 1)):
        status, _, body = request(server, "POST", "/v1/completions", {**COMPLETION, "prompt": prompt, "max_tokens": n}, key=API_KEY)
        assert status == 200
        usages.append(body["usage"])
    usages.append(stream_completion(server, {**COMPLETION, "max_tokens": 5, "stream": True,
                                             "stream_options": {"include_usage": True}}))
    status, _, _ = request(server, "POST", "/v1/completions", {**COMPLETION, "max_tokens": -1}, key=API_KEY)
    assert status == 400
    elapsed = time.monotonic() - t0
    after = scrape(server)

    d = lambda name, **lb: value(after, name, **lb) - value(before, name, **lb)  # noqa: E731
    assert d("troupe_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("troupe_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert d("troupe_requests_total", code="200") == 4 + 1  # the requests and the first scrape
    assert d("troupe_requests_total", code="400") == 1
    for h in ("troupe_time_to_first_token_seconds", "troupe_e2e_request_latency_seconds", "troupe_request_queue_time_seconds"):
        assert d(h + "_count") == 4, h
        assert 0 < d(h + "_sum") <= elapsed, h
    # One gap per token after the first (each generation ran to its length, so every token came as an event).
    assert d("troupe_inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    # The engine's figures carry the model's name (one series per model served).
    m = {"model": "default"}
    assert d("troupe_scheduler_steps_total", **m) > 0
    # Engine gauges at rest: nothing running, the pool's size consistent.
    assert value(after, "troupe_num_requests_running", **m) == 0 and value(after, "troupe_num_requests_waiting", **m) == 0
    total = value(after, "troupe_kv_blocks_total", **m)
    assert total > 0
    assert 0 <= value(after, "troupe_kv_blocks_used", **m) + value(after, "troupe_kv_blocks_cached", **m) <= total
    assert ("troupe_preemptions_total", frozenset({"model": "default", "mode": "swap"}.items())) in after
    assert value(after, "troupe_engine_up", **m) == 1
    assert value(after, "troupe_executor_restarts_total", **m) == 0
    assert value(after, "troupe_models_loaded") == 1


# --- the config file --------------------------------------------------------------------------------

def test_config_file_applies_and_flags_override(tmp_path):
    port = free_port()
    cfg = tmp_path / "troupe.toml"
    cfg.write_text(f'[server]\nport = {port}\nmax_body_bytes = 100\n[auth]\napi_keys = ["filekey"]\n')
    proc, bound = start_server(["--config", str(cfg), "--max-body-bytes", "3000"], tmp_path / "stderr.txt")
    try:
        assert bound == port  # the file's port
        assert request(port, "POST", "/v1/completions", COMPLETION)[0] == 401  # the file's key
        padded = {**COMPLETION, "max_tokens": 1, "user": "x" * 1500}  # > the file's 100, < the flag's 3000
        assert request(port, "POST", "/v1/completions", padded, key="filekey")[0] == 200
        assert request(port, "POST", "/v1/completions", {**padded, "user": "x" * 4000}, key="filekey")[0] == 413
    finally:
        stop_server(proc)
    printed = (tmp_path / "stderr.txt").read_text()
    assert f"port = {port}" in printed and "max_body_bytes = 3000" in printed
    assert 'api_keys = ["***"]' in printed and "filekey" not in printed


@pytest.mark.parametrize("toml, key", [
    ("[server]\nport = 70000\n", "server.port"),
    ("[server]\nprot = 8080\n", "server.prot"),
    ("[scheduler]\nmax_num_seqs = \"many\"\n", "scheduler.max_num_seqs"),
    ("[engine]\nkv_block_size = 24\n", "engine.kv_block_size"),
])
def test_bad_config_stops_the_start(tmp_path, toml, key):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    r = subprocess.run([TROUPE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], r.stderr
    assert "listening" not in r.stdout
