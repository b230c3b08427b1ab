#!/usr/bin/env python3
"""Writes tiny random-weight Llama-family (and Gemma 3) GGUF models for tests.

The files use the metadata keys and tensor names llama.cpp uses (llama, qwen2 and gemma3
architectures; gemma3 adds QK-norm weights, the norms of each block's output and a sliding window),
a small byte-level "gpt2" tokenizer (256 byte tokens through the GPT-2 byte<->unicode map, a few
dozen merges and four control tokens) and any of the weight types troupe reads. Everything is
seeded: the same arguments give the same bytes.

  gen_tiny_model.py OUT.gguf [--arch llama|qwen2] [--n-layer 2] [--d-model 64] [--n-head 4]
                    [--n-kv-head 2] [--head-dim 16] [--d-ff 96] [--vocab byte|N] [--ctx 256]
                    [--tied|--untied] [--qtype f32|f16|bf16|q8_0|q4_0|q4_1|q4_k|q5_k|q6_k]
                    [--rope-dim N] [--embd-qtype TYPE] [--mix k_m] [--seed 0]
  gen_tiny_model.py OUT.gguf --preset NAME      one preset (see --list)
  gen_tiny_model.py [OUTDIR] --preset all       every preset, as OUTDIR/NAME.gguf
                                                (default OUTDIR: tests/fixtures/generated)
  gen_tiny_model.py --list                      the presets, one a line

Weight scales: matrices are N(0, 1/fan_in), so every projection keeps activations O(1); the
embedding / output matrix is N(0, 9/d_model), which makes logits roughly N(0, 3^2): peaked
enough that greedy top-2 margins are usually clear, far from one-hot. Norm weights are
1 + N(0, 0.1^2) and q/k/v biases N(0, 0.2^2), kept F32 like llama.cpp does.

Quantized types: F16/BF16/Q8_0/Q4_0/Q4_1 through gguf.quants.quantize; Q4_K/Q5_K/Q6_K (which gguf
cannot quantize) through the simple min/max block quantizers below, checked against
gguf.quants.dequantize when written. K-quants need every row length (d_model, n_head*head_dim,
d_ff) to be a multiple of 256, the 32-blocks of the other types a multiple of 32.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as e:  # pragma: no cover - message for people without the venv
    sys.exit(f"gen_tiny_model: needs the gguf package ({e}); use .venv/bin/python")

QTYPES: dict[str, QT] = {
    "f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K,
}
FILE_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18,
    "bf16": 32,
}
ROPE_BASE = 10000.0
GEMMA_ROPE_BASE = 1e6  # Gemma 3's global layers (its sliding-window layers: 10000, fixed)
RMS_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str = "llama"
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    d_ff: int = 96
    vocab: int | None = None  # None: the byte-level vocab's own size
    ctx: int = 256
    tied: bool = True
    qtype: str = "f32"
    rope_dim: int | None = None  # None: head_dim
    seed: int = 0
    embd_qtype: str | None = None  # token_embd / output type; None: qtype
    n_expert: int = 0       # > 0: a Mixtral-style mixture of experts in every layer (llama arch)
    n_expert_used: int = 0  # experts per token
    # "k_m": llama.cpp's Q4_K_M / Q5_K_M mix over qtype's layers: attn_v and ffn_down of every
    # other layer (0, 2, ...) and an untied output head in q6_k, the rest in qtype
    mix: str | None = None
    sliding_window: int = 0  # gemma3: positions a sliding-window layer (il % 6 < 5) attends to

    @property
    def embd_type(self) -> str:
        return self.embd_qtype if self.embd_qtype is not None else self.qtype

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(f"invalid model spec: {what} ({self})")
        need(self.arch in ("llama", "qwen2", "gemma3"), "arch must be llama, qwen2 or gemma3")
        need(self.arch != "gemma3" or (self.sliding_window > 0 and self.n_expert == 0),
             "gemma3 needs a sliding window and no experts")
        need(self.qtype in QTYPES and self.embd_type in QTYPES,
             f"qtype must be one of {', '.join(QTYPES)}")
        need(min(self.n_layer, self.d_model, self.n_head, self.n_kv_head, self.head_dim,
                 self.d_ff, self.ctx) > 0, "sizes must be positive")
        need(self.n_head % self.n_kv_head == 0, "n_head must be a multiple of n_kv_head")
        need(self.n_expert == 0 or (self.arch == "llama" and 0 < self.n_expert_used <= self.n_expert),
             "a mixture of experts needs arch llama and 0 < n_expert_used <= n_expert")
        need(self.mix in (None, "k_m"), "mix must be k_m or absent")
        need(self.mix is None or self.qtype in ("q4_k", "q5_k"), "the k_m mix takes qtype q4_k or q5_k")
        need(self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)")
        rope_dim = self.rope_dim if self.rope_dim is not None else self.head_dim
        need(0 < rope_dim <= self.head_dim and rope_dim % 2 == 0,
             "rope_dim must be even and in (0, head_dim]")
        need(self.vocab is None or self.vocab >= len(byte_vocab()[0]),
             f"vocab must be at least the byte vocab's {len(byte_vocab()[0])} tokens")
        block = gguf.GGML_QUANT_SIZES[QTYPES[self.qtype]][0]
        for name, n in (("d_model", self.d_model), ("n_head*head_dim", self.n_head * self.head_dim),
                        ("d_ff", self.d_ff)):
            need(n % block == 0, f"{name}={n} must be a multiple of {self.qtype}'s block of {block}")
        block = gguf.GGML_QUANT_SIZES[QTYPES[self.embd_type]][0]
        need(self.d_model % block == 0,
             f"d_model={self.d_model} must be a multiple of {self.embd_type}'s block of {block}")

    @property
    def n_vocab(self) -> int:
        return self.vocab if self.vocab is not None else len(byte_vocab()[0])

    def tensor_qtype(self, tname: str) -> str:
        """The type a weight matrix is written in."""
        if self.mix == "k_m":
            layer = int(tname.split(".")[1]) if tname.startswith("blk.") else -1
            if tname == "output.weight" or (layer % 2 == 0 and tname.split(".")[2] in ("attn_v", "ffn_down")):
                return "q6_k"
        return self.embd_type if tname in ("token_embd.weight", "output.weight") else self.qtype


def _spec(**kw) -> ModelSpec:
    return ModelSpec(**kw)


_KQ = dict(d_model=256, n_head=4, n_kv_head=2, head_dim=64, d_ff=512)  # rows of 256 for K-quants
# name -> (spec, whether llama.cpp can load it: its llama/qwen2 graphs assert rope_dim == head_dim,
# and its qwen2 loader wants n_head * head_dim == d_model).
PRESETS: dict[str, tuple[ModelSpec, bool]] = {
    # GQA ratio, head size, tied/untied with F32 weights (exact arithmetic everywhere)
    "llama_f32_gqa2": (_spec(), True),
    "llama_f32_mha_untied": (_spec(n_kv_head=4, tied=False, seed=1), True),
    "llama_f32_mqa": (_spec(n_kv_head=1, seed=2), True),
    "llama_f32_hd32_gqa4": (_spec(d_model=128, n_head=4, n_kv_head=1, head_dim=32, d_ff=192,
                                  seed=3), True),
    "llama_f32_hd64": (_spec(d_model=128, n_head=2, n_kv_head=2, head_dim=64, d_ff=160,
                             tied=False, seed=4), True),
    # 6 heads over 3 KV heads: 2 tensor-parallel ranks neither split nor replicate the KV heads
    "llama_f32_kv3": (_spec(d_model=96, n_head=6, n_kv_head=3, head_dim=16, seed=8), True),
    # key_length != d_model / n_head (q and o projections are not square)
    "llama_f32_keylen32": (_spec(n_head=4, n_kv_head=2, head_dim=32, seed=5), True),
    # rotary on the first 8 of 16 dims of each head (llama.cpp's llama graph refuses this)
    "llama_f32_partial_rope": (_spec(rope_dim=8, seed=6), False),
    # four layers, vocab padded past the tokenizer's size, untied output
    "llama_f32_4layer_vocab384": (_spec(n_layer=4, vocab=384, tied=False, seed=7), True),
    # every weight type (embeddings and output in the same type)
    "llama_f16": (_spec(qtype="f16", seed=10), True),
    "llama_bf16_untied": (_spec(qtype="bf16", tied=False, seed=11), True),
    "llama_q8_0": (_spec(qtype="q8_0", seed=12), True),
    "llama_q4_0_untied": (_spec(qtype="q4_0", tied=False, seed=13), True),
    "llama_q4_1_mqa": (_spec(qtype="q4_1", n_kv_head=1, seed=14), True),
    "llama_q4_k": (_spec(qtype="q4_k", **_KQ, seed=15), True),
    "llama_q5_k_untied": (_spec(qtype="q5_k", tied=False, **_KQ, seed=16), True),
    "llama_q6_k": (_spec(qtype="q6_k", **_KQ, seed=17), True),
    # a Q4_K_M file's mix: q4_k layers with q6_k attn_v and ffn_down in layers 0 and 2, q6_k output
    "llama_q4_k_m": (_spec(qtype="q4_k", mix="k_m", n_layer=3, tied=False, **_KQ, seed=19), True),
    # the default model's mix: q4_1 layers, q8_0 (tied) embeddings
    "llama_q4_1_embd_q8_0": (_spec(qtype="q4_1", embd_qtype="q8_0", seed=18), True),
    # Mixtral-style mixture of experts: 4 experts, 2 per token (router in F32, as llama.cpp writes it)
    "llama_moe_f32": (_spec(n_expert=4, n_expert_used=2, seed=30), True),
    "llama_moe_q8_0": (_spec(qtype="q8_0", n_expert=4, n_expert_used=2, seed=31), True),
    # qwen2: NeoX RoPE and q/k/v biases
    "qwen2_f32_untied": (_spec(arch="qwen2", tied=False, seed=20), True),
    "qwen2_f32_mqa": (_spec(arch="qwen2", n_kv_head=1, seed=21), True),
    "qwen2_f16_mha": (_spec(arch="qwen2", n_kv_head=4, qtype="f16", seed=22), True),
    "qwen2_q8_0": (_spec(arch="qwen2", qtype="q8_0", seed=23), True),
    "qwen2_q4_1_untied": (_spec(arch="qwen2", qtype="q4_1", tied=False, seed=24), True),
    "qwen2_q6_k_gqa4": (_spec(arch="qwen2", qtype="q6_k", d_model=256, n_head=4, n_kv_head=1,
                              head_dim=64, d_ff=256, seed=25), True),
}

# Gemma 3 at Gemma 3 270M's head shape (4 query heads of 256 over one KV head), 6 layers (the
# last global, the others a window of 24 positions), bf16 (4.9 MB: it travels to the device too):
# kept apart from PRESETS, whose tests hold every preset to the Llama-family numpy reference
# (llama_ref.py); Gemma 3's is gemma3_ref.py.
GEMMA_PRESETS: dict[str, tuple[ModelSpec, bool]] = {
    "gemma3_bf16_hd256": (_spec(arch="gemma3", n_layer=6, d_model=128, n_head=4, n_kv_head=1,
                                head_dim=256, d_ff=192, qtype="bf16", sliding_window=24, seed=40), False),
}


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE in the GPT-2 style

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# Merge rules in rank order, as plain text pairs; each result becomes a token.
_MERGES = [
    (" ", "t"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"), (" t", "he"), ("e", "r"),
    (" ", "a"), (" ", "s"), ("a", "t"), ("e", "n"), (" ", "o"), (" ", "w"), ("n", "d"),
    ("i", "s"), ("o", "r"), ("i", "t"), ("e", "s"), (" ", "c"), ("a", "n"), (" ", "b"),
    ("e", "d"), (" ", "f"), ("in", "g"), (" ", "p"), ("o", "u"), (" a", "nd"), ("a", "r"),
    ("a", "l"), (" o", "f"), (" ", "m"), ("l", "l"), (" t", "o"), (" ", "d"), (" ", "h"),
    ("i", "c"), (" ", "i"), (" i", "n"), ("l", "e"), ("o", "m"),
]
SPECIAL_TOKENS = ["<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges). Token id b < 256 is the byte b; merges follow, then the
    control tokens <|bos|> (bos), <|endoftext|> (eos), <|im_start|>, <|im_end|>."""
    enc = bytes_to_unicode()

    def u(text: str) -> str:
        return "".join(enc[b] for b in text.encode("utf-8"))

    tokens = [enc[b] for b in range(256)]
    merges = []
    for a, b in _MERGES:
        assert u(a) in tokens and u(b) in tokens, (a, b)
        merges.append(f"{u(a)} {u(b)}")
        tokens.append(u(a + b))
    assert len(set(tokens)) == len(tokens)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    return tokens, types, merges


