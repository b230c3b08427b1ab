#!/usr/bin/env python3
"""How far a bf16 forward pass is from the model's exact function, row by row, next to the
llama.cpp-style one troupe's CPU backend computes. Explains the CUDA tests' tolerance: it prints,
for each position of one prefill, the normalized logits error max|a - b| / max|b| (the measure of
engine/cuda/cuda_forward.test.cpp) of

  cpu-like   llama.cpp's roundings (8-bit activation blocks, fp16 KV)  vs  float64 exact
  bf16       engine/cuda's roundings (bf16 weights, bf16 GEMM inputs and outputs, bf16 q/k/v and
             attention output, float32 residual stream)                vs  float64 exact
  bf16-cpu   the two against each other (what the CUDA tests compare)

  scripts/bf16_precision.py models/default.gguf [--tokens 40]

Both roundings come from tests/python/llama_ref.py (the float64 numpy reference); only the bf16
pipeline is defined here.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
import llama_ref as R  # noqa: E402
from llama_ref import _round_bf16 as rb  # noqa: E402


class Bf16Linear:
    """y = bf16(bf16(x) @ bf16(W)^T (+ b)): cuBLASLt over the dequantized bf16 weights."""

    def __init__(self, lin: "R._Linear"):
        self.w = rb(lin.w)
        self.b = lin.bias

    def __call__(self, x):
        y = rb(x) @ self.w.T
        return rb(y if self.b is None else y + self.b)


def bf16_logits(m: R.RefModel, tokens: np.ndarray) -> np.ndarray:
    hp = m.hp
    T = len(tokens)
    pos = np.arange(T)
    group = hp.n_head // hp.n_kv_head
    scale = 1 / np.sqrt(hp.head_dim_k)
    mask = np.arange(T)[None, :] > pos[:, None]
    x = m.token_embd[tokens]  # float32 residual stream (values exact in float64 here)
    for L in m.layers:
        q_, k_, v_, o_ = (Bf16Linear(L[n]) for n in ("q", "k", "v", "o"))
        g_, u_, d_ = (Bf16Linear(L[n]) for n in ("gate", "up", "down"))
        h = rb(m._rms_norm(x, L["attn_norm"]))
        q = rb(m._rope(q_(h).reshape(T, hp.n_head, -1), pos))
        k = rb(m._rope(k_(h).reshape(T, hp.n_kv_head, -1), pos))
        v = v_(h).reshape(T, hp.n_kv_head, -1)
        s = np.einsum("tkgd,skd->kgts", q.reshape(T, hp.n_kv_head, group, -1), k) * scale
        s = np.where(mask, -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + o_(rb(np.einsum("kgts,skd->tkgd", p, v).reshape(T, -1)))
        h = rb(m._rms_norm(x, L["ffn_norm"]))
        g = g_(h)
        x = x + d_(rb(g / (1 + np.exp(-g)) * u_(h)))
    return rb(m._rms_norm(x, m.output_norm)) @ rb(m.output.w).T


def row_errors(a: np.ndarray, b: np.ndarray) -> list[float]:
    return [float(np.max(np.abs(a[r] - b[r])) / np.max(np.abs(b[r]))) for r in range(len(b))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--text", default="Paged attention keeps every sequence in its own blocks, and the GPU")
    a = ap.parse_args()
    from llama_cpp import Llama  # the tokenizer only

    t = Llama(model_path=a.model, vocab_only=True, verbose=False).tokenize(a.text.encode(), add_bos=True, special=False)
    tokens = np.array([t[i % len(t)] for i in range(a.tokens)])  # as the CUDA test's prompt()
    exact_model = R.RefModel(a.model, dtype=np.float64)
    exact = exact_model.logits(tokens)
    cpu = R.RefModel(a.model, dtype=np.float64, emulate_llamacpp=True).logits(tokens)
    bf16 = bf16_logits(exact_model, tokens)
    rows = {"cpu-like": row_errors(cpu, exact), "bf16": row_errors(bf16, exact), "bf16-cpu": row_errors(bf16, cpu)}
    print(f"{exact_model.hp.n_layer} layers, {a.tokens} tokens; normalized error per row")
    print("row      " + " ".join(f"{r:5d}" for r in range(a.tokens)))
    for name, e in rows.items():
        print(f"{name:8s} " + " ".join(f"{v:5.3f}" for v in e))
    for name, e in rows.items():
        print(f"{name:8s} max {max(e):.3f} (row {int(np.argmax(e))}), median {float(np.median(e)):.3f}")


if __name__ == "__main__":
    main()
