"""`troupe serve`'s WebSocket endpoint (GET /v1/ws, docs/websocket.md) with the `websockets` client.

Reference: the same request over HTTP /v1/completions (temperature 0, a separate code path from the
socket's multiplexer). Liveness and cleanup are read from the server itself: /ready's running
count and the process's RSS. One server for the whole module.
"""

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time

import pytest

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from serve_util import MODEL, ROOT, TROUPE, free_port, running_server  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not (pathlib.Path(TROUPE).exists() and MODEL.exists()),
                                reason="needs build/troupe and models/default.gguf")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]



def request(port, method, path, body=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, (json.loads(raw) if raw else None)


@pytest.fixture(scope="module")
def server():
    with running_server() as (port, proc):
        yield port, proc


def url(port):
    return f"ws://127.0.0.1:{port}/v1/ws"


def http_completion(port, prompt, max_tokens, **kw):
    st, body = request(port, "POST", "/v1/completions",
                       {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert st == 200, body
    return body


def gen(id_, prompt, max_tokens, **kw):
    return json.dumps({"type": "generate", "id": id_, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, **kw})


def collect(ws, ids, timeout=60, on_message=None):
    """Reads until every id in `ids` has its final message; returns {id: (texts, tokens, final)}
    and the messages that belong to none of them."""
    out = {i: ([], [], None) for i in ids}
    other = []
    deadline = time.monotonic() + timeout
    while any(v[2] is None for v in out.values()):
        m = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if on_message:
            on_message(m)
        mine = m.get("id") in out and out[m["id"]][2] is None
        if mine and m["type"] == "token":
            assert isinstance(m["token"], int) and isinstance(m["text"], str)
            out[m["id"]][0].append(m["text"])
            out[m["id"]][1].append(m["token"])
        elif mine and (m["type"] == "done" or (m["type"] == "error" and m["final"])):
            out[m["id"]] = (out[m["id"]][0], out[m["id"]][1], m)
        else:  # a rejected message (error, final false), a priority answer, another id
            other.append(m)
    return out, other


def running(port):
    st, body = request(port, "GET", "/ready")
    assert st == 200, body
    return body["running"]


def wait_idle(port, seconds):
    deadline = time.monotonic() + seconds
    while running(port) != 0:
        assert time.monotonic() < deadline, "generations still running after the socket went away"
        time.sleep(0.05)


def rss_kib(pid):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- tests ---------------------------------------------------------------------------------------

def test_multiplexed_generations_match_http(server):
    port = server[0]
    n = [12, 20, 16]
    with connect(url(port)) as ws:
        for i, p in enumerate(PROMPTS):
            ws.send(gen(f"g{i}", p, n[i]))
        got, other = collect(ws, [f"g{i}" for i in range(3)])
    assert other == []
    for i, p in enumerate(PROMPTS):
        texts, toks, final = got[f"g{i}"]
        ref = http_completion(port, p, n[i])
        assert final["type"] == "done", final
        assert "".join(texts) == ref["choices"][0]["text"]
        assert final["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert final["usage"] == ref["usage"]
        assert len(toks) == final["usage"]["completion_tokens"]


def test_chat_messages_match_http(server):
    port = server[0]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    with connect(url(port)) as ws:
        ws.send(json.dumps({"type": "generate", "id": "c", "messages": messages, "max_tokens": 10, "temperature": 0}))
        got, _ = collect(ws, ["c"])
    st, ref = request(port, "POST", "/v1/chat/completions",
                      {"model": "default", "messages": messages, "max_tokens": 10, "temperature": 0})
    assert st == 200
    texts, _, final = got["c"]
    assert final["type"] == "done"
    assert "".join(texts) == ref["choices"][0]["message"]["content"]
    assert final["usage"] == ref["usage"]


def test_cancel_one_mid_stream(server):
    port = server[0]
    long_n, short_n = 400, 24
    seen = {"victim": 0}
    with connect(url(port)) as ws:
        ws.send(gen("victim", PROMPTS[1], long_n, ignore_eos=True))
        ws.send(gen("s0", PROMPTS[0], short_n))
        ws.send(gen("s1", PROMPTS[2], short_n))

        def on_message(m):
            if m.get("id") == "victim" and m["type"] == "token":
                seen["victim"] += 1
                if seen["victim"] == 3:
                    ws.send(json.dumps({"type": "cancel", "id": "victim"}))
        got, other = collect(ws, ["victim", "s0", "s1"], on_message=on_message)
        # The id is free again once the generation ended; cancelling it now is an error.
        ws.send(json.dumps({"type": "cancel", "id": "victim"}))
        m = json.loads(ws.recv(timeout=10))
        assert m == {**m, "type": "error", "id": "victim", "code": "unknown_id"}
    assert other == []
    _, vtoks, vfinal = got["victim"]
    assert vfinal["type"] == "error" and vfinal["code"] == "cancelled", vfinal
    assert 3 <= len(vtoks) < long_n
    for i, p in (("s0", PROMPTS[0]), ("s1", PROMPTS[2])):
        texts, _, final = got[i]
        assert final["type"] == "done"
        assert "".join(texts) == http_completion(port, p, short_n)["choices"][0]["text"]
    wait_idle(port, 5)


def test_priority_change_accepted(server):
    port = server[0]
    with connect(url(port)) as ws:
        ws.send(gen("p", PROMPTS[0], 24, priority="batch"))
        ws.send(json.dumps({"type": "priority", "id": "p", "priority": "interactive"}))
        ws.send(json.dumps({"type": "priority", "id": "p", "priority": "urgent"}))
        ws.send(json.dumps({"type": "priority", "id": "nobody", "priority": "batch"}))
        got, other = collect(ws, ["p"])
    assert {"type": "priority", "id": "p", "priority": "interactive", "applied": True} in other
    codes = sorted(m["code"] for m in other if m["type"] == "error")
    assert codes == ["invalid_request", "unknown_id"], other
    texts, _, final = got["p"]
    assert final["type"] == "done"
    assert "".join(texts) == http_completion(port, PROMPTS[0], 24)["choices"][0]["text"]


def test_malformed_messages_get_errors_while_a_generation_completes(server):
    port = server[0]
    bad = [  # message, the error's id, code, final
        ("not json", None, "invalid_json", False),
        ("[1, 2]", None, "invalid_request", False),
        (json.dumps({"id": "x"}), None, "invalid_request", False),                       # no type
        (json.dumps({"type": "launch", "id": "x"}), "x", "unknown_type", False),
        (json.dumps({"type": "generate", "id": 5, "prompt": "a"}), None, "invalid_request", False),
        (json.dumps({"type": "generate", "id": "", "prompt": "a"}), None, "invalid_request", False),
        (json.dumps({"type": "cancel"}), None, "invalid_request", False),
        (gen("ok", "x", "ten"), "ok", "invalid_value", False),           # while "ok" runs: no effect on it
        (gen("m", "x", 4, temperature="hot"), "m", "invalid_value", True),
        (json.dumps({"type": "generate", "id": "m", "prompt": "a", "messages": []}), "m", "invalid_request", True),
        (json.dumps({"type": "generate", "id": "m"}), "m", "invalid_request", True),
        (gen("m", "x", 10**12), "m", "invalid_value", True),
        (gen("ok", "again", 4), "ok", "duplicate_id", False),
    ]
    with connect(url(port)) as ws:
        ws.send(gen("ok", PROMPTS[0], 40, ignore_eos=True))
        for text, *_ in bad:
            ws.send(text)
        got, other = collect(ws, ["ok"])
        while len(other) < len(bad):
            other.append(json.loads(ws.recv(timeout=10)))
    assert [(m["type"], m["id"], m["code"], m["final"]) for m in other] == [("error", i, c, f) for _, i, c, f in bad]
    assert all(isinstance(m["message"], str) and m["message"] for m in other)
    assert other[7]["param"] == "max_tokens" and other[8]["param"] == "temperature"
    texts, toks, final = got["ok"]
    assert final["type"] == "done" and len(toks) == 40
    assert "".join(texts) == http_completion(port, PROMPTS[0], 40, ignore_eos=True)["choices"][0]["text"]


def test_binary_and_invalid_utf8_close_the_socket_only(server):
    port = server[0]
    with connect(url(port)) as ws:
        ws.send(b"\x00\x01binary")
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1003
    with connect(url(port)) as ws:
        ws.send(b'{"type":"cancel","id":"\xff"}', text=True)
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1007
    with connect(url(port)) as ws:  # the server keeps serving
        ws.send(gen("after", PROMPTS[0], 6))
        got, _ = collect(ws, ["after"])
        assert got["after"][2]["type"] == "done"
    st, body = request(port, "GET", "/v1/ws")
    assert st == 426 and body["error"]["code"] == "upgrade_required"


def test_slow_reader_is_bounded_and_others_are_served(server):
    port, proc = server
    rss0 = rss_kib(proc.pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that lets little in
    sock.connect(("127.0.0.1", port))
    n = 300
    with connect(url(port), sock=sock, max_queue=4) as slow:
        for i in range(3):
            slow.send(gen(f"slow{i}", PROMPTS[i], n, ignore_eos=True))
        peak = rss0
        # While the slow socket is not read, another client is served, correctly.
        t0 = time.monotonic()
        with connect(url(port)) as other:
            other.send(gen("o", PROMPTS[0], 12))
            got, _ = collect(other, ["o"], timeout=30)
        assert got["o"][2]["type"] == "done"
        assert "".join(got["o"][0]) == http_completion(port, PROMPTS[0], 12)["choices"][0]["text"]
        while time.monotonic() - t0 < 4:
            peak = max(peak, rss_kib(proc.pid))
            time.sleep(0.1)
        # Nothing was lost or reordered by the wait: each generation arrives whole.
        got, other_msgs = collect(slow, [f"slow{i}" for i in range(3)], timeout=60,
                                  on_message=lambda m: None)
        peak = max(peak, rss_kib(proc.pid))
    assert other_msgs == []
    for i in range(3):
        texts, toks, final = got[f"slow{i}"]
        assert final["type"] == "done" and len(toks) == n and final["usage"]["completion_tokens"] == n
    assert peak - rss0 < 64 * 1024, f"RSS grew by {(peak - rss0) // 1024} MiB while a client did not read"
    wait_idle(port, 5)


def test_reader_that_stops_is_closed_1008_with_configured_limits():
    """The configurable limits ([websocket] / --ws-*): a client that stops reading fills the small
    queue and socket buffer, its blocked write outlives --ws-send-timeout-s, and the server closes
    the socket (1008, dropped if the close cannot be sent), cancelling its generations, while it
    keeps serving other clients."""
    with running_server("--ws-send-timeout-s", "1", "--ws-max-queue-bytes", "4096",
                        "--ws-send-buffer-bytes", "4096") as (port, proc):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        stalled = connect(url(port), sock=sock, max_queue=1)
        for i in range(3):
            stalled.send(gen(f"s{i}", PROMPTS[i], 2000, ignore_eos=True))
        deadline = time.monotonic() + 10
        while running(port) != 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t_full = time.monotonic()
        # Blocked at most 1 s (+ the queue filling) + 2 s of grace for the close, then cancelled.
        deadline = t_full + 15
        while running(port) != 0:
            assert time.monotonic() < deadline, "a client that stopped reading kept its generations"
            time.sleep(0.1)
        assert time.monotonic() - t_full < 15
        # The client, reading at last, finds the connection closed: a 1008 close frame when it got
        # through behind the blocked data, else a dropped connection.
        code = None
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(100000):
                stalled.recv(timeout=10)
        code = closed.value.rcvd.code if closed.value.rcvd else None
        assert code in (1008, None)
        stalled.close()
        assert http_completion(port, PROMPTS[0], 4)["usage"]["completion_tokens"] == 4


def metric(port, name):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_websocket_generations_feed_metrics(server):
    port = server[0]
    gen0 = metric(port, "troupe_generation_tokens_total")
    ttft0 = metric(port, "troupe_time_to_first_token_seconds_count")
    with connect(url(port)) as ws:
        ws.send(gen("m0", PROMPTS[1], 7, ignore_eos=True))
        ws.send(gen("m1", PROMPTS[2], 5, ignore_eos=True))
        got, _ = collect(ws, ["m0", "m1"], timeout=30)
    assert got["m0"][2]["type"] == "done" and got["m1"][2]["type"] == "done"
    assert metric(port, "troupe_generation_tokens_total") - gen0 == 12
    assert metric(port, "troupe_time_to_first_token_seconds_count") - ttft0 == 2


def test_abrupt_close_cancels_its_generations(server):
    port = server[0]
    sock = socket.create_connection(("127.0.0.1", port))
    ws = connect(url(port), sock=sock)
    for i in range(2):
        ws.send(gen(f"a{i}", PROMPTS[i], 1000, ignore_eos=True))
    n_tokens = 0
    while n_tokens < 4:
        if json.loads(ws.recv(timeout=30))["type"] == "token":
            n_tokens += 1
    assert running(port) == 2
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, no close frame
    sock.close()
    wait_idle(port, 3)
    ws.close()
    assert request(port, "GET", "/health")[0] == 200
