#!/usr/bin/env python3
"""troupe vs llama.cpp on the CPU, same GGUF, same machine, same run.

Measures prefill tokens/s (prompt of --prompt-len random tokens, one sequence) and single-stream
decode tokens/s (--gen-len tokens after that prompt), each the median of --reps runs after a
warm-up, for troupe (`troupe bench`) and for llama.cpp through llama-cpp-python's low-level
llama_decode (built from source for this CPU by `scripts/setup.sh --bench`). Also reports the
memory-bandwidth roofline for decode (weight bytes per token / measured copy bandwidth) and the
peak RSS of a `troupe generate` run.

    .venv/bin/python scripts/bench_cpu.py --threads 2
"""
import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def troupe_bench(binary, model, threads, prompt_len, gen_len, reps):
    out = subprocess.run([binary, "bench", "-m", model, "-t", str(threads), "--prompt-len", str(prompt_len),
                          "--gen-len", str(gen_len), "--reps", str(reps), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llamacpp_bench(model, threads, prompt_len, gen_len, reps):
    import llama_cpp as lc

    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    m = lc.llama_model_load_from_file(model.encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx = prompt_len + gen_len + 16
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(m, cp)
    vocab = lc.llama_model_get_vocab(m)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    rng = np.random.default_rng(1234)
    prompt = rng.integers(0, n_vocab, prompt_len).tolist()
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(tokens, pos0, last_logits):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if (last_logits and i == len(tokens) - 1) else 0
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    pp, tg = [], []
    for rep in range(reps + 1):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        for p in range(0, prompt_len, 512):
            chunk = prompt[p:p + 512]
            decode(chunk, p, p + len(chunk) == prompt_len)
        t1 = time.perf_counter()
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        for i in range(gen_len):
            decode([tok], prompt_len + i, True)
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
        t2 = time.perf_counter()
        if rep:
            pp.append(prompt_len / (t1 - t0))
            tg.append(gen_len / (t2 - t1))
    info = lc.llama_print_system_info().decode()
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(m)
    return {"prefill_tok_s": float(np.median(pp)), "decode_tok_s": float(np.median(tg)), "system_info": info}


def copy_bandwidth_gbs(threads):
    """Read+write bandwidth of a large numpy copy (single thread) as a rough roofline figure."""
    a = np.ones(256 * 1024 * 1024 // 8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        dt = time.perf_counter() - t0
        best = max(best, 2 * a.nbytes / dt / 1e9)
    return best


def peak_rss_mb(binary, model, threads):
    r = subprocess.run(["/usr/bin/time", "-v", binary, "generate", "-m", model, "-t", str(threads), "-p",
                        "The quick brown fox", "-n", "64", "--temperature", "0", "-q"],
                       capture_output=True, text=True)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return int(m.group(1)) / 1024 if m else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "default.gguf"))
    ap.add_argument("--troupe", default=os.path.join(ROOT, "build", "troupe"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = os.path.realpath(a.model)
    t = troupe_bench(a.troupe, model, a.threads, a.prompt_len, a.gen_len, a.reps)
    l = llamacpp_bench(model, a.threads, a.prompt_len, a.gen_len, a.reps)
    bw = copy_bandwidth_gbs(a.threads)
    roof_tok_s = bw / t["weight_gb_per_step"]
    rss = peak_rss_mb(a.troupe, model, a.threads)
    size_mb = os.path.getsize(model) / 2**20
    print(f"llama.cpp system info: {l['system_info'].strip()}")
    print(f"troupe isa: {t['isa']}, threads {a.threads}")
    print(f"| metric | troupe | llama.cpp | ratio |")
    print(f"| --- | --- | --- | --- |")
    print(f"| prefill pp{a.prompt_len} tok/s | {t['prefill_tok_s']:.1f} | {l['prefill_tok_s']:.1f} | {t['prefill_tok_s'] / l['prefill_tok_s']:.2f} |")
    print(f"| decode tg{a.gen_len} tok/s | {t['decode_tok_s']:.1f} | {l['decode_tok_s']:.1f} | {t['decode_tok_s'] / l['decode_tok_s']:.2f} |")
    print(f"decode roofline: {t['weight_gb_per_step'] * 1e3:.1f} MB of weights per token / {bw:.1f} GB/s copy bandwidth "
          f"= {roof_tok_s:.0f} tok/s; troupe at {t['decode_tok_s'] / roof_tok_s:.0%} of it")
    print(f"peak RSS of `troupe generate` (64 tokens): {rss:.0f} MB; model file {size_mb:.0f} MB; "
          f"overhead {rss - size_mb:.0f} MB")


if __name__ == "__main__":
    sys.exit(main())
