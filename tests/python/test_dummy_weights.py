"""--load-format dummy (vLLM's): a built-in architecture served with random weights, no file read,
through the official `openai` client; the same seed gives the same weights in every process (the
server's greedy continuation equals `troupe generate`'s), another seed others."""
import json
import pathlib
import subprocess

import pytest

openai = pytest.importorskip("openai")

from serve_util import MODEL, TROUPE, request, running_server  # noqa: E402

pytestmark = pytest.mark.skipif(not pathlib.Path(TROUPE).exists(), reason="needs build/troupe")

DUMMY = ["--model", "smollm2-135m", "--load-format", "dummy"]


def generate_ids(prompt_ids, seed, n=12):
    out = subprocess.run([TROUPE, "generate", *DUMMY, "--dummy-seed", str(seed), "--prompt-tokens",
                          ",".join(map(str, prompt_ids)), "--temperature", "0", "--ignore-eos", "--print-token-ids",
                          "-n", str(n), "-q", "-t", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(t) for t in out.stdout.split()]


def test_serve_a_builtin_architecture_with_random_weights():
    with running_server(*DUMMY, "--dummy-seed", "5") as (port, proc):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert "smollm2-135m" in [m.id for m in client.models.list().data]
        st, body = request(port, "POST", "/tokenize", {"content": "Hello, world", "add_special": True})
        assert st == 200
        ids = body["tokens"]
        assert len(ids) == len("Hello, world")  # the byte-level vocabulary has no merges: a token per byte

        r = client.completions.create(model="smollm2-135m", prompt=ids, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        again = client.completions.create(model="smollm2-135m", prompt=ids, temperature=0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].text == r.choices[0].text

        # The same seed in another process (troupe generate: the generator, not the actors): the
        # same weights, the same greedy tokens; another seed, other weights.
        ref = generate_ids(ids, 5)
        st, body = request(port, "POST", "/detokenize", {"tokens": ref})
        assert st == 200 and body["content"] == r.choices[0].text
        assert generate_ids(ids, 6) != ref

        # Chat: the built-in vocabulary has ChatML's tokens and the server its format.
        c = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0, max_tokens=4)
        assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens >= 1
        st, body = request(port, "GET", "/health")
        assert st == 200


def test_bench_under_load_with_random_weights():
    out = subprocess.run([TROUPE, "bench", *DUMMY, "--concurrency", "2", "--requests", "4", "--prompt-len", "16",
                          "--gen-len", "8", "--json", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"] == 4 and r["tok_s"] > 0 and r["roofline_tok_s"] > 0


@pytest.mark.skipif(not MODEL.exists(), reason="needs models/default.gguf")
def test_dummy_weights_of_a_file_keep_its_tokenizer():
    with running_server("--model", str(MODEL), "--load-format", "dummy") as (port, _):
        st, body = request(port, "POST", "/tokenize", {"content": "The capital of France is", "add_special": True})
    assert st == 200
    with running_server("--model", str(MODEL)) as (port, _):
        st2, body2 = request(port, "POST", "/tokenize", {"content": "The capital of France is", "add_special": True})
    assert st2 == 200 and body["tokens"] == body2["tokens"]


def test_dummy_errors():
    def serve(*args):
        return subprocess.run([TROUPE, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=60)

    out = serve("--model", "llama-3-8b")
    assert out.returncode != 0 and "--load-format dummy" in out.stderr
    out = serve("--model", "llama-9", "--load-format", "dummy")
    assert out.returncode != 0 and "neither a file nor a built-in architecture" in out.stderr
    assert "qwen2.5-7b" in out.stderr
    out = serve(*DUMMY[:2], "--load-format", "random")
    assert out.returncode != 0 and "(--load-format) must be \"auto\" or \"dummy\"" in out.stderr
