#!/usr/bin/env python3
"""Plain-PyTorch reference throughput for the CUDA backend's figures (issue 5), same shapes.

A Llama-3-8B-shaped decoder written in eager PyTorch the way HF transformers' LlamaForCausalLM
computes it (separate q/k/v/o and gate/up/down projections through F.linear, RMSNorm in fp32,
rotate-half RoPE, torch SDPA with enable_gqa, a static KV cache of [batch, n_kv, max_len, hd] per
layer), bf16 random weights generated on the device: nothing is downloaded. Decoding is greedy
with the argmax on the device, so no step waits on the host. Logits are computed for the last
position only, as serving engines do.

Prints one `name value unit` line per figure, named as troupe_gpu_bench names the same figure
(lines starting with '#' are comments):
  decode_b{B}_step             ms per decode step at batch B; the steps end at context --context
  decode_b{B}_tokens_per_s     tokens/s over all B sequences
  prefill_{T}                  ms for one prompt of T tokens
  prefill_{T}_tokens_per_s     its prompt tokens/s

CUDA graphs and torch.compile are off: the issue compares against plain PyTorch. --compile
wraps the forward in torch.compile(dynamic=True) for a second opinion.

  python3 scripts/gpu_torch_ref.py [--arch llama-3-8b] [--batches 1,64] [--context 512]
                                   [--steps 20] [--prefill 2048] [--compile]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

ARCHS = {
    "llama-3-8b": dict(n_layer=32, d=4096, n_head=32, n_kv=8, hd=128, d_ff=14336, vocab=128256,
                       rope_base=500000.0, eps=1e-5),
    "qwen2.5-7b": dict(n_layer=28, d=3584, n_head=28, n_kv=4, hd=128, d_ff=18944, vocab=152064,
                       rope_base=1000000.0, eps=1e-6, qkv_bias=True),
    "smollm2-135m": dict(n_layer=30, d=576, n_head=9, n_kv=3, hd=64, d_ff=1536, vocab=49152,
                         rope_base=100000.0, eps=1e-5, tied=True),
}


class Decoder:
    """Weights and the forward pass; caches are passed in so each batch size owns its own."""

    def __init__(self, arch: str, max_pos: int, dev: torch.device):
        c = self.c = ARCHS[arch]
        bf = torch.bfloat16
        d, hd, nh, nkv, dff = c["d"], c["hd"], c["n_head"], c["n_kv"], c["d_ff"]

        def mat(n_out: int, n_in: int) -> torch.Tensor:  # N(0, 1/n_in): activations stay O(1)
            return torch.empty(n_out, n_in, dtype=bf, device=dev).normal_(0.0, n_in ** -0.5)

        def vec(n: int, std: float) -> torch.Tensor:
            return torch.empty(n, dtype=bf, device=dev).normal_(0.0, std)

        self.embed = mat(c["vocab"], d)
        self.layers = []
        for _ in range(c["n_layer"]):
            L = dict(attn_norm=1 + vec(d, 0.1), ffn_norm=1 + vec(d, 0.1),
                     wq=mat(nh * hd, d), wk=mat(nkv * hd, d), wv=mat(nkv * hd, d), wo=mat(d, nh * hd),
                     w_gate=mat(dff, d), w_up=mat(dff, d), w_down=mat(d, dff))
            if c.get("qkv_bias"):
                L.update(bq=vec(nh * hd, 0.2), bk=vec(nkv * hd, 0.2), bv=vec(nkv * hd, 0.2))
            self.layers.append(L)
        self.out_norm = 1 + vec(d, 0.1)
        self.lm_head = self.embed if c.get("tied") else mat(c["vocab"], d)
        self.weight_bytes = sum(t.numel() * t.element_size() for L in self.layers for t in L.values())
        self.weight_bytes += (self.out_norm.numel() + self.lm_head.numel()) * 2

        inv = 1.0 / (c["rope_base"] ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(max_pos, device=dev, dtype=torch.float32), inv)
        emb = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = emb.cos().to(bf), emb.sin().to(bf)

    def new_cache(self, batch: int, max_len: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A static cache, filled with random values so attention over it reads real numbers."""
        c = self.c
        shape = (batch, c["n_kv"], max_len, c["hd"])
        return [(torch.randn(shape, dtype=torch.bfloat16, device=dev),
                 torch.randn(shape, dtype=torch.bfloat16, device=dev)) for _ in range(c["n_layer"])]

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c["eps"])
        return w * x32.to(x.dtype)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def forward(self, tokens: torch.Tensor, pos0: int, cache) -> torch.Tensor:
        """tokens [B, T] at positions [pos0, pos0 + T) of every sequence; returns the next token
        of each sequence (greedy) [B]. A prefill (T > 1) must start at position 0."""
        c = self.c
        B, T = tokens.shape
        nh, nkv, hd = c["n_head"], c["n_kv"], c["hd"]
        cos = self.cos[pos0:pos0 + T][None, None]
        sin = self.sin[pos0:pos0 + T][None, None]
        x = F.embedding(tokens, self.embed)
        for L, (ck, cv) in zip(self.layers, cache):
            h = self.rmsnorm(x, L["attn_norm"])
            q = F.linear(h, L["wq"], L.get("bq")).view(B, T, nh, hd).transpose(1, 2)
            k = F.linear(h, L["wk"], L.get("bk")).view(B, T, nkv, hd).transpose(1, 2)
            v = F.linear(h, L["wv"], L.get("bv")).view(B, T, nkv, hd).transpose(1, 2)
            q = q * cos + self.rotate_half(q) * sin
            k = k * cos + self.rotate_half(k) * sin
            ck[:, :, pos0:pos0 + T] = k
            cv[:, :, pos0:pos0 + T] = v
            a = F.scaled_dot_product_attention(q, ck[:, :, :pos0 + T], cv[:, :, :pos0 + T],
                                               is_causal=T > 1, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, nh * hd), L["wo"])
            h = self.rmsnorm(x, L["ffn_norm"])
            x = x + F.linear(F.silu(F.linear(h, L["w_gate"])) * F.linear(h, L["w_up"]), L["w_down"])
        logits = F.linear(self.rmsnorm(x[:, -1], self.out_norm), self.lm_head).float()
        return logits.argmax(-1)


