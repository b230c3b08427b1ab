#!/usr/bin/env python3
"""Load driver for OpenAI-compatible completion servers with SSE streaming (troupe, llama-server).

Sends `POST /v1/completions` with `"stream": true` from N concurrent streams and measures, at the
arrival of each SSE event (time.perf_counter), time to first token, the gaps between token events
within each stream, end-to-end latency, and aggregate throughput. Standard library only (asyncio
streams and a small HTTP/1.1 client), so it runs in any Python >= 3.9 with no installs.

Closed loop (default): each of --concurrency streams sends its next request as soon as the previous
one finishes. Open loop (--rate R): requests arrive as a Poisson process of R per second; at most
--concurrency are in flight (0 = no cap) and a request's latency counts from its arrival, so time
spent waiting for a free stream is not hidden. The run ends after --requests requests or
--duration seconds (whichever first); in-flight requests finish, each bounded by --request-timeout.

Targets are restricted to loopback addresses. See load_tests/README.md for flags and examples.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from load_http import Connection, HttpError, Target
from load_prompts import PromptFactory, TokenIdFactory, parse_mix

MAX_ERROR_BODY_BYTES = 4096       # kept from a non-200 body for the error message


# ----------------------------------------------------------------------------------------------
# One streamed completion
# ----------------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    prompt_tokens: int
    gen_tokens_requested: int
    t_start: float = 0.0                 # arrival (open loop) or send time (closed loop)
    t_end: float = 0.0
    token_times: list[float] = field(default_factory=list)   # arrival of each token event
    n_tokens: int = 0                    # generated tokens (usage.completion_tokens if reported)
    error: Optional[str] = None


def build_body(prompt: "str | list[int]", gen_len: int, model: str, plain_openai: bool) -> bytes:
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0.0,
            "stream": True}
    if not plain_openai:
        body.update({"n_predict": gen_len, "ignore_eos": True})
    return json.dumps(body).encode()


async def stream_completion(conn: Connection, path: str, body: bytes,
                            result: RequestResult) -> None:
    """Sends one streaming request and fills `result`. Errors are recorded, not raised."""
    n_events_with_tokens = 0
    usage_tokens: Optional[int] = None
    try:
        status, headers = await conn.request("POST", path, body, "text/event-stream")
        if status != 200:
            err = bytearray()
            async for c in conn.body_chunks(headers):
                if len(err) < MAX_ERROR_BODY_BYTES:
                    err += c
            result.error = f"HTTP {status}: {bytes(err[:300]).decode('utf-8', 'replace')}"
            return
        buf = b""
        done = False
        async for chunk in conn.body_chunks(headers):
            now = time.perf_counter()
            buf += chunk
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            while not done and (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2:]
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue            # comments, event:, id:
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        raise HttpError(f"error event: {json.dumps(msg['error'])[:300]}")
                    usage = msg.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    choices = msg.get("choices") or ()
                    if not choices:
                        continue
                    choice = choices[0]
                    # A token event: no finish_reason yet, or a final event that still carries text.
                    if choice.get("finish_reason") is None or choice.get("text"):
                        result.token_times.append(now)
                        n_events_with_tokens += 1
        if not done:
            raise HttpError("stream ended without data: [DONE]")
    except (OSError, asyncio.IncompleteReadError, HttpError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        conn.close()
    except asyncio.CancelledError:
        result.error = "timeout"
        conn.close()
        raise
    finally:
        result.t_end = time.perf_counter()
        result.n_tokens = usage_tokens if usage_tokens is not None else n_events_with_tokens


# ----------------------------------------------------------------------------------------------
# Load generation
# ----------------------------------------------------------------------------------------------

@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8080"
    path: str = "/v1/completions"
    model: str = "default"
    concurrency: int = 1
    requests: int = 0                  # 0 = bounded by duration only
    duration: float = 0.0              # 0 = bounded by requests only
    rate: float = 0.0                  # > 0: open loop, Poisson arrivals per second
    mix: str = "128:128"
    request_timeout: float = 300.0
    warmup: int = 0
    seed: int = 1
    plain_openai: bool = False
    tokenize_path: str = "/tokenize"   # "" = never ask the server to count tokens
    token_ids: int = 0                 # > 0: prompts of random token ids below this vocab size


async def run_load(cfg: LoadConfig) -> dict:
    if cfg.requests <= 0 and cfg.duration <= 0:
        raise ValueError("give --requests and/or --duration so the run is bounded")
    if cfg.rate <= 0 and cfg.concurrency < 1:
        raise ValueError("closed loop needs --concurrency >= 1")
    target = Target.parse(cfg.url)
    shapes = parse_mix(cfg.mix)
    factory = (TokenIdFactory(cfg.token_ids, cfg.seed) if cfg.token_ids > 0
               else PromptFactory(target, cfg.tokenize_path, cfg.seed))
    await factory.probe()

    # Prompts are built (and their lengths checked) before the clock starts. Each request gets a
    # distinct prompt so no server can answer from a prompt cache. A run bounded by duration only
    # makes its further prompts during the run, cheaply, with the word counts found here.
    n_planned = cfg.requests if cfg.requests > 0 else max(4 * len(shapes), 2 * cfg.concurrency)
    planned = []
    for i in range(n_planned + cfg.warmup):
        p_len, g_len = shapes[i % len(shapes)]
        prompt, n_prompt = await factory.make(p_len)
        planned.append((build_body(prompt, g_len, cfg.model, cfg.plain_openai), n_prompt, g_len))
    factory.close()
    warm, planned = planned[:cfg.warmup], planned[cfg.warmup:]

    conn = Connection(target)
    for body, n_prompt, g_len in warm:
        r = RequestResult(n_prompt, g_len)
        await asyncio.wait_for(stream_completion(conn, cfg.path, body, r), cfg.request_timeout)
        if r.error:
            raise RuntimeError(f"warm-up request failed: {r.error}")
    conn.close()

    results: list[RequestResult] = []
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    deadline = t0 + cfg.duration if cfg.duration > 0 else float("inf")
    next_index = 0

    def take() -> Optional[tuple]:
        nonlocal next_index
        if (cfg.requests > 0 and next_index >= cfg.requests) or time.perf_counter() >= deadline:
            return None
        next_index += 1
        if next_index <= len(planned):
            return planned[next_index - 1]
        p_len, g_len = shapes[(next_index - 1) % len(shapes)]
        prompt, n_prompt = factory.make_quick(p_len)
        return build_body(prompt, g_len, cfg.model, cfg.plain_openai), n_prompt, g_len

    async def one(conn: Connection, item: tuple, t_start: float) -> None:
        body, n_prompt, g_len = item
        r = RequestResult(n_prompt, g_len, t_start=t_start)
        results.append(r)
        try:
            await asyncio.wait_for(stream_completion(conn, cfg.path, body, r), cfg.request_timeout)
        except asyncio.TimeoutError:
            r.error = r.error or "timeout"
            r.t_end = time.perf_counter()

    if cfg.rate <= 0:
        async def stream_loop() -> None:
            conn = Connection(target)
            while (item := take()) is not None:
                await one(conn, item, time.perf_counter())
            conn.close()
        await asyncio.gather(*(stream_loop() for _ in range(cfg.concurrency)))
    else:
        rng = random.Random(cfg.seed)
        gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency > 0 else None
        idle: list[Connection] = []
        tasks = []

        async def arrival(item: tuple, t_arrival: float) -> None:
            if gate is not None:
                await gate.acquire()
            conn = idle.pop() if idle else Connection(target)
            try:
                await one(conn, item, t_arrival)
            finally:
                idle.append(conn)
                if gate is not None:
                    gate.release()

        t_next = time.perf_counter()
        while (item := take()) is not None:
            tasks.append(asyncio.create_task(arrival(item, t_next)))
            t_next += rng.expovariate(cfg.rate)
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        await asyncio.gather(*tasks)
        for c in idle:
            c.close()

    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return summarize(cfg, results, wall, cpu)


# ----------------------------------------------------------------------------------------------
# Statistics and output
# ----------------------------------------------------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(cfg: LoadConfig, results: list[RequestResult], wall: float, cpu: float) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = sorted(r.token_times[0] - r.t_start for r in ok if r.token_times)
    itl = sorted(b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:]))
    e2e = sorted(r.t_end - r.t_start for r in ok)
    n_gen = sum(r.n_tokens for r in ok)
    n_short = sum(1 for r in ok if r.n_tokens < r.gen_tokens_requested)
    n_events = sum(len(r.token_times) for r in ok)

    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "url": cfg.url, "mode": "open" if cfg.rate > 0 else "closed", "rate": cfg.rate,
        "concurrency": cfg.concurrency, "mix": cfg.mix,
        "requests": len(results), "ok": len(ok), "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "short_requests": n_short,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "generated_tokens": n_gen, "token_events": n_events,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(n_gen / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99)),
        "driver_cpu_pct": round(100.0 * cpu / wall, 1) if wall > 0 else None,
    }


COLUMNS = [("conc", "concurrency", "{:>5}"), ("reqs", "requests", "{:>5}"),
           ("err", "errors", "{:>4}"), ("tok/s", "tokens_per_s", "{:>8.1f}"),
           ("req/s", "requests_per_s", "{:>6.2f}"),
           ("TTFT p50", "ttft_p50_ms", "{:>9.1f}"), ("TTFT p99", "ttft_p99_ms", "{:>9.1f}"),
           ("ITL p50", "itl_p50_ms", "{:>8.1f}"), ("ITL p99", "itl_p99_ms", "{:>8.1f}"),
           ("E2E p50", "e2e_p50_ms", "{:>8.0f}"), ("E2E p99", "e2e_p99_ms", "{:>8.0f}"),
           ("drvCPU%", "driver_cpu_pct", "{:>7.1f}")]


def format_header() -> str:
    widths = [len(fmt.format(0)) for _, _, fmt in COLUMNS]
    head = " ".join(name.rjust(w) for (name, _, _), w in zip(COLUMNS, widths))
    return head + "\n" + " ".join("-" * w for w in widths) + "   (latencies in ms)"


def format_row(s: dict) -> str:
    cells = []
    for _, key, fmt in COLUMNS:
        v = s.get(key)
        cells.append(fmt.format(v) if v is not None else fmt.replace(".1f", "").replace(
            ".2f", "").replace(".0f", "").format("-"))
    return " ".join(cells)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Flags shared with run_llama_server.py (everything but the target and the concurrency)."""
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--mix", default=None,
                   help="prompt:gen pairs chosen round-robin, e.g. 64:64,512:128 "
                        "(overrides --prompt-len/--gen-len)")
    p.add_argument("--requests", type=int, default=0, help="total measured requests")
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop issuing requests after this many seconds")
    p.add_argument("--rate", type=float, default=0.0,
                   help="open loop: Poisson arrivals per second (default: closed loop)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=0, help="unmeasured sequential requests first")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="default", help='"model" field of the request')
    p.add_argument("--path", default="/v1/completions")
    p.add_argument("--plain-openai", action="store_true",
                   help="send only standard OpenAI fields (no ignore_eos, n_predict)")
    p.add_argument("--tokenize-path", default="/tokenize",
                   help='server endpoint that counts prompt tokens ("" = estimate)')
    p.add_argument("--token-ids", type=int, default=0, metavar="N_VOCAB",
                   help="prompts of random token ids in [100, N_VOCAB) instead of words (the "
                        "workload of `troupe bench --concurrency`)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per run")


def config_from_args(a: argparse.Namespace, url: str, concurrency: int) -> LoadConfig:
    requests = a.requests
    if requests <= 0 and a.duration <= 0:
        requests = max(2 * concurrency, 8)
    return LoadConfig(url=url, path=a.path, model=a.model, concurrency=concurrency,
                      requests=requests, duration=a.duration, rate=a.rate,
                      mix=a.mix or f"{a.prompt_len}:{a.gen_len}",
                      request_timeout=a.request_timeout, warmup=a.warmup, seed=a.seed,
                      plain_openai=a.plain_openai, tokenize_path=a.tokenize_path,
                      token_ids=a.token_ids)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (loopback)")
    p.add_argument("-c", "--concurrency", type=int, default=1,
                   help="streams (closed loop) or in-flight cap (open loop, 0 = none)")
    add_load_args(p)
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a, a.url, a.concurrency)
        summary = asyncio.run(run_load(cfg))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"load_driver: {e}", file=sys.stderr)
        return 2
    print(format_header())
    print(format_row(summary))
    for sample in summary["error_samples"]:
        print(f"  error: {sample}")
    if a.json:
        print(json.dumps(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
