#!/usr/bin/env python3
"""Greedy, seeded and logprobs completions from two troupe servers (GPU and CPU executor), compared.

Standard library only (the device image has no openai package). Used by scripts/gpu-e2e.sh:

  python3 scripts/gpu_e2e_client.py --gpu http://127.0.0.1:18080 --cpu http://127.0.0.1:18081

Prints `name value unit` lines (gpu-check's table reads them) and a JSON line per request pair.
Checks, each a line `check NAME ok|FAIL`:
  greedy_prefix   greedy continuations of the same prompts: identical, or parting only at a near
                  tie of the CPU's own top two (logprob margin < --tie-margin): bf16 on the GPU
                  vs int8 activations on the CPU may swap two nearly equal tokens
  seeded_repeat   a seeded stochastic request (sampled on the device) gives the same text twice
  logprobs        a request with logprobs (sampled on the host from the GPU's logits) returns them
Exit status 1 when a check fails or a request errs.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
]


def post(url: str, body: dict, timeout: float = 60.0, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, timeout: float) -> None:
    t_end = time.time() + timeout
    last = None
    while time.time() < t_end:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s: {last}")


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--cpu", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ready-timeout", type=float, default=60)
    ap.add_argument("--tie-margin", type=float, default=0.1, help="logprob margin below which a parting is a tie")
    a = ap.parse_args()
    for url in (a.gpu, a.cpu):
        wait_ready(url, a.ready_timeout)

    ok = True
    prefixes, identical, greedy_ok = [], 0, True
    for p in PROMPTS:
        body = {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
        g, c = post(a.gpu, body), post(a.cpu, {**body, "logprobs": 2})
        gt, ct = g["choices"][0]["text"], c["choices"][0]["text"]
        n = common_prefix(gt, ct)
        prefixes.append(n)
        identical += gt == ct
        verdict = "identical"
        if gt != ct:
            # The CPU token where the texts part, and its margin over the CPU's second choice.
            lp = c["choices"][0]["logprobs"]
            at, i = 0, 0
            while i < len(lp["tokens"]) and at + len(lp["tokens"][i]) <= n:
                at += len(lp["tokens"][i])
                i += 1
            top = sorted(lp["top_logprobs"][i].values(), reverse=True) if i < len(lp["tokens"]) else []
            margin = top[0] - top[1] if len(top) >= 2 else float("inf")
            verdict = f"parted at token {i}, CPU margin {margin:.3f}"
            if margin >= a.tie_margin:
                greedy_ok = False
                verdict += " (not a tie)"
        print(json.dumps({"prompt": p, "gpu": gt, "cpu": ct, "common_chars": n, "verdict": verdict}))
    print(f"greedy_common_chars_min {min(prefixes)} chars")
    print(f"greedy_identical {identical} of {len(PROMPTS)}")
    print(f"check greedy_prefix {'ok' if greedy_ok else 'FAIL'}")
    ok &= greedy_ok

    body = {"prompt": PROMPTS[2], "max_tokens": a.max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    r1, r2 = post(a.gpu, body), post(a.gpu, body)
    t1, t2 = r1["choices"][0]["text"], r2["choices"][0]["text"]
    print(json.dumps({"seeded": [t1, t2]}))
    seeded_ok = t1 == t2 and len(t1) > 0
    print(f"check seeded_repeat {'ok' if seeded_ok else 'FAIL'}")
    ok &= seeded_ok

    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 2}
    r = post(a.gpu, body)
    lp = r["choices"][0].get("logprobs") or {}
    tl = lp.get("token_logprobs") or []
    print(json.dumps({"logprobs": lp}))
    lp_ok = len(tl) == 4 and all(isinstance(x, (int, float)) and x <= 0 for x in tl)
    print(f"check logprobs {'ok' if lp_ok else 'FAIL'}")
    ok &= lp_ok

    # Hot reload on the device: a second executor (weights, KV, graphs) is built beside the serving
    # one, then the first is destroyed on the slot's thread while the new one serves. Twice, then
    # the first greedy prompt again, and every replaced version unloaded (no hang in teardown).
    body = {"prompt": PROMPTS[0], "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
    before = post(a.gpu, body)["choices"][0]["text"]
    versions = [post(a.gpu, {}, timeout=300, path="/admin/reload").get("version") for _ in range(2)]
    after = post(a.gpu, body)["choices"][0]["text"]
    draining = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(a.gpu + "/metrics", timeout=10) as r:
            m = re.search(r'^troupe_model_versions_draining\{model="[^"]*"\} (\S+)$', r.read().decode(), re.M)
        draining = float(m.group(1)) if m else None
        if draining == 0:
            break
        time.sleep(0.2)
    print(json.dumps({"reload_versions": versions, "same_output": before == after, "draining": draining}))
    reload_ok = versions == [2, 3] and before == after and draining == 0
    print(f"check reload {'ok' if reload_ok else 'FAIL'}")
    ok &= reload_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