# ---------------------------------------------------------------------------------------------
# K-quant writers (gguf has dequantizers for these but no quantizers). Plain min/max quantizers:
# not llama.cpp's error-minimising search, but every block they write is a valid block.

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12-byte 6-bit scale/min packing of Q4_K/Q5_K (inverse of Q4_K.get_scale_min)."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _asym_k_quant(blocks: np.ndarray, n_levels: int):
    """Per 32-sub-block scale and min for Q4_K/Q5_K: x ~ d*sc*q - dmin*m with 6-bit sc, m."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    hi = np.maximum(sub.max(-1), lo + 1e-12)
    scale = (hi - lo) / (n_levels - 1)
    d = _f16(scale.max(-1) / 63).astype(np.float32)
    dmin = _f16(np.maximum((-lo).max(-1), 1e-12) / 63).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 1, 63)
    mn = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * mn
    q = np.clip(np.rint((sub + eff_min[..., None]) / eff_scale[..., None]), 0, n_levels - 1)
    return d, dmin, sc, mn, q.astype(np.uint8).reshape(n, 256)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asym_k_quant(blocks, 16)
    qs = q.reshape(-1, 4, 2, 32)
    qs = qs[:, :, 0, :] | (qs[:, :, 1, :] << 4)
    return np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), _f16(dmin).view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, mn), qs.reshape(-1, 128)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asym_k_quant(blocks, 32)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = low[:, :, 0, :] | (low[:, :, 1, :] << 4)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j, :] << j
    return np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), _f16(dmin).view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, mn), qh, qs.reshape(-1, 128)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.maximum(np.abs(sub).max(-1), 1e-12) / 31
    d = np.maximum(_f16(scale.max(-1) / 127).astype(np.float32), np.float32(2.0**-24))
    sc = np.clip(np.rint(scale / d[:, None]), 1, 127)
    q = np.clip(np.rint(sub / (d[:, None] * sc)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    ql = (q[:, :, 0:64] & 0x0F) | ((q[:, :, 64:128] & 0x0F) << 4)  # [n, 2, 64]
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           _f16(d).view(np.uint8).reshape(-1, 2)], axis=1)


_K_QUANTIZERS = {QT.Q4_K: quantize_q4_k, QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k}


def quantize(w: np.ndarray, qtype: QT) -> np.ndarray:
    """w: float32 [n_out, n_in] -> the array GGUFWriter.add_tensor takes with raw_dtype=qtype."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == QT.F32:
        return w
    if qtype not in _K_QUANTIZERS:
        return gguf.quants.quantize(w, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = _K_QUANTIZERS[qtype](w.reshape(-1, block))
    assert raw.shape[1] == type_size and raw.dtype == np.uint8
    raw = raw.reshape(w.shape[0], -1)
    # The packing must round-trip through gguf's (independent) dequantizer to weights near w.
    back = gguf.quants.dequantize(raw, qtype)
    if not np.all(np.isfinite(back)) or np.abs(back - w).max() > 0.25 * np.abs(w).max():
        raise AssertionError(f"{qtype.name} packing does not round-trip")
    return raw


# ---------------------------------------------------------------------------------------------
# The model

def _weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Float32 weights as [n_out, n_in] (GGUF ne0 = n_in) and 1-D norms/biases."""
    rng = np.random.default_rng(spec.seed)
    d, hd = spec.d_model, spec.head_dim
    n_q, n_kv = spec.n_head * hd, spec.n_kv_head * hd

    def mat(n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
        std = std if std is not None else 1.0 / np.sqrt(n_in)
        return (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)

    def vec(n: int, mean: float, std: float) -> np.ndarray:
        return (mean + rng.standard_normal(n) * std).astype(np.float32)

    # gemma3 scales its embeddings by sqrt(d): 1/sqrt(d) here keeps its logits as spread as the others'
    w = {"token_embd.weight": mat(spec.n_vocab, d, (1.0 if spec.arch == "gemma3" else 3.0) / np.sqrt(d))}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = vec(d, 1.0, 0.1)
        # gemma3: Q and K far from unit RMS (x4), so that QK-norm, which brings them back, matters
        qk_std = (4.0 if spec.arch == "gemma3" else 1.0) / np.sqrt(d)
        w[p + "attn_q.weight"] = mat(n_q, d, qk_std)
        w[p + "attn_k.weight"] = mat(n_kv, d, qk_std)
        w[p + "attn_v.weight"] = mat(n_kv, d)
        if spec.arch == "qwen2":
            w[p + "attn_q.bias"] = vec(n_q, 0.0, 0.2)
            w[p + "attn_k.bias"] = vec(n_kv, 0.0, 0.2)
            w[p + "attn_v.bias"] = vec(n_kv, 0.0, 0.2)
        w[p + "attn_output.weight"] = mat(d, n_q)
        if spec.arch == "gemma3":  # GGUF holds Gemma's 1 + w
            w[p + "attn_q_norm.weight"] = vec(hd, 1.0, 0.1)
            w[p + "attn_k_norm.weight"] = vec(hd, 1.0, 0.1)
            w[p + "post_attention_norm.weight"] = vec(d, 1.0, 0.1)
            w[p + "post_ffw_norm.weight"] = vec(d, 1.0, 0.1)
        w[p + "ffn_norm.weight"] = vec(d, 1.0, 0.1)
        if spec.n_expert:  # [n_expert, n_out, n_in]: GGUF ne = [n_in, n_out, n_expert]
            w[p + "ffn_gate_inp.weight"] = mat(spec.n_expert, d, 2.0 / np.sqrt(d))
            w[p + "ffn_gate_exps.weight"] = np.stack([mat(spec.d_ff, d) for _ in range(spec.n_expert)])
            w[p + "ffn_up_exps.weight"] = np.stack([mat(spec.d_ff, d) for _ in range(spec.n_expert)])
            w[p + "ffn_down_exps.weight"] = np.stack([mat(d, spec.d_ff) for _ in range(spec.n_expert)])
            continue
        w[p + "ffn_gate.weight"] = mat(spec.d_ff, d)
        w[p + "ffn_up.weight"] = mat(spec.d_ff, d)
        w[p + "ffn_down.weight"] = mat(d, spec.d_ff)
    w["output_norm.weight"] = vec(d, 1.0, 0.1)
    if not spec.tied:
        w["output.weight"] = mat(spec.n_vocab, d, 3.0 / np.sqrt(d))
    return w


def write_model(spec: ModelSpec, path: str | Path, name: str | None = None) -> Path:
    """Writes spec as a GGUF file at path; returns the path."""
    spec.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = spec.arch
    tokens, types, merges = byte_vocab()
    n_pad = spec.n_vocab - len(tokens)
    tokens = tokens + [f"[PAD{i}]" for i in range(n_pad)]
    types = types + [int(gguf.TokenType.UNUSED)] * n_pad
    bos, eos = tokens.index("<|bos|>"), tokens.index("<|endoftext|>")

    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(name or f"tiny-{arch}-{spec.qtype}")
    wr.add_file_type(FILE_TYPES[spec.qtype])  # the layers' type, as llama.cpp reports it
    wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    wr.add_context_length(spec.ctx)
    wr.add_embedding_length(spec.d_model)
    wr.add_block_count(spec.n_layer)
    wr.add_feed_forward_length(spec.d_ff)
    wr.add_head_count(spec.n_head)
    wr.add_head_count_kv(spec.n_kv_head)
    if spec.n_expert:
        wr.add_expert_count(spec.n_expert)
        wr.add_expert_used_count(spec.n_expert_used)
    if spec.head_dim * spec.n_head != spec.d_model or arch == "gemma3":
        wr.add_key_length(spec.head_dim)
        wr.add_value_length(spec.head_dim)
    if arch == "gemma3":
        wr.add_sliding_window(spec.sliding_window)
    wr.add_rope_dimension_count(spec.rope_dim if spec.rope_dim is not None else spec.head_dim)
    wr.add_rope_freq_base(GEMMA_ROPE_BASE if arch == "gemma3" else ROPE_BASE)  # gemma3: global layers'
    wr.add_layer_norm_rms_eps(RMS_EPS)
    wr.add_vocab_size(spec.n_vocab)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(bos)
    wr.add_eos_token_id(eos)
    wr.add_add_bos_token(False)
    wr.add_add_space_prefix(False)

    for tname, w in _weights(spec).items():
        if w.ndim == 1:
            wr.add_tensor(tname, w)
        elif tname.endswith("ffn_gate_inp.weight"):  # the router stays F32 (llama.cpp's converters too)
            wr.add_tensor(tname, w)
        else:
            qtype = QTYPES[spec.tensor_qtype(tname)]
            rows = w.reshape(-1, w.shape[-1])  # an expert stack quantizes row by row like a matrix
            data = quantize(rows, qtype)
            data = data.reshape(*w.shape[:-1], data.shape[-1])
            wr.add_tensor(tname, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def write_all(out_dir: str | Path) -> list[Path]:
    """Writes every preset as out_dir/NAME.gguf."""
    return [write_model(spec, Path(out_dir) / f"{name}.gguf", name)
            for name, (spec, _) in {**PRESETS, **GEMMA_PRESETS}.items()]


def _parse_vocab(s: str) -> int | None:
    return None if s == "byte" else int(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="output .gguf (a directory with --preset all, "
                    "default tests/fixtures/generated)")
    ap.add_argument("--preset", help="a preset name, or 'all'")
    ap.add_argument("--list", action="store_true", help="list the presets")
    dflt = ModelSpec()
    ap.add_argument("--arch", choices=["llama", "qwen2"], default=dflt.arch)
    ap.add_argument("--n-layer", type=int, default=dflt.n_layer)
    ap.add_argument("--d-model", type=int, default=dflt.d_model)
    ap.add_argument("--n-head", type=int, default=dflt.n_head)
    ap.add_argument("--n-kv-head", type=int, default=dflt.n_kv_head)
    ap.add_argument("--head-dim", type=int, default=None, help="default d_model / n_head")
    ap.add_argument("--d-ff", type=int, default=dflt.d_ff)
    ap.add_argument("--vocab", type=_parse_vocab, default=None, help="'byte' or a size to pad to")
    ap.add_argument("--ctx", type=int, default=dflt.ctx)
    ap.add_argument("--rope-dim", type=int, default=None, help="rotary dims (default head_dim)")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=True)
    tie.add_argument("--untied", dest="tied", action="store_false")
    ap.add_argument("--qtype", choices=list(QTYPES), default=dflt.qtype)
    ap.add_argument("--embd-qtype", choices=list(QTYPES), default=None,
                    help="type of token_embd/output (default: --qtype)")
    ap.add_argument("--mix", choices=["k_m"], default=None,
                    help="k_m: llama.cpp's K_M mix (q6_k attn_v/ffn_down every other layer, q6_k output)")
    ap.add_argument("--seed", type=int, default=dflt.seed)
    a = ap.parse_args(argv)

    if a.list:
        for name, (spec, ok) in {**PRESETS, **GEMMA_PRESETS}.items():
            print(f"{name:28s} {'' if ok else '(not loadable by llama.cpp) '}{spec}")
        return 0
    if not a.out and a.preset == "all":
        a.out = str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "generated")
    if not a.out:
        ap.error("an output path is required")
    t0 = time.perf_counter()
    try:
        if a.preset == "all":
            paths = write_all(a.out)
        elif a.preset:
            presets = {**PRESETS, **GEMMA_PRESETS}
            if a.preset not in presets:
                ap.error(f"unknown preset {a.preset!r}; --list shows them")
            paths = [write_model(presets[a.preset][0], a.out, a.preset)]
        else:
            spec = ModelSpec(arch=a.arch, n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head,
                             n_kv_head=a.n_kv_head, d_ff=a.d_ff,
                             head_dim=a.head_dim if a.head_dim else a.d_model // a.n_head,
                             vocab=a.vocab, ctx=a.ctx, tied=a.tied, qtype=a.qtype,
                             rope_dim=a.rope_dim, seed=a.seed, embd_qtype=a.embd_qtype, mix=a.mix)
            paths = [write_model(spec, a.out)]
    except ValueError as e:
        print(f"gen_tiny_model: {e}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} model(s), {total / 1e6:.2f} MB, in {time.perf_counter() - t0:.2f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
