"""An independent numpy forward pass of Llama-family GGUF models, the reference troupe is checked
against.

Everything comes from the file: hyperparameters from the GGUF metadata, weights dequantized by
the gguf package (gguf.quants.dequantize, not troupe code). Supported architectures:

  llama  RoPE "normal" (GGUF / llama.cpp convention): rotates the pairs (2i, 2i+1). The HF->GGUF
         converter permutes the Q/K rows of Llama checkpoints so that this is the right pairing.
  qwen2  RoPE NeoX: rotates the pairs (i, i + n_rot/2); q/k/v projections carry biases.

Both: RMSNorm, rope.dimension_count <= head_dim (dims past n_rot pass through unrotated),
grouped-query attention (q head h reads kv head h // (n_head / n_kv_head)), causal softmax with
scale 1/sqrt(head_dim), SwiGLU FFN, tied (output = token_embd) or separate output matrix.

Precision: weights are dequantized exactly (to float32, then held in the compute dtype); all
activations are computed in `dtype`: float64 by default, which makes the reference the model's
exact function of its stored weights to ~1e-15; float32 (used for the 135M default model, twice
as fast) stays within ~2e-6 of it.

llama.cpp (and troupe) do not compute that function exactly: they round the activations that
enter each matrix product to the format the weight type's dot product pairs with (8-bit blocks
q8_0 / q8_1 / q8_K for quantized weights, fp16 / bf16 for fp16 / bf16 weights) and keep the KV
cache in fp16. `RefModel(path, emulate_llamacpp=True)` applies those same roundings (including
the fp16 block sum of q8_1 that q4_1 dots use). It reproduces llama.cpp to ~1e-7 on single
tokens of every tiny preset, which pins down the dequantizers and the layer arithmetic, and
separates "activation rounding" (explained, expected) from anything else. Over longer sequences
the two drift apart again: once float summation order flips a single rounding decision, every
later rounding decorrelates and the gap returns to the full rounding-noise level. The figures
are in test_reference_vs_llamacpp.py and the policy section at the end of this file.

API:
  model = RefModel(path)
  model.logits(tokens)            -> np.ndarray [n_tokens, n_vocab], logits at every position
  model.greedy(tokens, n)         -> list of n greedy token ids (incremental KV cache)
  model.greedy(tokens, n, return_margins=True) -> (ids, top-1 minus top-2 logit at each step)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

ROPE_STYLE = {"llama": "norm", "qwen2": "neox"}


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim_k: int
    head_dim_v: int
    d_ff: int
    n_rot: int
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    n_vocab: int
    rope_style: str
    n_expert: int = 0        # Mixtral-style mixture of experts (llama.cpp's build_moe_ffn: softmax
    n_expert_used: int = 0   # router, top-k, weights renormalized to sum 1)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    v = f.contents()
    if isinstance(v, list):  # per-layer arrays: all layers must agree for this reference
        if len(set(v)) != 1:
            raise NotImplementedError(f"{key} varies per layer: {v}")
        v = v[0]
    return v


# ---- llama.cpp activation rounding (used only with emulate_llamacpp=True) --------------------

def _round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(x.dtype)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16  # round to nearest even, as ggml does
    return b.astype(np.uint32).view(np.float32).astype(x.dtype)


def _quant_q8_0(x: np.ndarray):
    """ggml quantize_row_q8_0 / q8_1: blocks of 32, q = round(x * 127/amax), d = amax/127.
    Returns (q, d) with shapes [..., n_blocks, 32] and [..., n_blocks, 1], float32."""
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    iscale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(xb * iscale), d


def _round_q8_0(x: np.ndarray) -> np.ndarray:
    """The values a q8_0 / q8_1 block holds: q * fp16(d)."""
    q, d = _quant_q8_0(x)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(x.dtype)


def _round_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml quantize_row_q8_K: blocks of 256, iscale = -127/max (signed max), float32 d."""
    xb = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
    idx = np.abs(xb).argmax(-1)[..., None]
    mx = np.take_along_axis(xb, idx, -1)
    iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale), 127)
    d = np.where(iscale != 0, 1 / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return (q * d).reshape(x.shape).astype(x.dtype)


# ggml's vec_dot_type: the format a weight type's dot product wants its activations in.
_ACT_ROUNDING = {
    QT.F32: None, QT.F16: _round_f16, QT.BF16: _round_bf16,
    QT.Q8_0: _round_q8_0, QT.Q4_0: _round_q8_0, QT.Q5_0: _round_q8_0,
    QT.Q4_1: _round_q8_0, QT.Q5_1: _round_q8_0,  # q8_1: same values, plus a block sum
    QT.Q2_K: _round_q8_k, QT.Q3_K: _round_q8_k, QT.Q4_K: _round_q8_k, QT.Q5_K: _round_q8_k,
    QT.Q6_K: _round_q8_k,
}


class _Linear:
    """y = x @ W^T (+ b), W dequantized to [n_out, n_in]."""

    def __init__(self, w: np.ndarray, qtype: QT, dtype, emulate: bool, bias: np.ndarray | None,
                 raw: np.ndarray | None = None):
        self.w = np.ascontiguousarray(w, dtype=dtype)  # [n_out, n_in]
        self.bias = None if bias is None else bias.astype(dtype)
        self.round = _ACT_ROUNDING.get(qtype) if emulate else None
        self.q41_mins = None
        if emulate and qtype in (QT.Q4_1, QT.Q5_1):
            # q4_1 x q8_1 dot: sum_b d_w d_x <q_w, q_x> + m_b * s_b with s_b = fp16(d_x * sum q_x)
            # (d_x in fp32), not m_b * fp16(d_x) * sum q_x: keep the block mins to add the gap.
            type_size = gguf.GGML_QUANT_SIZES[qtype][1]
            blocks = raw.reshape(w.shape[0], -1, type_size)
            self.q41_mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(dtype)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.q41_mins is not None:
            q, d = _quant_q8_0(x)
            sum_q = q.sum(-1)
            s_gap = ((d[..., 0] * sum_q).astype(np.float16).astype(np.float64)
                     - d[..., 0].astype(np.float16).astype(np.float64) * sum_q)
            x = (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(x.dtype)
            y = x @ self.w.T + s_gap.astype(x.dtype) @ self.q41_mins.T
        else:
            if self.round is not None:
                x = self.round(x)
            y = x @ self.w.T
        return y if self.bias is None else y + self.bias


class RefModel:
    """Float64 (or `dtype`) reference forward pass of a llama / qwen2 GGUF model."""

    def __init__(self, path: str | Path, dtype=np.float64, emulate_llamacpp: bool = False):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.emulate = emulate_llamacpp
        reader = gguf.GGUFReader(str(self.path))
        arch = _field(reader, "general.architecture")
        if arch not in ROPE_STYLE:
            raise NotImplementedError(f"architecture {arch!r} (supported: {', '.join(ROPE_STYLE)})")
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ValueError("token_embd.weight is missing")
        d_model = int(_field(reader, f"{arch}.embedding_length"))
        n_head = int(_field(reader, f"{arch}.attention.head_count"))
        head_dim_k = int(_field(reader, f"{arch}.attention.key_length", d_model // n_head))
        self.hp = HParams(
            arch=arch,
            n_layer=int(_field(reader, f"{arch}.block_count")),
            d_model=d_model,
            n_head=n_head,
            n_kv_head=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
            head_dim_k=head_dim_k,
            head_dim_v=int(_field(reader, f"{arch}.attention.value_length", head_dim_k)),
            d_ff=int(_field(reader, f"{arch}.feed_forward_length")),
            n_rot=int(_field(reader, f"{arch}.rope.dimension_count", head_dim_k)),
            rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            n_ctx_train=int(_field(reader, f"{arch}.context_length")),
            n_vocab=int(tensors["token_embd.weight"].shape[1]),
            rope_style=ROPE_STYLE[arch],
            n_expert=int(_field(reader, f"{arch}.expert_count", 0)),
            n_expert_used=int(_field(reader, f"{arch}.expert_used_count", 0)),
        )
        hp = self.hp
        if hp.n_head % hp.n_kv_head:
            raise ValueError(f"head_count {hp.n_head} is not a multiple of head_count_kv {hp.n_kv_head}")
        if hp.n_rot > hp.head_dim_k or hp.n_rot % 2:
            raise ValueError(f"rope.dimension_count {hp.n_rot} must be even and <= {hp.head_dim_k}")

        used: set[str] = set()

        def raw(name: str, shape: tuple[int, ...] | None = None, required: bool = True):
            t = tensors.get(name)
            used.add(name)
            if t is None:
                if required:
                    raise ValueError(f"tensor {name} is missing")
                return None, None, None
            # GGUF shapes are [ne0, ne1]; numpy arrays here are [ne1, ne0].
            np_shape = tuple(int(n) for n in reversed(t.shape))
            if shape is not None and np_shape != shape:
                raise ValueError(f"tensor {name} has shape {np_shape}, expected {shape}")
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.asarray(a, dtype=np.float32).reshape(np_shape), t.tensor_type, t.data

        def linear(name: str, n_out: int, n_in: int) -> _Linear:
            w, qt, data = raw(f"{name}.weight", (n_out, n_in))
            b = raw(f"{name}.bias", (n_out,), required=False)[0]  # optional in llama.cpp too
            return _Linear(w, qt, self.dtype, self.emulate, b, data)

        d, n_q = hp.d_model, hp.n_head * hp.head_dim_k
        n_k, n_v = hp.n_kv_head * hp.head_dim_k, hp.n_kv_head * hp.head_dim_v
        embd = raw("token_embd.weight", (hp.n_vocab, d))
        self.token_embd = embd[0].astype(self.dtype)  # get_rows dequantizes exactly: no rounding
        self.layers = []
        def experts(name: str, n_out: int, n_in: int) -> list[_Linear]:
            w, qt, data = raw(name, (hp.n_expert, n_out, n_in))
            return [_Linear(w[e], qt, self.dtype, self.emulate, None, data[e]) for e in range(hp.n_expert)]

        for i in range(hp.n_layer):
            p = f"blk.{i}."
            L = dict(
                attn_norm=raw(p + "attn_norm.weight", (d,))[0].astype(self.dtype),
                q=linear(p + "attn_q", n_q, d), k=linear(p + "attn_k", n_k, d),
                v=linear(p + "attn_v", n_v, d),
                o=linear(p + "attn_output", d, hp.n_head * hp.head_dim_v),
                ffn_norm=raw(p + "ffn_norm.weight", (d,))[0].astype(self.dtype),
            )
            if hp.n_expert:
                L.update(router=linear(p + "ffn_gate_inp", hp.n_expert, d),
                         gates=experts(p + "ffn_gate_exps.weight", hp.d_ff, d),
                         ups=experts(p + "ffn_up_exps.weight", hp.d_ff, d),
                         downs=experts(p + "ffn_down_exps.weight", d, hp.d_ff))
            else:
                L.update(gate=linear(p + "ffn_gate", hp.d_ff, d), up=linear(p + "ffn_up", hp.d_ff, d),
                         down=linear(p + "ffn_down", d, hp.d_ff))
            self.layers.append(L)
        self.output_norm = raw("output_norm.weight", (d,))[0].astype(self.dtype)
        self.tied = "output.weight" not in tensors
        self.output = linear("token_embd" if self.tied else "output", hp.n_vocab, d)
        unused = sorted(set(tensors) - used)
        if unused:  # e.g. rope_freqs (Llama 3 scaling), fused qkv: not modelled here
            raise NotImplementedError(f"tensors this reference does not model: {unused[:5]}")
        scaling = reader.fields.get(f"{arch}.rope.scaling.type")
        if scaling is not None and scaling.contents() not in ("none", ""):
            raise NotImplementedError(f"RoPE scaling {scaling.contents()!r}")
        half = hp.n_rot // 2
        self._inv_freq = hp.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / hp.n_rot)

    # ---- building blocks ---------------------------------------------------------------------

    def _rms_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.hp.rms_eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [T, n_heads, head_dim]; rotates the first n_rot dims of each head."""
        n_rot = self.hp.n_rot
        ang = pos[:, None].astype(np.float64) * self._inv_freq[None, :]  # [T, n_rot/2]
        cos = np.cos(ang)[:, None, :].astype(self.dtype)
        sin = np.sin(ang)[:, None, :].astype(self.dtype)
        out = x.copy()
        if self.hp.rope_style == "norm":
            x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = x0 * cos - x1 * sin
            out[..., 1:n_rot:2] = x0 * sin + x1 * cos
        else:
            half = n_rot // 2
            x0, x1 = x[..., :half], x[..., half:n_rot]
            out[..., :half] = x0 * cos - x1 * sin
            out[..., half:n_rot] = x0 * sin + x1 * cos
        return out

    def _new_cache(self, n_positions: int) -> dict:
        hp = self.hp
        cap = max(16, n_positions)
        return dict(
            n=0,
            k=[np.empty((cap, hp.n_kv_head, hp.head_dim_k), self.dtype) for _ in range(hp.n_layer)],
            v=[np.empty((cap, hp.n_kv_head, hp.head_dim_v), self.dtype) for _ in range(hp.n_layer)],
        )

    def _forward(self, tokens: np.ndarray, cache: dict) -> np.ndarray:
        """Appends tokens to the cached sequence; returns their logits [T, n_vocab]."""
        hp = self.hp
        n_past, T = cache["n"], len(tokens)
        if n_past + T > cache["k"][0].shape[0]:  # grow the cache (doubling)
            cap = max(2 * cache["k"][0].shape[0], n_past + T)
            for name in ("k", "v"):
                cache[name] = [np.concatenate([a[:n_past], np.empty((cap - n_past, *a.shape[1:]), a.dtype)])
                               for a in cache[name]]
        pos = np.arange(n_past, n_past + T)
        n_all = n_past + T
        group = hp.n_head // hp.n_kv_head
        scale = float(1.0 / np.sqrt(hp.head_dim_k))  # a Python float keeps float32 float32
        # causal mask: query t (absolute position n_past + t) sees keys s <= n_past + t
        mask = np.arange(n_all)[None, :] > pos[:, None]  # [T, n_all]

        x = self.token_embd[tokens]
        for il, L in enumerate(self.layers):
            h = self._rms_norm(x, L["attn_norm"])
            q = self._rope(L["q"](h).reshape(T, hp.n_head, hp.head_dim_k), pos)
            k = self._rope(L["k"](h).reshape(T, hp.n_kv_head, hp.head_dim_k), pos)
            v = L["v"](h).reshape(T, hp.n_kv_head, hp.head_dim_v)
            if self.emulate:  # fp16 KV cache; the K·Q product takes Q in fp16 too
                k, v, q = _round_f16(k), _round_f16(v), _round_f16(q)
            cache["k"][il][n_past:n_all] = k
            cache["v"][il][n_past:n_all] = v
            K, V = cache["k"][il][:n_all], cache["v"][il][:n_all]
            qg = q.reshape(T, hp.n_kv_head, group, hp.head_dim_k)
            scores = np.einsum("tkgd,skd->kgts", qg, K) * scale  # [n_kv, group, T, n_all]
            scores = np.where(mask, -np.inf, scores)
            scores -= scores.max(-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(-1, keepdims=True)
            if self.emulate:  # the probabilities meet the fp16 V cache in an fp16 dot product
                p = _round_f16(p)
            att = np.einsum("kgts,skd->tkgd", p, V).reshape(T, hp.n_head * hp.head_dim_v)
            assert att.dtype == self.dtype, att.dtype  # a float64 slip would copy every weight
            x = x + L["o"](att)
            h = self._rms_norm(x, L["ffn_norm"])
            if "router" in L:
                x = x + self._moe(L, h)
            else:
                g = L["gate"](h)
                x = x + L["down"](g / (1.0 + np.exp(-g)) * L["up"](h))
        cache["n"] = n_all
        return self.output(self._rms_norm(x, self.output_norm))

    def _moe(self, L: dict, h: np.ndarray) -> np.ndarray:
        """Mixtral's mixture of experts: softmax over the router's logits, the top n_expert_used
        (ties: the lower index), their probabilities renormalized, each expert a SwiGLU."""
        k = self.hp.n_expert_used
        logits = L["router"](h)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, top, 1)
        w /= w.sum(1, keepdims=True)
        out = np.zeros_like(h)
        for e in range(self.hp.n_expert):
            sel = top == e
            rows = sel.any(1)
            if not rows.any():
                continue
            he = h[rows]
            g = L["gates"][e](he)
            y = L["downs"][e](g / (1.0 + np.exp(-g)) * L["ups"][e](he))
            out[rows] += (w * sel).sum(1)[rows][:, None].astype(self.dtype) * y
        return out

    def _check_tokens(self, tokens) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if t.size == 0:
            raise ValueError("no tokens")
        if t.min() < 0 or t.max() >= self.hp.n_vocab:
            raise ValueError(f"token id out of range [0, {self.hp.n_vocab})")
        return t

    # ---- API -----------------------------------------------------------------------------------

    def logits(self, tokens) -> np.ndarray:
        """Logits [n_tokens, n_vocab] at every position of one causal pass over tokens."""
        t = self._check_tokens(tokens)
        return self._forward(t, self._new_cache(len(t)))

    def greedy(self, tokens, n: int, return_margins: bool = False):
        """n greedy (argmax, first on ties) continuation ids after prefilling tokens; with
        return_margins also the top-1 minus top-2 logit gap at each of the n steps."""
        t = self._check_tokens(tokens)
        cache = self._new_cache(len(t) + n)
        out, margins = [], []
        last = self._forward(t, cache)[-1]
        for step in range(n):
            nxt = int(np.argmax(last))
            top2 = np.partition(last, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            out.append(nxt)
            if step + 1 < n:
                last = self._forward(np.array([nxt]), cache)[-1]
        return (out, margins) if return_margins else out


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """||a - ref|| / ||ref|| (Frobenius)."""
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64) - ref) / np.linalg.norm(ref))


# ---- Comparison policy, shared by test_forward.py and test_reference_vs_llamacpp.py ----------
#
# Errors are measured on centered logits (each row minus its mean): a constant shift of a row
# changes neither softmax nor argmax, and the default model's rows carry means up to ~20 against
# a spread of ~3, which would otherwise hide the part of the error that matters.
#
# Where the error comes from. An implementation that rounds the activations entering each matrix
# product to 8 bits (block of 32 or 256, scale = amax/127) adds per element a uniform error of
# rms amax/127/sqrt(12) ~ 0.6% of the activations' rms (amax ~ 2.5 rms in a block of 32), so
# each product carries ~0.6% relative noise; summed over the layers and amplified by the
# network this gives the logit error measured for llama.cpp below. Two such implementations do
# not share their noise: a change of one rounding decision (float summation order is enough)
# decorrelates every later rounding, so the gap settles at the full noise level - the numpy
# reference run with llama.cpp's roundings in float32 and in float64 differs from itself by
# 0.6-4% on the default model. fp16 weights (fp16 activations in llama.cpp) and the fp16 KV
# cache contribute ~2^-11 relative per element, ~5e-4 on the logits.
#
# Measured llama.cpp (llama-cpp-python 0.3.36) vs this reference, centered relative error over
# a prompt (the tiny presets, 37 random tokens; see test_reference_vs_llamacpp.py):
#   f32 weights 3-6e-4 (fp16 KV cache) | f16 7-9e-4 | bf16 5e-3 | q8_0, q4_0, q4_1 1.5-2e-2 |
#   q4_k, q5_k, q6_k 2.5-3e-2.
# The tolerances are about 3x those figures: an implementation with llama.cpp's precision
# passes with room (llama.cpp itself is held to them in test_reference_vs_llamacpp.py), while
# structural bugs (RoPE pairing, GQA head mapping, a missing bias, a misread block) give errors
# of order 1.
REL_TOL = {
    "F32": 2e-3, "F16": 3e-3, "BF16": 1.5e-2,
    "Q8_0": 5e-2, "Q4_0": 5e-2, "Q4_1": 5e-2, "Q5_0": 5e-2, "Q5_1": 5e-2,
    "Q4_K": 8e-2, "Q5_K": 8e-2, "Q6_K": 8e-2,
}
# The default model (SmolLM2-135M Q4_1, Q8_0 embeddings, 30 layers) amplifies the rounding noise
# more. llama.cpp measured on 11 prompts, each with its 32-token greedy continuation: centered
# relative error 0.031-0.050 over a sequence, 0.138 at the worst single position; top-1
# disagreements only where the reference's top-2 margin was <= 0.26 (the bound below gives ~0.6).
# Tolerances: 2x those figures.
DEFAULT_MODEL_REL_TOL = 0.10
DEFAULT_MODEL_POS_REL_TOL = 0.25


def centered(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.mean(axis=-1, keepdims=True)


def logits_rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """||c(a) - c(ref)|| / ||c(ref)|| over all positions, c = centering of each row."""
    ca, cr = centered(a), centered(ref)
    return float(np.linalg.norm(ca - cr) / np.linalg.norm(cr))


def position_rel_err(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The centered relative error of each position (row)."""
    ca, cr = centered(a), centered(ref)
    return np.linalg.norm(ca - cr, axis=-1) / np.linalg.norm(cr, axis=-1)


def weight_types(path: str | Path) -> set[str]:
    """Names of the types of the file's matrices (2-D tensors)."""
    return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) >= 2}


def rel_tolerance(path: str | Path) -> float:
    """The tolerance of the least precise weight type in the file."""
    return max(REL_TOL[t] for t in weight_types(path))


def margin_bound(row: np.ndarray, tol: float) -> float:
    """How far apart two logits of a row must be for an implementation within relative error
    tol to be sure to order them like the reference: 2 * tol * std(row). An error of relative
    size tol puts rms tol*std(row) on each logit; the expected (llama.cpp-like) error is ~tol/3,
    so a gap above the bound is > 4 standard deviations of the error on a difference."""
    return 2.0 * tol * float(np.std(row))


def greedy_deficits(ref_rows: np.ndarray, generated) -> np.ndarray:
    """For continuation ids `generated` and the reference's logits rows that predict them
    (row i scored the context that preceded generated[i]): how far each pick's logit is below
    that row's maximum (0 where the pick is the reference's argmax)."""
    rows = np.asarray(ref_rows, dtype=np.float64)
    g = np.asarray(generated, dtype=np.int64)
    return rows.max(axis=1) - rows[np.arange(len(g)), g]


def check_greedy(ref_rows: np.ndarray, generated, tol: float) -> list[str]:
    """The greedy rule: every generated token must be the reference's argmax in the context the
    implementation itself produced, except where the reference's top two are within
    margin_bound (a near-tie that any implementation within tol may order either way); there the
    pick must still be within the bound of the maximum. Returns the violations (empty: passed).
    Because each step is scored in the implementation's own context, a legitimate near-tie flip
    does not end the comparison: the steps after it are checked the same way."""
    problems = []
    deficits = greedy_deficits(ref_rows, generated)
    for i, (row, d) in enumerate(zip(ref_rows, deficits)):
        bound = margin_bound(row, tol)
        if d > bound:
            problems.append(f"step {i}: picked {generated[i]} whose logit is {d:.4f} below the "
                            f"reference's best {int(np.argmax(row))} (near-tie bound {bound:.4f})")
    return problems


# Default-model prompts, token ids from llama.cpp's tokenizer of the default model (llama-cpp-
# python 0.3.36, add_bos=False, special=True; test_reference_vs_llamacpp.py checks them).
# LOGITS: natural text, chat template, code. GREEDY: prompts whose 32-token greedy continuation
# has top-2 margins >= 2 logits at every step in both llama.cpp and the reference, so that any
# implementation within tolerance must reproduce it token for token.
DEFAULT_LOGITS_PROMPTS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n":
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    "def fibonacci(n):\n    ": [1604, 3987, 46477, 24, 94, 727, 2367],
    "Once upon a time, in a small village,": [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
}
DEFAULT_GREEDY_PROMPTS = {
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,":
        [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216, 38, 28, 216, 39, 28,
         216, 40, 28, 216, 41, 28, 216, 33, 32, 28],
    "<|im_start|>user\nCount from 1 to 30, separated by commas.<|im_end|>\n"
    "<|im_start|>assistant\n1, 2, 3,":
        [1, 4093, 198, 9825, 429, 216, 33, 288, 216, 35, 32, 28, 9075, 411, 45910, 30, 2, 198, 1,
         520, 9531, 198, 33, 28, 216, 34, 28, 216, 35, 28],
    "2, 4, 6, 8, 10,": [34, 28, 216, 36, 28, 216, 38, 28, 216, 40, 28, 216, 33, 32, 28],
    "Count: 1, 2, 3,": [9825, 42, 216, 33, 28, 216, 34, 28, 216, 35, 28],
}
N_GREEDY_DEFAULT = 32


def tiny_prompts() -> dict[int, list[int]]:
    """The tiny presets' prompts, by length: byte tokens (ids 0-255 are the bytes), merged
    tokens and the control tokens <|bos|> = 296, <|im_start|> = 298 of gen_tiny_model's vocab."""
    rng = np.random.default_rng(1234)
    return {
        1: [84],  # "T"
        5: [296, 72, 101, 266, 111],  # <|bos|> "H" "e" "re"(merge) "o"
        37: [298] + rng.integers(0, 300, 36).tolist(),
    }
