"""`troupe serve` against the official `openai` Python client and raw HTTP.

References: the `troupe generate` CLI (a separate, non-actor generation path) for greedy tokens,
jinja2 rendering the model's own chat template for chat prompt sizes, and the server's /tokenize
for completion prompt sizes. One server for the whole module (session fixture).
"""

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import time

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

openai = pytest.importorskip("openai")

from serve_util import MODEL, ROOT, TROUPE, free_port, running_server  # noqa: E402,F401
PROMPT = "The capital of France is"

pytestmark = pytest.mark.skipif(not (pathlib.Path(TROUPE).exists() and MODEL.exists()),
                                reason="needs build/troupe and models/default.gguf")



def request(port, method, path, body=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), (json.loads(raw) if raw else None)


@pytest.fixture(scope="session")
def server():
    with running_server() as (port, proc):
        yield port, proc


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="none", max_retries=0, timeout=60)


def tokenize(port, text, add_special=True):
    st, _, body = request(port, "POST", "/tokenize", {"content": text, "add_special": add_special})
    assert st == 200
    return body["tokens"]


def detokenize(port, ids):
    st, _, body = request(port, "POST", "/detokenize", {"tokens": ids})
    assert st == 200
    return body["content"]


def chat_prompt_tokens(port, messages):
    """Prompt size of a chat request, from jinja2 rendering the GGUF's own template."""
    from gguf import GGUFReader
    f = GGUFReader(str(MODEL)).fields["tokenizer.chat_template"]
    src = bytes(f.parts[f.data[0]]).decode()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    text = env.from_string(src).render(messages=messages, add_generation_prompt=True,
                                       bos_token="<|im_start|>", eos_token="<|im_end|>")
    return len(tokenize(port, text, add_special=False))  # this model's add_bos is false


def greedy(client, **kw):
    return client.completions.create(model="default", prompt=PROMPT, temperature=0, **kw)


# --- the openai client ---------------------------------------------------------------------------

def test_health_ready_models(server, client):
    port = server[0]
    st, _, body = request(port, "GET", "/health")
    assert st == 200 and body == {"status": "ok"}
    st, _, body = request(port, "GET", "/ready")
    assert st == 200 and body["status"] == "ready"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["default"]


