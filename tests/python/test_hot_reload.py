"""Hot reload of the served model (POST /admin/reload, SIGHUP; net/model_slot.hpp) under load.

Clients: the official `openai` package (no retries: a failed request is a failed test) and the
`websockets` package. Reference: each request's greedy output from the server before any reload.
The model file is the default one, also served through a copy at another path, so every version
must give exactly the reference outputs; a truncated copy and a non-GGUF file are refused while
the serving version carries on.
"""

import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

from serve_util import MODEL, TROUPE, running_server  # noqa: E402

pytestmark = pytest.mark.skipif(not (pathlib.Path(TROUPE).exists() and MODEL.exists()),
                                reason="needs build/troupe and models/default.gguf")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
CHAT = [{"role": "user", "content": "Name three fruits."}]


def request(port, method, path, body=None, headers=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, (json.loads(raw) if raw and path != "/metrics" else raw.decode())


def metric(port, name):
    st, text = request(port, "GET", "/metrics")
    assert st == 200
    m = re.search(r"^" + re.escape(name) + r" (\S+)$", text, re.M)
    assert m, f"{name} is exported"
    return float(m.group(1))


def client_for(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def complete(client, k, stream):
    """Request kind k of the mix (0-3: a completion of PROMPTS[k]; 4: a chat) -> its text."""
    if k == 4:
        kw = dict(model="default", messages=CHAT, max_tokens=24, temperature=0)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    kw = dict(model="default", prompt=PROMPTS[k], max_tokens=24, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def wait_drained(port, seconds=30):
    deadline = time.monotonic() + seconds
    while metric(port, 'troupe_model_versions_draining{model="default"}') != 0:
        assert time.monotonic() < deadline, "a replaced version was never unloaded"
        time.sleep(0.1)


def test_reloads_under_load_fail_no_request(tmp_path):
    copy = tmp_path / "smollm-copy.gguf"
    shutil.copyfile(MODEL, copy)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(MODEL.read_bytes()[: 3 << 20])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(1 << 16))

    with running_server() as (port, proc):
        client = client_for(port)
        ref = {i: complete(client, i, False) for i in range(5)}
        assert complete(client, 0, True) == ref[0]
        long_ref = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=160, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        stop = threading.Event()
        results, failures = [], []

        def load(worker):
            c = client_for(port)
            n = 0
            while not stop.is_set():
                k = (worker + 3 * n) % 5
                try:
                    results.append((k, complete(c, k, stream=(n % 2 == 0))))
                except Exception as e:  # noqa: BLE001 - any failure is the test's failure
                    failures.append(f"request kind {k}: {e!r}")
                n += 1

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()

        # A long stream that starts on version 1 and ends after two reloads.
        long_stream = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=160, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        it = iter(long_stream)
        first = next(it).choices[0].text

        time.sleep(0.5)
        st, body = request(port, "POST", "/admin/reload")  # the same file again
        assert st == 200, body
        assert body["version"] == 2 and body["previous_version"] == 1 and body["path"] == str(MODEL)
        time.sleep(0.5)
        st, body = request(port, "POST", "/admin/reload", {"model_path": str(copy)})
        assert st == 200, body
        assert body["version"] == 3 and body["model"] == "default"
        long_text = first + "".join(c.choices[0].text for c in it if c.choices)

        time.sleep(0.5)
        st, body = request(port, "POST", "/admin/reload", {"model_path": str(truncated)})
        assert st == 400 and body["error"]["code"] == "invalid_model" and body["error"]["param"] == "model_path", body
        st, body = request(port, "POST", "/admin/reload", {"model_path": str(garbage)})
        assert st == 400 and "GGUF" in body["error"]["message"], body
        st, body = request(port, "POST", "/admin/reload", {"model_path": str(tmp_path)})
        assert st == 400 and "not a readable regular file" in body["error"]["message"], body
        st, body = request(port, "POST", "/admin/reload", {"model_path": 5})
        assert st == 400 and body["error"]["param"] == "model_path", body
        st, body = request(port, "POST", "/admin/reload", None)
        assert st == 200 and body["version"] == 4 and body["path"] == str(copy), body  # no body: the served file

        # SIGHUP reloads the served file too.
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while metric(port, 'troupe_model_version{model="default"}') != 5:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=180)

        assert failures == []
        assert len(results) >= 10
        for k, text in results:
            assert text == ref[k], f"request kind {k}"
        assert long_text == long_ref

        st, models = request(port, "GET", "/v1/models")
        assert models["data"][0]["id"] == "default" and models["data"][0]["troupe"]["version"] == 5
        assert metric(port, 'troupe_model_reloads_total{model="default",result="ok"}') == 4
        assert metric(port, 'troupe_model_reloads_total{model="default",result="failed"}') == 3
        wait_drained(port)
        # The served name stays; the new file's stem is accepted too.
        assert client.completions.create(model="smollm-copy", prompt=PROMPTS[0], max_tokens=24,
                                         temperature=0).choices[0].text == ref[0]
        st, ready = request(port, "GET", "/ready")
        assert st == 200 and ready["running"] == 0
        assert ready["model_version"] == 5 and ready["draining_versions"] == 0


def test_websocket_generation_spans_a_reload():
    with running_server() as (port, proc):
        st, ref = request(port, "POST", "/v1/completions",
                          {"prompt": PROMPTS[1], "max_tokens": 96, "temperature": 0, "ignore_eos": True})
        assert st == 200
        with connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
            ws.send(json.dumps({"type": "generate", "id": "a", "prompt": PROMPTS[1], "max_tokens": 96,
                                "temperature": 0, "ignore_eos": True}))
            texts, final, b_final = [], None, None
            reloaded = False
            while final is None or b_final is None:
                m = json.loads(ws.recv(timeout=60))
                if m.get("id") == "b":
                    b_final = m if m["type"] in ("done", "error") else b_final
                elif m["type"] == "token":
                    texts.append(m["text"])
                    if len(texts) == 4 and not reloaded:
                        st, body = request(port, "POST", "/admin/reload")
                        assert st == 200 and body["version"] == 2, body
                        reloaded = True
                        ws.send(json.dumps({"type": "generate", "id": "b", "prompt": PROMPTS[0], "max_tokens": 8,
                                            "temperature": 0}))
                elif m["id"] == "a":
                    final = m
            assert reloaded and final["type"] == "done", final
            assert b_final["type"] == "done", b_final  # the one submitted after the reload, on version 2
            assert "".join(texts) == ref["choices"][0]["text"]


def test_drain_timeout_ends_what_the_old_version_still_runs():
    with running_server("--reload-drain-timeout-s", "0.5") as (port, proc):
        client = client_for(port)
        stream = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=4000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        st, body = request(port, "POST", "/admin/reload")
        assert st == 200, body
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:  # the SSE error event, then [DONE]
            for _ in it:
                pass
        assert "drain timeout" in str(err.value)
        assert time.monotonic() - t0 < 10
        wait_drained(port)
        assert client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text


def test_reload_needs_the_admin_key():
    with running_server("--api-key", "user-key", "--admin-api-key", "admin-key") as (port, proc):
        st, body = request(port, "POST", "/admin/reload")
        assert st == 401, body
        st, body = request(port, "POST", "/admin/reload", headers={"Authorization": "Bearer user-key"})
        assert st == 401 and "admin" in body["error"]["message"], body
        st, body = request(port, "POST", "/admin/reload", headers={"Authorization": "Bearer admin-key"})
        assert st == 200 and body["version"] == 2, body
        st, body = request(port, "GET", "/admin/reload", headers={"Authorization": "Bearer admin-key"})
        assert st == 405, body


def test_reload_to_another_model_switches_tokenizer_and_limits(tiny_dir):
    """Each version brings its own tokenizer, chat template and context limit: after a reload to a
    tiny generated model (byte-level vocabulary, 256 positions) requests are tokenized, limited and
    answered as that model served alone answers them; a reload back gives the first model's."""
    tiny = tiny_dir / "llama_f32_gqa2.gguf"
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with running_server("--model", str(tiny)) as (port, _):
        st, tiny_alone = request(port, "POST", "/v1/completions", body)
        assert st == 200
        st, tiny_tokens = request(port, "POST", "/tokenize", {"prompt": "hello world"})
        assert st == 200
    with running_server() as (port, _):
        st, ref = request(port, "POST", "/v1/completions", body)
        assert st == 200
        st, ref_tokens = request(port, "POST", "/tokenize", {"prompt": "hello world"})
        assert ref_tokens != tiny_tokens
        st, r = request(port, "POST", "/admin/reload", {"model_path": str(tiny)})
        assert st == 200 and r["version"] == 2, r
        st, got = request(port, "POST", "/v1/completions", body)
        assert st == 200 and got["choices"][0]["text"] == tiny_alone["choices"][0]["text"]
        assert got["model"] == "default"  # the served name is kept
        assert request(port, "POST", "/tokenize", {"prompt": "hello world"})[1] == tiny_tokens
        st, models = request(port, "GET", "/v1/models")
        assert models["data"][0]["max_model_len"] == 256
        st, err = request(port, "POST", "/v1/completions", {"prompt": "x" * 400, "max_tokens": 4})
        assert st == 400, err
        st, r = request(port, "POST", "/admin/reload", {"model_path": str(MODEL)})
        assert st == 200 and r["version"] == 3, r
        st, back = request(port, "POST", "/v1/completions", body)
        assert st == 200 and back["choices"][0]["text"] == ref["choices"][0]["text"]


def test_a_second_reload_while_one_runs_gets_409():
    with running_server() as (port, _):
        statuses = []
        for _ in range(5):
            barrier = threading.Barrier(2)
            out = []

            def fire():
                barrier.wait()
                out.append(request(port, "POST", "/admin/reload")[0])

            threads = [threading.Thread(target=fire) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert sorted(out) in ([200, 200], [200, 409]), out
            statuses += out
            if 409 in out:
                break
        assert 409 in statuses, statuses
        assert metric(port, 'troupe_model_version{model="default"}') == 1 + statuses.count(200)


def test_models_loaded_and_unloaded_beside_the_default(tiny_dir):
    """POST /admin/models/load adds a model under a name, requests that name it go to it (its own
    tokenizer and outputs, as when served alone), the default is untouched; unloading lets what
    runs on it finish, then the name is unknown (404)."""
    tiny = tiny_dir / "llama_f32_gqa2.gguf"
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with running_server("--model", str(tiny)) as (port, _):
        st, tiny_alone = request(port, "POST", "/v1/completions", body)
        assert st == 200
        tiny_tokens = request(port, "POST", "/tokenize", {"prompt": "hello world"})[1]
    with running_server("--max-models", "2") as (port, _):
        st, ref = request(port, "POST", "/v1/completions", body)
        assert st == 200
        st, r = request(port, "POST", "/admin/models/load", {"model": "tiny", "model_path": str(tiny)})
        assert st == 200 and r["model"] == "tiny" and r["version"] == 1, r
        st, r = request(port, "POST", "/admin/models/load", {"model": "tiny", "model_path": str(tiny)})
        assert st == 409, r
        st, r = request(port, "POST", "/admin/models/load", {"model": "third", "model_path": str(tiny)})
        assert st == 507 and "--max-models" in r["error"]["message"], r
        st, r = request(port, "POST", "/admin/models/load", {"model": "bad name!", "model_path": str(tiny)})
        assert st == 400, r
        st, models = request(port, "GET", "/v1/models")
        assert [m["id"] for m in models["data"]] == ["default", "tiny"]
        assert metric(port, "troupe_models_loaded") == 2
        assert metric(port, 'troupe_engine_up{model="tiny"}') == 1
        assert metric(port, 'troupe_kv_blocks_total{model="tiny"}') > 0

        st, got = request(port, "POST", "/v1/completions", {**body, "model": "tiny"})
        assert st == 200 and got["model"] == "tiny" and got["choices"][0]["text"] == tiny_alone["choices"][0]["text"]
        assert request(port, "POST", "/tokenize", {"prompt": "hello world", "model": "tiny"})[1] == tiny_tokens
        st, got = request(port, "POST", "/v1/completions", body)  # no model: the default
        assert st == 200 and got["choices"][0]["text"] == ref["choices"][0]["text"]
        with connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
            ws.send(json.dumps({"type": "generate", "id": "t", "model": "tiny", **body}))
            texts = []
            while True:
                m = json.loads(ws.recv(timeout=60))
                if m["type"] == "token":
                    texts.append(m["text"])
                elif m["id"] == "t":
                    assert m["type"] == "done", m
                    break
            assert "".join(texts) == tiny_alone["choices"][0]["text"]

        st, r = request(port, "POST", "/admin/models/unload", {"model": "default"})
        assert st == 400, r
        st, r = request(port, "POST", "/admin/models/unload", {"model": "tiny"})
        assert st == 200, r
        st, r = request(port, "POST", "/v1/completions", {**body, "model": "tiny"})
        assert st == 404 and "'default'" in r["error"]["message"], r
        st, r = request(port, "POST", "/admin/models/unload", {"model": "tiny"})
        assert st == 404, r
        assert metric(port, "troupe_models_loaded") == 1

        # The freed place taken again, by the default model's file under another name: a long
        # stream on it spans its unload and ends complete.
        st, r = request(port, "POST", "/admin/models/load", {"model": "smol2", "model_path": str(MODEL)})
        assert st == 200, r
        st, r = request(port, "POST", "/admin/reload", {"model": "smol2"})
        assert st == 200 and r["model"] == "smol2" and r["version"] == 2, r
        st, r = request(port, "POST", "/admin/reload", {"model": "nope"})
        assert st == 404 and r["error"]["param"] == "model", r
        client = client_for(port)
        stream = iter(client.completions.create(model="smol2", prompt=PROMPTS[1], max_tokens=300, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        text = next(stream).choices[0].text
        st, r = request(port, "POST", "/admin/models/unload", {"model": "smol2"})
        assert st == 200, r
        assert request(port, "POST", "/v1/completions", {**body, "model": "smol2"})[0] == 404  # at once
        text += "".join(c.choices[0].text for c in stream if c.choices)
        full = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=300, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == full
