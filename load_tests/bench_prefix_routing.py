#!/usr/bin/env python3
"""Prefix-aware vs least-loaded routing over data-parallel replicas, same machine, same workload.

For each routing policy: a replica `troupe serve --publish-port P -t 1` and a front
`troupe serve --replica 127.0.0.1:P --replica-routing POLICY -t 1`; then N requests from C closed-loop
clients, each a random one of S shared "system prompts" (about L tokens of words) plus a short
question, streamed (SSE), T tokens generated. Reports the time to first token, throughput and the
prompt tokens served from the replicas' prefix caches (their /metrics).

    .venv/bin/python load_tests/bench_prefix_routing.py [--systems 8] [--system-len 512] [--requests 64]
"""
import argparse
import http.client
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))
from bench_util import free_port, get, metric, stop, wait  # noqa: E402
from load_prompts import WORDS  # noqa: E402

TROUPE = os.environ.get("TROUPE_BIN", str(ROOT / "build" / "troupe"))


def serve(port, *args):
    p = subprocess.Popen([TROUPE, "serve", "--host", "127.0.0.1", "--port", str(port), "-t", "1", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait(lambda: get(port, "/health")[0] == 200, 60, f"troupe serve {' '.join(args)}")
    return p


def stream(port, prompt, max_tokens):
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(r.read())
    ttft, n = None, 0
    for raw in r:
        line = raw.decode().strip()
        if line.startswith("data: {") and '"text"' in line:
            n += 1
            if ttft is None:
                ttft = time.monotonic() - t0
    c.close()
    return ttft, time.monotonic() - t0, n


def run(policy, a):
    rng = random.Random(a.seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(a.system_len)) for _ in range(a.systems)]
    questions = [f"Question {i}: what is the {rng.choice(WORDS)} of the {rng.choice(WORDS)}?" for i in range(a.requests)]
    order = [(rng.randrange(a.systems), q) for q in questions]
    rport, rhttp, fport = free_port(), free_port(), free_port()
    procs = [serve(rhttp, "--publish-port", str(rport))]
    try:
        procs.append(serve(fport, "--replica", f"127.0.0.1:{rport}", "--replica-routing", policy))
        wait(lambda: metric(fport, "troupe_replica_up") == 2, 20, "the front did not connect")
        hits0 = metric(fport, "troupe_prefix_cache_hits_total") + metric(rhttp, "troupe_prefix_cache_hits_total")
        queries0 = metric(fport, "troupe_prefix_cache_queries_total") + metric(rhttp, "troupe_prefix_cache_queries_total")
        results, lock, nxt = [], threading.Lock(), [0]

        def client():
            while True:
                with lock:
                    if nxt[0] >= len(order):
                        return
                    s, q = order[nxt[0]]
                    nxt[0] += 1
                out = stream(fport, systems[s] + "\n\n" + q, a.gen_len)
                with lock:
                    results.append(out)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        hits = metric(fport, "troupe_prefix_cache_hits_total") + metric(rhttp, "troupe_prefix_cache_hits_total") - hits0
        queries = metric(fport, "troupe_prefix_cache_queries_total") + metric(rhttp, "troupe_prefix_cache_queries_total") - queries0
        by_prefix = metric(fport, "troupe_replica_prefix_routed_total")
        ttfts = sorted(r[0] for r in results)
        return {
            "routing": policy, "requests": len(results), "wall_s": round(wall, 2),
            "tokens_per_s": round(sum(r[2] for r in results) / wall, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "prefix_hit_tokens": int(hits), "prompt_tokens": int(queries),
            "hit_rate": round(hits / queries, 3) if queries else 0.0, "routed_by_prefix": int(by_prefix),
        }
    finally:
        for p in procs:
            stop(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512, help="words (about tokens) per system prompt")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--policies", default="least_loaded,prefix", help="in this order")
    a = ap.parse_args()
    for policy in a.policies.split(","):
        print(json.dumps(run(policy, a)), flush=True)


if __name__ == "__main__":
    main()
