#!/usr/bin/env python3
"""Sliding-window KV groups vs full KV (--swa-full) for Gemma 3 under one KV budget, same machine.

For each layout: `troupe serve -m models/gemma3-270m.gguf --kv-mb M`, then R requests sent at once,
each a short prompt and T generated tokens (greedy, ignore_eos), streamed. Gemma 3 270M attends to
the last 512 positions in 15 of its 18 layers: with the groups (the default), a long generation
holds the KV of every position in 3 layers and of the window in the other 15; with --swa-full, of
every position in all 18. Reports the wall time, the throughput, the most generations running at
once and the KV blocks in use (sampled from /metrics every 0.2 s), the preemptions, and checks that both layouts
generate the same text.

    .venv/bin/python load_tests/bench_swa.py [--kv-mb 40] [--requests 3] [--gen-len 1536] [--threads 2]
"""
import argparse
import http.client
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))
from bench_util import free_port, get, metrics, stop, wait  # noqa: E402

TROUPE = os.environ.get("TROUPE_BIN", str(ROOT / "build" / "troupe"))
GEMMA = ROOT / "models" / "gemma3-270m.gguf"


def complete(port, prompt, max_tokens):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(body)
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def run(layout_args, a):
    port = free_port()
    proc = subprocess.Popen([TROUPE, "serve", "-m", str(GEMMA), "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
                             "--kv-mb", str(a.kv_mb), *layout_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: get(port, "/health")[0] == 200, 120, "troupe serve")
        total_blocks = metrics(port, ["troupe_kv_blocks_total"])["troupe_kv_blocks_total"]
        prompts = [f"Story number {i}: once upon a time, in a village by the sea, there lived a fisherman who"
                   for i in range(a.requests)]
        results = [None] * len(prompts)
        done = threading.Event()
        peak = {"running": 0.0, "used": 0.0}

        def sample():
            while not done.is_set():
                try:
                    m = metrics(port, ["troupe_num_requests_running", "troupe_kv_blocks_used"])
                    peak["running"] = max(peak["running"], m["troupe_num_requests_running"])
                    peak["used"] = max(peak["used"], m["troupe_kv_blocks_used"])
                except OSError:
                    pass
                time.sleep(0.2)

        def client(i):
            results[i] = complete(port, prompts[i], a.gen_len)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        done.set()
        sampler.join()
        n_tokens = sum(n for _, n in results)
        preempted = metrics(port, ["troupe_preemptions_total"])["troupe_preemptions_total"]
        return {"preempted": preempted, "wall_s": wall, "tok_s": n_tokens / wall, "tokens": n_tokens, "peak_running": peak["running"],
                "peak_used_blocks": peak["used"], "blocks": total_blocks, "texts": [t for t, _ in results]}
    finally:
        stop(proc, 30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-mb", type=int, default=40)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not GEMMA.exists():
        raise SystemExit("models/gemma3-270m.gguf missing: run scripts/setup.sh")
    out = {}
    for name, args in [("windows (default)", []), ("--swa-full", ["--swa-full"])]:
        r = run(args, a)
        out[name] = r
        print(f"{name:18s} wall {r['wall_s']:7.1f} s  {r['tok_s']:6.2f} tok/s  peak running {r['peak_running']:.0f}  "
              f"peak KV blocks used {r['peak_used_blocks']:.0f} of {r['blocks']:.0f}  preemptions {r['preempted']:.0f}", flush=True)
    w, f = out["windows (default)"], out["--swa-full"]
    print(f"throughput ratio (windows / full): {w['tok_s'] / f['tok_s']:.2f}")
    print("same text both ways:", w["texts"] == f["texts"])


if __name__ == "__main__":
    main()
