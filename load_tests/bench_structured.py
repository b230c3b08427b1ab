#!/usr/bin/env python3
"""Structured output (response_format json_schema) under load: troupe vs llama-server, same machine.

For each system: the server on the default model with the same threads and parallel slots, then
R chat requests, C at a time, each held to the same JSON schema (sampled at temperature 1 with
seed i, so the outputs differ), then the same R requests without the schema, each with max_tokens
equal to the mean length of the structured outputs and ignore_eos (the free-text baseline: same
token counts, no grammar). Every structured output is validated with the `jsonschema` package.
Reports the output tokens/s of both runs (their ratio is the cost of the grammar), latency p50/p99
and the share of outputs that are complete and valid.

    .venv/bin/python load_tests/bench_structured.py [--requests 24] [--concurrency 4] [--threads 2]
"""
import argparse
import http.client
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import jsonschema

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))
from bench_util import free_port, stop, wait  # noqa: E402
from run_llama_server import DEFAULT_BIN  # noqa: E402

TROUPE = os.environ.get("TROUPE_BIN", str(ROOT / "build" / "troupe"))
MODEL = ROOT / "models" / "default.gguf"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": ["string", "null"], "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
}
MESSAGES = [{"role": "user", "content": "Invent a user of a web service and describe them as JSON."}]


def chat(port, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {data}")
    return time.perf_counter() - t0, data


def up(port):
    try:
        chat(port, {"messages": MESSAGES, "max_tokens": 1}, timeout=5)
        return True
    except RuntimeError:  # 503 while loading
        return False


def run(port, bodies, concurrency):
    """All bodies, `concurrency` at a time; (wall seconds, [(latency, response)])."""
    out = [None] * len(bodies)
    nxt = iter(range(len(bodies)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            out[i] = chat(port, bodies[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def figures(wall, results):
    lat = sorted(r[0] for r in results)
    toks = sum(r[1]["usage"]["completion_tokens"] for r in results)
    return {"tok_s": toks / wall, "tokens": toks, "wall_s": wall, "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def bench(port, a, name):
    structured = [{"model": "default", "messages": MESSAGES, "max_tokens": a.max_tokens, "temperature": 1.0,
                   "seed": i, "response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}}
                  for i in range(a.requests)]
    chat(port, dict(structured[0], seed=10_000))  # warm-up
    wall, res = run(port, structured, a.concurrency)
    valid = 0
    for _, r in res:
        ch = r["choices"][0]
        try:
            if ch["finish_reason"] == "stop":
                jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)
                valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    s = figures(wall, res)
    mean_len = max(1, round(s["tokens"] / len(res)))
    free = [{"model": "default", "messages": MESSAGES, "max_tokens": mean_len, "temperature": 1.0, "seed": i,
             "ignore_eos": True} for i in range(a.requests)]
    fwall, fres = run(port, free, a.concurrency)
    f = figures(fwall, fres)
    print(f"{name:<13} structured {s['tok_s']:7.1f} tok/s ({s['tokens']} tokens, mean {mean_len}), "
          f"p50 {s['p50_s']:.2f} s, p99 {s['p99_s']:.2f} s, valid {valid}/{len(res)} | "
          f"free text {f['tok_s']:7.1f} tok/s ({f['tokens']} tokens) | grammar cost {f['tok_s'] / s['tok_s']:.2f}x",
          flush=True)
    return {"system": name, "structured": s, "free": f, "valid": valid, "requests": len(res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--llama-server", default=str(DEFAULT_BIN))
    ap.add_argument("--skip-peer", action="store_true")
    a = ap.parse_args()
    rows = []

    port = free_port()
    proc = subprocess.Popen([TROUPE, "serve", "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
                             "--max-num-seqs", str(a.concurrency)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait(lambda: up(port), 120, "troupe did not start")
        rows.append(bench(port, a, "troupe"))
    finally:
        stop(proc)

    if not a.skip_peer and pathlib.Path(a.llama_server).exists():
        port = free_port()
        proc = subprocess.Popen([a.llama_server, "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
                                 "-t", str(a.threads), "-np", str(a.concurrency), "-c", str(a.concurrency * 1024),
                                 "--cont-batching"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait(lambda: up(port), 120, "llama-server did not start")
            rows.append(bench(port, a, "llama-server"))
        finally:
            stop(proc)
    elif not a.skip_peer:
        print(f"no {a.llama_server}: run scripts/build_llama_server.sh (or --skip-peer)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