def test_completion_non_streaming(server, client):
    r = greedy(client, max_tokens=8)
    assert r.object == "text_completion" and r.model == "default" and r.id
    c = r.choices[0]
    assert c.text.strip() and c.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(tokenize(server[0], PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_streaming_matches_non_streaming(client):
    full = greedy(client, max_tokens=12).choices[0].text
    parts, finish, usage = [], None, None
    for ch in greedy(client, max_tokens=12, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(parts) == full and finish == "length"
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12


def test_greedy_equals_cli_generate(server, client):
    ids = tokenize(server[0], PROMPT)
    out = subprocess.run([TROUPE, "generate", "--prompt-tokens", ",".join(map(str, ids)), "--temperature", "0",
                          "--print-token-ids", "-n", "20", "-q", "-t", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ref = [int(t) for t in out.stdout.split()]
    r = client.completions.create(model="default", prompt=ids, temperature=0, max_tokens=20)
    assert r.choices[0].text == detokenize(server[0], ref)
    # The CLI leaves out the end-of-generation token; usage counts it (as vLLM does).
    stopped = len(ref) < 20
    assert r.choices[0].finish_reason == ("stop" if stopped else "length")
    assert r.usage.completion_tokens == len(ref) + stopped


def test_chat_non_streaming_and_streaming(server, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=10)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and m.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == chat_prompt_tokens(server[0], msgs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="default", messages=msgs, temperature=0, max_completion_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == m.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_seed_reproducible(client):
    def draw(seed):
        return client.completions.create(model="default", prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=24).choices[0].text
    a = draw(1234)
    assert draw(1234) == a
    assert any(draw(s) != a for s in (1, 2, 3))


def test_stop_strings(client):
    full = greedy(client, max_tokens=16).choices[0].text
    # The stop string: a word of the greedy continuation after its first line (" Paris.\n\n..."),
    # found nowhere before, so the answer must end just before it.
    words = [w for w in full.split(" ") if w]
    stop = next(" " + w for w in words[2:] if full.index(" " + w) > full.index("\n") and full.count(" " + w) == 1)
    cut = full.index(stop)
    r = greedy(client, max_tokens=16, stop=[stop, "never-there"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in greedy(client, max_tokens=16, stop=stop, stream=True) if c.choices)
    assert streamed == full[:cut]


def test_logprobs(client):
    r = greedy(client, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely
    c = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=5, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


# --- raw HTTP ------------------------------------------------------------------------------------

def test_errors(server):
    port = server[0]
    st, _, body = request(port, "POST", "/v1/completions", b'{"prompt": "x", ')
    assert st == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    st, _, body = request(port, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert st == 404 and body["error"]["code"] == "model_not_found"
    st, _, body = request(port, "POST", "/v1/completions", {"prompt": "x", "temperature": "hot"})
    assert st == 400 and body["error"]["param"] == "temperature"
    st, _, body = request(port, "POST", "/v1/completions", {"prompt": [504] * 8000, "max_tokens": 500})
    assert st == 400 and "8000" in body["error"]["message"] and "500" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"
    st, _, body = request(port, "POST", "/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert st == 413 and "error" in body
    st, _, body = request(port, "GET", "/v1/nothing")
    assert st == 404 and "error" in body
    st, hdr, body = request(port, "GET", "/v1/completions")
    assert st == 405 and hdr.get("Allow") == "POST"
    st, _, body = request(port, "POST", "/detokenize", {"tokens": [10 ** 9]})
    assert st == 400


def test_extensions_and_unsupported(server, client):
    port = server[0]
    for prio in ("interactive", "batch", 7):
        st, _, body = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": prio})
        assert st == 200 and body["usage"]["completion_tokens"] == 2
    st, _, body = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "priority": "urgent"})
    assert st == 400 and body["error"]["param"] == "priority"
    st, _, body = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "n": 17})
    assert st == 400 and body["error"]["param"] == "n"  # the default --max-n is 16
    st, _, body = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "n": 0})
    assert st == 400 and body["error"]["param"] == "n"


def test_n_choices(server, client):
    """n > 1: n choices indexed 0..n-1; choice 0 is what n = 1 gives with the same seed, choice i
    draws from seed + i (so each is reproducible alone); usage counts the prompt once and sums the
    completions."""
    kw = dict(model="default", prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    many = client.completions.create(n=3, seed=42, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.completions.create(n=1, seed=42 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == alone
    assert len(set(alone)) > 1, "different seeds gave the same 12 tokens three times"
    assert many.usage.completion_tokens == 36
    assert many.usage.prompt_tokens == len(tokenize(server[0], PROMPT))

    # Greedy choices are all the greedy continuation.
    g = greedy(client, max_tokens=8, n=2)
    want = greedy(client, max_tokens=8).choices[0].text
    assert [c.text for c in g.choices] == [want, want]

    # Streaming: chunks of both choices, each assembling to its non-streaming text, one finish each.
    texts, finishes = {0: "", 1: ""}, {}
    for ch in client.completions.create(n=2, seed=7, stream=True, stream_options={"include_usage": True},
                                        model="default", prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if ch.usage:
            assert ch.usage.completion_tokens == 20
    ref = client.completions.create(n=2, seed=7, model="default", prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True})
    assert texts == {c.index: c.text for c in ref.choices}
    assert finishes == {0: "length", 1: "length"}

    # A batch of prompts: choice index = prompt * n + sample, each prompt counted once in usage.
    other = "Once upon a time"
    b = client.completions.create(model="default", prompt=[PROMPT, other], n=2, temperature=0, max_tokens=6)
    want_other = client.completions.create(model="default", prompt=other, temperature=0, max_tokens=6).choices[0].text
    want = greedy(client, max_tokens=6).choices[0].text
    assert [c.index for c in b.choices] == [0, 1, 2, 3]
    assert [c.text for c in b.choices] == [want, want, want_other, want_other]
    assert b.usage.prompt_tokens == len(tokenize(server[0], PROMPT)) + len(tokenize(server[0], other))
    st, _, body = request(server[0], "POST", "/v1/completions", {"prompt": [PROMPT] * 5, "n": 4})
    assert st == 400 and body["error"]["param"] == "n" and "--max-n" in body["error"]["message"]

    # Chat: n messages.
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi."}],
                                       n=2, seed=3, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in r.choices)


def test_concurrent_streams_agree(client):
    from concurrent.futures import ThreadPoolExecutor
    want = greedy(client, max_tokens=12).choices[0].text

    def one(_):
        return "".join(c.choices[0].text for c in greedy(client, max_tokens=12, stream=True) if c.choices)
    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(one, range(4))) == [want] * 4


def running(port):
    return request(port, "GET", "/ready")[2]["running"]


def test_disconnect_mid_stream_cancels(server, client):
    port = server[0]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
    assert running(port) == 1
    s.close()
    deadline = time.monotonic() + 5
    while running(port) != 0:
        assert time.monotonic() < deadline, "the generation outlived its client"
        time.sleep(0.05)
    assert greedy(client, max_tokens=2).usage.completion_tokens == 2


def test_disconnect_while_waiting_non_streaming(server, client):
    """A non-streaming client that hangs up is noticed while its generation runs (no write is
    pending to fail): the generation is cancelled and its sequence freed."""
    port = server[0]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while running(port) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s.close()
    deadline = time.monotonic() + 5
    while running(port) != 0:
        assert time.monotonic() < deadline, "the non-streaming generation outlived its client"
        time.sleep(0.05)
    assert greedy(client, max_tokens=2).usage.completion_tokens == 2


def test_graceful_stop_last(server):
    """Runs last (file order): SIGTERM stops the server promptly with exit code 0."""
    port, proc = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
