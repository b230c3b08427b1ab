#!/usr/bin/env python3
"""The table scripts/gpu-check prints last: each figure of troupe_gpu_bench (bench.log), the same
figure of scripts/gpu_torch_ref.py (torch_ref.log) where it has one, their ratio and the issue's
target, then the batch-1 launch-option variants side by side.

  python3 scripts/gpu_check_table.py BENCH_LOG TORCH_REF_LOG

Both logs hold `name value unit` lines (the two programs name the same figure alike); other lines
are skipped, as is a log that is missing. tests/python/test_gpu_bench_emu.py checks that every
figure of ours named in ROWS is one the benchmark prints.
"""
from __future__ import annotations

import sys

# figure, our name, reference name (None: ours alone), how ours compares, target (op, bound)
# "speed": ratio = ours / reference (both rates); "time": ratio = reference / ours (both times).
ROWS = [
    ("D2D copy GB/s", "d2d_copy_bandwidth", None, None, None),
    ("HBM read-only GB/s", "hbm_read_bandwidth", None, None, None),
    ("HBM read / copy rate", "hbm_read_over_copy", None, None, None),
    ("GEMM bf16 8192^3 TFLOP/s", "gemm_bf16_8192", None, None, None),
    ("decode b1 step/roofline", "decode_b1_time_over_roofline", None, None, ("<=", 1.15)),
    ("b1 default, best of 3/roofl.", "decode_b1_default_time_over_roofline", None, None, None),
    ("b1 sleeping wait/roofline", "decode_b1_sleep_wait_time_over_roofline", None, None, None),
    ("b1 best options/roofline", "decode_b1_best_time_over_roofline", None, None, ("<=", 1.15)),
    ("decode b1 step ms", "decode_b1_step", None, None, None),
    ("decode b1 device ms", "decode_b1_device_step", None, None, None),
    ("decode b1 GEMM share", "decode_b1_gemm_share", None, None, None),
    ("b1 cuBLASLt/roofline", "decode_b1_cublas_time_over_roofline", None, None, None),
    ("b1 cuBLASLt no PDL/roofl.", "decode_b1_cublas_nopdl_time_over_roofline", None, None, None),
    ("b1 GEMV no PDL/roofline", "decode_b1_gemv_nopdl_time_over_roofline", None, None, None),
    ("b1 GEMV qkv,o only/roofl.", "decode_b1_split_time_over_roofline", None, None, None),
    ("b1 streamed GEMV/roofline", "decode_b1_streamed_time_over_roofline", None, None, None),
    ("b1 streamed qkv,o/roofline", "decode_b1_streamed_split_time_over_roofline", None, None, None),
    ("b1 streamed GEMVs best/roofl", "decode_b1_gemv_streamed_best_gemm_only_over_roofline", None, None, None),
    ("decode b2 streamed tok/s", "decode_b2_streamed_tokens_per_s", None, None, None),
    ("b1 fused/roofline", "decode_b1_fused_time_over_roofline", None, None, None),
    ("b1 merge only/roofline", "decode_b1_merge_only_time_over_roofline", None, None, None),
    ("b1 RoPE GEMV only/roofline", "decode_b1_rope_only_time_over_roofline", None, None, None),
    ("b1 streamed fused/roofl.", "decode_b1_streamed_fused_time_over_roofline", None, None, None),
    ("b1 prefetch 1k/roofline", "decode_b1_prefetch_1k_time_over_roofline", None, None, None),
    ("b1 prefetch 2k/roofline", "decode_b1_prefetch_2k_time_over_roofline", None, None, None),
    ("b1 prefetch 4k/roofline", "decode_b1_prefetch_4k_time_over_roofline", None, None, None),
    ("b1 prefetch 8k/roofline", "decode_b1_prefetch_8k_time_over_roofline", None, None, None),
    ("b1 fused+pref 2k/roofline", "decode_b1_fused_prefetch_2k_time_over_roofline", None, None, None),
    ("b1 fused+pref 4k/roofline", "decode_b1_fused_prefetch_4k_time_over_roofline", None, None, None),
    ("decode b64 fused tok/s", "decode_b64_fused_tokens_per_s", None, None, None),
    ("b1 fold applies (1=yes)", "decode_b1_fold_applies", None, None, None),
    ("b1 fold/roofline", "decode_b1_fold_time_over_roofline", None, None, None),
    ("b1 fold+fused/roofline", "decode_b1_fold_fused_time_over_roofline", None, None, None),
    ("b1 fold+fused+pref 2k/roofl.", "decode_b1_fold_fused_prefetch_2k_time_over_roofline", None, None, None),
    ("b1 fold+fused+pref 4k/roofl.", "decode_b1_fold_fused_prefetch_4k_time_over_roofline", None, None, None),
    ("decode b2 fold+fused tok/s", "decode_b2_fold_fused_tokens_per_s", None, None, None),
    ("b1 attn split 32/roofline", "decode_b1_attn_kv32_time_over_roofline", None, None, None),
    ("b1 attn split 128/roofline", "decode_b1_attn_kv128_time_over_roofline", None, None, None),
    ("b1 all, attn split 32/roofl.", "decode_b1_fold_fused_attn_kv32_time_over_roofline", None, None, None),
    ("b1 GEMVs alone/roofline", "decode_b1_gemv_gemm_only_over_roofline", None, None, None),
    ("b1 GEMVs PDL/roofline", "decode_b1_gemv_pdl_gemm_only_over_roofline", None, None, None),
    ("decode b2 tok/s", "decode_b2_tokens_per_s", None, None, None),
    ("decode b2 GEMV tok/s", "decode_b2_gemv_tokens_per_s", None, None, None),
    ("decode b4 tok/s", "decode_b4_tokens_per_s", None, None, None),
    ("decode b4 GEMV tok/s", "decode_b4_gemv_tokens_per_s", None, None, None),
    ("decode b8 tok/s", "decode_b8_tokens_per_s", None, None, None),
    ("decode b8 GEMV tok/s", "decode_b8_gemv_tokens_per_s", None, None, None),
    ("decode b8 no PDL tok/s", "decode_b8_nopdl_tokens_per_s", None, None, None),
    ("decode b1 tok/s", "decode_b1_tokens_per_s", "decode_b1_tokens_per_s", "speed", (">=", 2.0)),
    ("decode b64 tok/s", "decode_b64_tokens_per_s", "decode_b64_tokens_per_s", "speed", (">=", 1.2)),
    ("decode b64 step/roofline", "decode_b64_time_over_roofline", None, None, None),
    ("b64 without PDL/roofline", "decode_b64_nopdl_time_over_roofline", None, None, None),
    ("decode b64 GEMM share", "decode_b64_gemm_share", None, None, None),
    ("decode b256 tok/s", "decode_b256_tokens_per_s", "decode_b256_tokens_per_s", "speed", None),
    ("decode b256 step/roofline", "decode_b256_time_over_roofline", None, None, None),
    ("Q4_K_M b1 step ms", "decode_q4_k_m_b1_step", None, None, None),
    ("Q4_K_M b1 step/roofline", "decode_q4_k_m_b1_time_over_roofline", None, None, None),
    ("Q4_K_M b1 unroll 4/roofline", "decode_q4_k_m_b1_unroll4_time_over_roofline", None, None, None),
    ("Q4_K_M b1 unroll 8/roofline", "decode_q4_k_m_b1_unroll8_time_over_roofline", None, None, None),
    ("Q4_K_M b8 tok/s", "decode_q4_k_m_b8_tokens_per_s", None, None, None),
    ("Q4_K_M b8 unroll 4 tok/s", "decode_q4_k_m_b8_unroll4_tokens_per_s", None, None, None),
    ("Q4_K_M b8 step/roofline", "decode_q4_k_m_b8_time_over_roofline", None, None, None),
    ("Q4_K_M b1 fused/roofline", "decode_q4_k_m_b1_fused_time_over_roofline", None, None, None),
    ("Q4_K_M b1 unroll 8 fused/roofline", "decode_q4_k_m_b1_unroll8_fused_time_over_roofline", None, None, None),
    ("Q4_K_M b8 fused tok/s", "decode_q4_k_m_b8_fused_tokens_per_s", None, None, None),
    ("Q8_0 b1 step/roofline", "decode_q8_0_b1_time_over_roofline", None, None, None),
    ("Q8_0 b1 unroll 8/roofline", "decode_q8_0_b1_unroll8_time_over_roofline", None, None, None),
    ("Gemma3-270M b1 step/roofline", "decode_gemma3_270m_b1_time_over_roofline", None, None, None),
    ("Gemma3-270M b64 tok/s", "decode_gemma3_270m_b64_tokens_per_s", None, None, None),
    ("prefill 2048 ms", "prefill_2048", "prefill_2048", "time", None),
    ("prefill/GEMM 8192 rate", "prefill_2048_fraction_of_gemm_8192", None, None, (">=", 0.60)),
    ("prefill/GEMM same shapes", "prefill_2048_fraction_of_gemm_prefill_shapes", None, None, None),
]


