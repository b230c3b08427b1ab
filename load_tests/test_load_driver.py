"""Tests of the load driver against an in-process fake SSE server with known timings.

Run: .venv/bin/python -m pytest -q load_tests/test_load_driver.py
"""
from __future__ import annotations

import asyncio
import http.server
import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_driver  # noqa: E402
from load_http import ChunkedDecoder, HttpError, Target  # noqa: E402
from load_prompts import parse_mix  # noqa: E402

FIRST_DELAY_S = 0.05
GAP_S = 0.02


class FakeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        srv = self.server
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.connections.add(self.client_address)
        if self.path == "/tokenize":
            if not srv.has_tokenize:
                return self._json(404, {"error": "no such endpoint"})
            return self._json(200, {"tokens": list(range(len(req["content"].split())))})
        srv.bodies.append(req)
        if srv.mode == "error500":
            return self._json(500, {"error": {"message": "boom"}})
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            self._stream(srv, req["max_tokens"])
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _stream(self, srv, n_tokens: int) -> None:
        chunked = srv.mode != "close"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

        def send(data: bytes) -> None:
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                self.wfile.write(data)
            self.wfile.flush()

        time.sleep(FIRST_DELAY_S)
        for i in range(n_tokens):
            if i:
                time.sleep(GAP_S)
            ev = {"choices": [{"text": f" w{i}", "index": 0, "finish_reason": None}]}
            send(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if srv.mode == "cut" and i == 1:
                self.close_connection = True
                return                    # no terminating chunk, no [DONE]
        final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                 "usage": {"completion_tokens": n_tokens}}
        send(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        if srv.mode == "drop":
            self.close_connection = True      # closes despite keep-alive, as llama-server does


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    srv.daemon_threads = True
    srv.mode = "chunked"
    srv.has_tokenize = True
    srv.lock = threading.Lock()
    srv.in_flight = srv.max_in_flight = 0
    srv.connections = set()
    srv.bodies = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run(srv, **kw) -> dict:
    cfg = load_driver.LoadConfig(url=f"http://127.0.0.1:{srv.server_address[1]}", **kw)
    return asyncio.run(load_driver.run_load(cfg))


def test_closed_loop_counts_and_timings(server):
    s = run(server, concurrency=4, requests=8, mix="16:5")
    assert (s["requests"], s["ok"], s["errors"]) == (8, 8, 0)
    assert s["generated_tokens"] == 40 and s["token_events"] == 40
    assert s["short_requests"] == 0
    assert server.max_in_flight == 4
    assert len(server.connections) == 4 + 1   # keep-alive: one per stream, one for /tokenize
    assert FIRST_DELAY_S * 1000 <= s["ttft_p50_ms"] < FIRST_DELAY_S * 1000 + 60
    assert GAP_S * 1000 * 0.9 <= s["itl_p50_ms"] < GAP_S * 1000 + 20
    e2e_min = (FIRST_DELAY_S + 4 * GAP_S) * 1000
    assert e2e_min <= s["e2e_p50_ms"] < e2e_min + 80
    # Two rounds of 4 parallel requests: wall ~ 2 x e2e, so ~40 tokens / (2 x 0.13 s).
    assert 0.5 * 40 / (2 * e2e_min / 1000) < s["tokens_per_s"] <= 40 / (2 * e2e_min / 1000)


def test_request_body_and_prompt_lengths(server):
    s = run(server, concurrency=2, requests=4, mix="10:3,20:2")
    assert s["prompt_tokens"] == 10 + 20 + 10 + 20     # fake /tokenize counts words
    assert [b["max_tokens"] for b in server.bodies] == [3, 2, 3, 2] or \
        sorted(b["max_tokens"] for b in server.bodies) == [2, 2, 3, 3]
    b = server.bodies[0]
    assert b["stream"] is True and b["temperature"] == 0 and b["ignore_eos"] is True
    assert b["n_predict"] == b["max_tokens"]
    assert len({b["prompt"] for b in server.bodies}) == 4      # distinct prompts


def test_plain_openai_and_estimated_lengths(server):
    server.has_tokenize = False
    s = run(server, concurrency=1, requests=2, mix="12:2", plain_openai=True)
    assert s["ok"] == 2 and s["prompt_tokens"] == 24           # estimate: one token per word
    assert "ignore_eos" not in server.bodies[0] and "n_predict" not in server.bodies[0]
    assert len(server.bodies[0]["prompt"].split()) == 12


def test_close_delimited_body(server):
    server.mode = "close"
    s = run(server, concurrency=2, requests=4, mix="8:3")
    assert (s["ok"], s["generated_tokens"]) == (4, 12)
    assert len(server.connections) == 4 + 1           # one per request, plus the /tokenize one


def test_server_closing_kept_alive_connection(server):
    server.mode = "drop"
    s = run(server, concurrency=2, requests=6, mix="8:3")
    assert (s["ok"], s["errors"], s["generated_tokens"]) == (6, 0, 18)
    assert len(server.connections) == 6 + 1


def test_http_error_is_counted(server):
    server.mode = "error500"
    s = run(server, concurrency=2, requests=3, mix="8:3")
    assert (s["ok"], s["errors"]) == (0, 3)
    assert "HTTP 500" in s["error_samples"][0] and "boom" in s["error_samples"][0]
    assert s["ttft_p50_ms"] is None and s["tokens_per_s"] == 0


def test_cut_stream_is_an_error(server):
    server.mode = "cut"
    s = run(server, concurrency=1, requests=2, mix="8:5")
    assert s["errors"] == 2 and s["ok"] == 0


def test_open_loop(server):
    s = run(server, concurrency=0, requests=10, rate=100.0, mix="8:2")
    assert (s["mode"], s["ok"], s["generated_tokens"]) == ("open", 10, 20)
    assert server.max_in_flight >= 2               # arrivals every ~10 ms overlap 70 ms requests


def test_duration_bounds_the_run(server):
    t0 = time.perf_counter()
    s = run(server, concurrency=2, duration=0.3, mix="8:3")
    assert time.perf_counter() - t0 < 3.0
    assert 4 < s["ok"] <= 2 * (0.3 / (FIRST_DELAY_S + 2 * GAP_S) + 1)
    assert s["prompt_tokens"] == 8 * s["ok"]        # prompts made during the run keep the length
    assert len({b["prompt"] for b in server.bodies}) == s["ok"]


def test_request_timeout(server):
    s = run(server, concurrency=1, requests=1, mix="8:20", request_timeout=0.2)
    assert s["errors"] == 1 and s["error_samples"] == ["timeout"]


def test_only_loopback_targets():
    assert Target.parse("http://127.0.0.1:8080").port == 8080
    assert Target.parse("localhost:9000").host == "localhost"
    for url in ("http://10.0.0.1:8080", "http://8.8.8.8", "https://127.0.0.1:1"):
        with pytest.raises(ValueError):
            Target.parse(url)


def test_unbounded_run_is_refused():
    with pytest.raises(ValueError):
        asyncio.run(load_driver.run_load(load_driver.LoadConfig()))


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(5)
    for n in (1, 2, 7, 100, 1001):
        xs = sorted(rng.random() for _ in range(n))
        for q in (0, 50, 90, 99, 100):
            assert load_driver.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert load_driver.percentile([], 50) is None


def test_parse_mix():
    assert parse_mix("64:64, 512:128") == [(64, 64), (512, 128)]
    for bad in ("", "64", "64:", "a:b", "0:5", "5:-1"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def encode_chunked(parts: list[bytes], trailer: bytes = b"") -> bytes:
    out = b"".join(b"%X;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + b"0\r\n" + trailer + b"\r\n"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("trailer", [b"", b"X-Checksum: 1\r\n"])
def test_chunked_decoder_any_split(step, trailer):
    parts = [b"data: a\n\n", b"x" * 300, b"\r\n\r\n", b"z"]
    wire = encode_chunked(parts, trailer)
    d = ChunkedDecoder()
    got = b"".join(d.feed(wire[i:i + step]) for i in range(0, len(wire), step))
    assert got == b"".join(parts) and d.done and not d.extra


def test_chunked_decoder_bad_input():
    for wire in (b"zz\r\nabc\r\n", b"3\r\nabcXY", b"-3\r\nabc\r\n", b"1" * 2000):
        with pytest.raises(HttpError):
            ChunkedDecoder().feed(wire)
    d = ChunkedDecoder()
    d.feed(encode_chunked([b"ab"]) + b"HTTP/1.1 200 OK")
    assert d.done and d.extra
