#!/usr/bin/env python3
"""Measures llama.cpp's llama-server (the benchmark peer) at several concurrencies.

For each concurrency N: starts llama-server on 127.0.0.1 with a free port, N slots and N x
--slot-ctx tokens of context (-t THREADS -np N -c N*slot_ctx --cont-batching), waits for /health
(bounded), runs load_driver at N closed-loop streams, and stops the server (always). Prints one table
row per N, and with --json one JSON line per N.

    .venv/bin/python load_tests/run_llama_server.py --concurrency 1,4,16,64 \\
        --prompt-len 128 --gen-len 128
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import load_driver

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BIN = ROOT / "build-peer" / "build" / "bin" / "llama-server"
DEFAULT_MODEL = ROOT / "models" / "default.gguf"
READY_TIMEOUT_S = 120.0     # model load + warm-up
STOP_TIMEOUT_S = 10.0       # SIGTERM grace before SIGKILL
CTX_PAD = 256               # llama.cpp rounds each slot's context up to a multiple of this


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    """Polls GET /health until it answers 200; raises if the server exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while starting; "
                               f"log tail:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass                     # not listening yet, or 503 while loading
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s; log tail:\n"
                       f"{tail(log_path)}")


def tail(path: Path, n_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, n_slots: int, slot_ctx: int, n_threads: int,
                 log_path: Path, extra: list[str]) -> Iterator[str]:
    """Runs llama-server for the duration of the block; yields its base URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(n_threads), "-np", str(n_slots), "-c", str(n_slots * slot_ctx),
           "--cont-batching", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, READY_TIMEOUT_S, log_path)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bin", type=Path, default=DEFAULT_BIN, help="llama-server binary "
                   "(scripts/build_llama_server.sh builds it)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_MODEL, help="model file")
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="comma-separated stream counts; each also sets the slot count")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--slot-ctx", type=int, default=0,
                   help="context per slot (default: longest prompt+gen of the mix + 64, "
                        "rounded up to a multiple of 256 as llama.cpp does)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep llama-server logs here (default: a temporary folder)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra llama-server argument (repeatable), e.g. --server-arg=--no-warmup")
    load_driver.add_load_args(p)
    a = p.parse_args(argv)

    if not a.bin.is_file() or not os.access(a.bin, os.X_OK):
        print(f"run_llama_server: no executable {a.bin}; run scripts/build_llama_server.sh",
              file=sys.stderr)
        return 2
    if not a.gguf.is_file():
        print(f"run_llama_server: no model {a.gguf}", file=sys.stderr)
        return 2
    try:
        levels = [int(x) for x in a.concurrency.split(",")]
        if any(n < 1 for n in levels):
            raise ValueError
        shapes = load_driver.parse_mix(a.mix or f"{a.prompt_len}:{a.gen_len}")
    except ValueError as e:
        print(f"run_llama_server: bad --concurrency or mix: {e}", file=sys.stderr)
        return 2
    # llama.cpp pads the per-slot context to a multiple of CTX_PAD anyway (llama-context.cpp).
    slot_ctx = a.slot_ctx or -(-(max(pl + gl for pl, gl in shapes) + 64) // CTX_PAD) * CTX_PAD

    log_dir_ctx = (contextlib.nullcontext(str(a.log_dir)) if a.log_dir
                   else tempfile.TemporaryDirectory(prefix="llama-server-"))
    failed = False
    with log_dir_ctx as log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        print(f"# llama-server {a.bin}, model {a.gguf.name}, -t {a.threads}, "
              f"slot ctx {slot_ctx}, mix {a.mix or f'{a.prompt_len}:{a.gen_len}'}")
        print(load_driver.format_header(), flush=True)
        for n in levels:
            log_path = Path(log_dir) / f"llama-server-np{n}.log"
            load1 = os.getloadavg()[0]
            try:
                with llama_server(a.bin, a.gguf, n, slot_ctx, a.threads, log_path,
                                  a.server_arg) as url:
                    cfg = load_driver.config_from_args(a, url, n)
                    summary = asyncio.run(load_driver.run_load(cfg))
            except (RuntimeError, ValueError, OSError) as e:
                print(f"{n:>5}  failed: {e}", flush=True)
                failed = True
                continue
            summary["server"] = "llama-server"
            summary["loadavg_1m_before"] = round(load1, 2)
            print(load_driver.format_row(summary), flush=True)
            for sample in summary["error_samples"]:
                print(f"  error: {sample}")
            failed |= summary["errors"] > 0
            if a.json:
                print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
