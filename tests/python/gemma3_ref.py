"""A plain numpy forward of a Gemma 3 GGUF model (the reference troupe's Gemma 3 path is held to).

Weights come from the `gguf` package's dequantization, the arithmetic is float64, attention is
dense with explicit causal and sliding-window masks: nothing is shared with troupe's kernels or
with llama.cpp's graph. What it encodes of Gemma 3 (as llama.cpp's converter and graph define it
for GGUF files, whose norm weights already hold the 1 + w of Gemma's RMSNorm):
  x = embedding * sqrt(d_model)
  per layer: h = RMSNorm(x) * attn_norm; q, k, v = h Wq, h Wk, h Wv;
             q, k per head RMSNorm * q_norm / k_norm; RoPE (NeoX pairs), base 10000 on
             sliding-window layers (il % 6 < 5), rope.freq_base on the others;
             softmax(q k^T / sqrt(head_dim)) over the causal window (the last `sliding_window`
             positions on sliding layers), GQA; o = attn Wo;
             x = x + RMSNorm(o) * post_attention_norm
             h = RMSNorm(x) * ffn_norm; f = (gelu_tanh(h Wgate) * h Wup) Wdown;
             x = x + RMSNorm(f) * post_ffw_norm
  logits = RMSNorm(x) * output_norm @ token_embd^T
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


class Gemma3Ref:
    def __init__(self, path: str | Path):
        r = gguf.GGUFReader(str(path))
        assert _field(r, "general.architecture") == "gemma3"
        a = "gemma3."
        self.n_layer = int(_field(r, a + "block_count"))
        self.d = int(_field(r, a + "embedding_length"))
        self.n_head = int(_field(r, a + "attention.head_count"))
        self.n_kv = int(_field(r, a + "attention.head_count_kv"))
        self.hd = int(_field(r, a + "attention.key_length"))
        self.eps = float(_field(r, a + "attention.layer_norm_rms_epsilon"))
        self.base = float(_field(r, a + "rope.freq_base"))
        self.window = int(_field(r, a + "attention.sliding_window"))
        self.t = {t.name: t for t in r.tensors}

    def w(self, name) -> np.ndarray:
        t = self.t[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))

    def rms(self, x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base):  # x: [n, heads, hd], NeoX pairs (i, i + hd/2)
        half = self.hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2 / self.hd)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    def logits(self, tokens, rows) -> np.ndarray:
        """Logits (float64) of the given row indices of `tokens` (one sequence from position 0)."""
        n, d, hd = len(tokens), self.d, self.hd
        emb = self.w("token_embd.weight")
        x = emb[np.asarray(tokens)].astype(np.float64) * np.sqrt(float(d))
        pos = np.arange(n)
        causal = pos[None, :] <= pos[:, None]
        windowed = causal & (pos[:, None] - pos[None, :] < self.window)
        group = self.n_head // self.n_kv
        for il in range(self.n_layer):
            p = f"blk.{il}."
            sliding = il % 6 < 5
            h = self.rms(x, self.w(p + "attn_norm.weight"))
            q = (h @ self.w(p + "attn_q.weight").T.astype(np.float64)).reshape(n, self.n_head, hd)
            k = (h @ self.w(p + "attn_k.weight").T.astype(np.float64)).reshape(n, self.n_kv, hd)
            v = (h @ self.w(p + "attn_v.weight").T.astype(np.float64)).reshape(n, self.n_kv, hd)
            q = self.rms(q, self.w(p + "attn_q_norm.weight"))
            k = self.rms(k, self.w(p + "attn_k_norm.weight"))
            base = 10000.0 if sliding else self.base
            q, k = self.rope(q, pos, base), self.rope(k, pos, base)
            mask = windowed if sliding else causal
            o = np.empty((n, self.n_head, hd))
            for hh in range(self.n_head):
                kh, vh = k[:, hh // group], v[:, hh // group]
                s = (q[:, hh] @ kh.T) / np.sqrt(hd)
                s = np.where(mask, s, -np.inf)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                o[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ vh
            o = o.reshape(n, self.n_head * hd) @ self.w(p + "attn_output.weight").T.astype(np.float64)
            x = x + self.rms(o, self.w(p + "post_attention_norm.weight"))
            h = self.rms(x, self.w(p + "ffn_norm.weight"))
            g = h @ self.w(p + "ffn_gate.weight").T.astype(np.float64)
            u = h @ self.w(p + "ffn_up.weight").T.astype(np.float64)
            g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            f = (g * u) @ self.w(p + "ffn_down.weight").T.astype(np.float64)
            x = x + self.rms(f, self.w(p + "post_ffw_norm.weight"))
        out = self.rms(x[np.asarray(rows)], self.w("output_norm.weight"))
        return out @ emb.T.astype(np.float64)