def figures(path: str) -> dict[str, tuple[float, str]]:
    """name -> (value, unit) of the `name value unit` lines of a log."""
    vals = {}
    try:
        for line in open(path, errors="replace"):
            p = line.split()
            if len(p) >= 2 and not line.startswith(("#", "==")):
                try:
                    vals[p[0]] = (float(p[1]), " ".join(p[2:]))
                except ValueError:
                    pass
    except OSError:
        pass
    return vals


def table(ours: dict[str, tuple[float, str]], ref: dict[str, tuple[float, str]]) -> str:
    def val(d, name):
        return d[name][0] if name in d else None

    out = []
    fmt = "{:<26} {:>10} {:>10} {:>7}  {:<8} {}"
    num = lambda v: "-" if v is None else f"{v:.4g}"
    out.append("")
    out.append(fmt.format("figure", "ours", "reference", "ratio", "target", ""))
    for fig, o, r, how, target in ROWS:
        ov, rv = val(ours, o), (val(ref, r) if r else None)
        ratio = None
        if ov and rv:
            ratio = ov / rv if how == "speed" else rv / ov
        judged = ratio if r else ov  # targets bind the ratio where there is a reference
        verdict = ""
        if target and judged is not None:
            op, bound = target
            verdict = "ok" if (judged >= bound if op == ">=" else judged <= bound) else "MISS"
        tgt = f"{target[0]} {target[1]}" if target else ""
        out.append(fmt.format(fig, num(ov), num(rv), "-" if ratio is None else f"{ratio:.2f}x", tgt, verdict))
    # The batch-1 variants side by side, fastest first (step time over the roofline).
    b1 = sorted((v[0], k[len("decode_b1"):-len("_time_over_roofline")] or "defaults (one 20-step mean)")
                for k, v in ours.items() if k.startswith("decode_b1") and k.endswith("_time_over_roofline")
                and not k.startswith("decode_b1_best"))
    if b1:
        out.append("b1 variants, step/roofline: " + ", ".join(f"{n.lstrip('_')} {x:.3f}" for x, n in b1[:12]))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table(figures(argv[1]), figures(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
