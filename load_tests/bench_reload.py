#!/usr/bin/env python3
"""What replacing the served model costs the clients: troupe's hot reload vs restarting llama-server.

The same open-loop load (load_driver: Poisson arrivals, SSE streaming, greedy, ignore_eos) runs
for --duration seconds against, in turn:
  troupe         `troupe serve`, no reload (the baseline of this run);
  troupe-reload  `troupe serve`, POST /admin/reload every --every seconds (alternately the model
                 file and a copy of it at another path, so a new file is mapped each time);
  llama-restart  llama-server (built by scripts/build_llama_server.sh), stopped (SIGTERM) and
                 started again on the same port every --every seconds: what its users do to load
                 a new model file. The downtime of each restart is measured until /health is 200.
Prints one JSON line per system: the driver's summary (requests, errors, TTFT / ITL percentiles)
plus the reloads' durations as the operator saw them.

    .venv/bin/python load_tests/bench_reload.py --duration 45 --every 10 --rate 2
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from run_llama_server import DEFAULT_BIN, DEFAULT_MODEL, ROOT, free_port, tail, wait_ready

TROUPE = ROOT / "build" / "troupe"


def post(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_driver(url: str, a: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).parent / "load_driver.py"), "--url", url, "--rate", str(a.rate),
           "-c", str(a.cap), "--duration", str(a.duration), "--prompt-len", str(a.prompt_len),
           "--gen-len", str(a.gen_len), "--request-timeout", "120", "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_driver(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("load_driver printed no summary:\n" + out[-2000:])


def keep(summary: dict) -> dict:
    keys = ["requests", "ok", "errors", "error_samples", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]
    return {k: summary[k] for k in keys if k in summary}


def troupe_run(a: argparse.Namespace, reload_every: float, copy: Path) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="troupe-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(a.troupe), "serve", "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
                             "--max-num-seqs", str(a.cap)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    reloads = []
    try:
        wait_ready(proc, url, 120, Path(log.name))
        driver = start_driver(url, a)
        if reload_every > 0:
            t_end = time.monotonic() + a.duration
            paths = [str(copy), str(a.gguf)]
            time.sleep(reload_every)
            while time.monotonic() + 1 < t_end:
                t0 = time.monotonic()
                r = post(url + "/admin/reload", {"model_path": paths[len(reloads) % 2]})
                reloads.append({"version": r["version"], "wall_s": round(time.monotonic() - t0, 3),
                                "load_s": round(r["load_s"], 3)})
                time.sleep(reload_every)
        return {**keep(finish_driver(driver)), "reloads": reloads}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def llama_run(a: argparse.Namespace, restart_every: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    ctx = a.cap * (a.prompt_len + a.gen_len + 256)
    cmd = [str(a.llama_server), "-m", str(a.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
           "-np", str(a.cap), "-c", str(ctx), "--cont-batching"]

    def launch() -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    proc = launch()
    restarts = []
    try:
        wait_ready(proc, url, 120, log)
        driver = start_driver(url, a)
        t_end = time.monotonic() + a.duration
        time.sleep(restart_every)
        while time.monotonic() + 1 < t_end:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            killed = False
            try:
                proc.wait(timeout=a.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed = True
            t1 = time.monotonic()
            proc = launch()
            wait_ready(proc, url, 120, log)
            t2 = time.monotonic()
            restarts.append({"downtime_s": round(t2 - t0, 3), "stop_s": round(t1 - t0, 3), "killed": killed,
                             "start_s": round(t2 - t1, 3)})
            time.sleep(restart_every)
        return {**keep(finish_driver(driver)), "restarts": restarts}
    except RuntimeError:
        print(tail(log), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--troupe", type=Path, default=TROUPE)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_BIN)
    p.add_argument("--gguf", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--duration", type=float, default=45, help="seconds of load per system")
    p.add_argument("--every", type=float, default=10, help="seconds between reloads / restarts")
    p.add_argument("--rate", type=float, default=2, help="Poisson arrivals per second")
    p.add_argument("--cap", type=int, default=8, help="requests in flight at most (and parallel slots)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stop-timeout", type=float, default=5, help="llama-server: SIGTERM, then SIGKILL after this long")
    p.add_argument("--systems", default="troupe,troupe-reload,llama-restart")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "copy.gguf"
        shutil.copyfile(a.gguf, copy)
        for system in a.systems.split(","):
            if system == "troupe":
                r = troupe_run(a, 0, copy)
            elif system == "troupe-reload":
                r = troupe_run(a, a.every, copy)
            elif system == "llama-restart":
                r = llama_run(a, a.every)
            else:
                raise SystemExit(f"unknown system {system}")
            print(json.dumps({"system": system, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
