"""`troupe serve --target-itl-ms`: a long prompt that arrives while another stream decodes is
spread over steps of at most --min-prefill-tokens prompt tokens (here the target is impossible,
so every such step is cut to that floor), the server counts those steps in /metrics, and every
output is the one the same request gives alone (the official `openai` client on both sides).
"""

import http.client
import pathlib
import re
import threading

import pytest

openai = pytest.importorskip("openai")

from serve_util import MODEL, TROUPE, running_server  # noqa: E402

pytestmark = pytest.mark.skipif(not (pathlib.Path(TROUPE).exists() and MODEL.exists()),
                                reason="needs build/troupe and models/default.gguf")

STORY = "Once upon a time"
STORY_TOKENS = 400
LONG = " ".join(f"item {i} is red;" for i in range(60))  # a few hundred prompt tokens


def capped_steps(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    m = re.search(r'^troupe_scheduler_itl_capped_steps_total\{model="default"\} (\S+)$', text, re.M)
    assert m, "the metric is exported"
    return float(m.group(1))


def client_for(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def test_prompt_arriving_mid_stream_is_spread_and_outputs_unchanged():
    kw = dict(model="default", temperature=0)
    # The story runs its full length (no end-of-text), long past the ~n_prompt/16 steps the other
    # prompt needs even when that request reaches the server late on a loaded machine (with 160
    # tokens it once arrived with only 21 of the story's steps left, under the full parallel suite).
    story_kw = dict(kw, extra_body={"ignore_eos": True})
    with running_server("--target-itl-ms", "1", "--min-prefill-tokens", "16", "--max-num-seqs", "4") as (port, _):
        client = client_for(port)
        before = capped_steps(port)
        stream = iter(client.completions.create(prompt=STORY, max_tokens=STORY_TOKENS, stream=True, **story_kw))
        parts = [next(stream).choices[0].text]  # the story decodes from here on
        result = {}
        t = threading.Thread(target=lambda: result.update(r=client.completions.create(prompt=LONG, max_tokens=8, **kw)))
        t.start()
        parts += [c.choices[0].text for c in stream if c.choices]
        t.join(timeout=120)
        assert not t.is_alive()
        capped = capped_steps(port) - before
    # The references: each request alone on a fresh server without the target (a fresh one, so no
    # prefix cache from the run above shortens anything).
    with running_server("--max-num-seqs", "4") as (port, _):
        client = client_for(port)
        alone_long = client.completions.create(prompt=LONG, max_tokens=8, **kw)
        alone_story = client.completions.create(prompt=STORY, max_tokens=STORY_TOKENS, **story_kw).choices[0].text
    n_prompt = alone_long.usage.prompt_tokens
    assert n_prompt > 200
    assert "".join(parts) == alone_story
    assert result["r"].choices[0].text == alone_long.choices[0].text
    assert result["r"].usage.prompt_tokens == n_prompt
    # Its prompt went 16 tokens per step while the story decoded (the story's STORY_TOKENS outlast
    # the ~n_prompt/16 steps it needs): every such step but the last was cut.
    assert capped >= n_prompt // 16 - 1, (capped, n_prompt)


def test_without_a_target_no_step_is_cut():
    with running_server("--max-num-seqs", "4") as (port, _):
        client = client_for(port)
        stream = iter(client.completions.create(model="default", prompt=STORY, max_tokens=40, temperature=0, stream=True))
        next(stream)
        client.completions.create(model="default", prompt=LONG, max_tokens=2, temperature=0)
        for _ in stream:
            pass
        assert capped_steps(port) == 0