def time_ms(fn, warmup: int, reps: int, cuda: bool = True) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events after warmup calls (on the
    CPU, a dry run of this script: wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama-3-8b", choices=sorted(ARCHS))
    ap.add_argument("--batches", default="1,64", help="decode batch sizes, comma separated")
    ap.add_argument("--context", type=int, default=512, help="KV positions attended by the last timed decode step")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt length of the prefill figure (0: skip)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward (off: plain eager)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script (small --arch)")
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",") if b]
    if not 0 < args.steps < args.context:
        raise SystemExit("need 0 < --steps < --context")
    model = Decoder(args.arch, max(args.context, args.prefill), dev)
    fwd = torch.compile(model.forward, dynamic=True) if args.compile else model.forward
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name() if on_cuda else 'cpu'}; arch {args.arch}; "
          f"weights {model.weight_bytes / 1e9:.2f} GB bf16; compile {'on' if args.compile else 'off'}")
    vocab = model.c["vocab"]

    with torch.inference_mode():
        for B in batches:
            cache = model.new_cache(B, args.context, dev)
            tok = torch.randint(0, vocab, (B, 1), device=dev)

            def run_steps() -> None:
                # Steps at positions [context - steps, context), as troupe_gpu_bench times them;
                # every run restarts there, so every run reads the same KV lengths.
                t = tok
                for i in range(args.steps):
                    t = fwd(t, args.context - args.steps + i, cache).view(B, 1)

            ms = time_ms(run_steps, warmup=2, reps=5, cuda=on_cuda) / args.steps
            print(f"decode_b{B}_step {ms:.4g} ms")
            print(f"decode_b{B}_tokens_per_s {B * 1000.0 / ms:.4g} tok/s", flush=True)
            del cache
            if on_cuda:
                torch.cuda.empty_cache()

        if args.prefill > 0:
            T = args.prefill
            cache = model.new_cache(1, T, dev)
            prompt = torch.randint(0, vocab, (1, T), device=dev)
            ms = time_ms(lambda: fwd(prompt, 0, cache), warmup=2, reps=5, cuda=on_cuda)
            print(f"prefill_{T} {ms:.4g} ms")
            print(f"prefill_{T}_tokens_per_s {T * 1000.0 / ms:.4g} tok/s", flush=True)


if __name__ == "__main__":
    main()
