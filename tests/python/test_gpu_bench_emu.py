"""The device benchmark (engine/cuda/gpu_bench.cpp) over the CPU emulation of CUDA, at toy sizes.

troupe_gpu_bench is the first thing scripts/gpu-check runs on a lent GPU, and most of its
launch-option variants (fused, folded, prefetching, streamed GEMVs) were written without a
device. Built over the emulation (build/troupe_gpu_bench_emu) with `--smoke 1`, every figure and
variant runs here, so the device call does not find a variant that throws, a launch the emulation
refuses, or a capture that fails; and the table gpu-check prints (scripts/gpu_check_table.py) is
checked to name figures the benchmark prints. The shape keeps Llama-3-8B's head size (128) and a
4:1 GQA group with dimensions the streamed GEMV takes (multiples of 256); a context of 160 makes
decode attention split its rows (above 64 positions), so the last-CTA merge runs.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("TROUPE_BUILD_DIR", ROOT / "build"))
BENCH = BUILD / "troupe_gpu_bench_emu"
SHAPE = ["--arch", "llama-3-8b", "--layers", "2", "--d-model", "512", "--heads", "4", "--kv-heads", "1",
         "--d-ff", "1792", "--vocab", "512"]
SMOKE = ["--smoke", "1", *SHAPE, "--context", "160", "--steps", "1"]

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_table  # noqa: E402

pytestmark = pytest.mark.skipif(not BENCH.exists(), reason="no emulated benchmark (a build where CMake found the CUDA headers)")


def run_bench(args, env=None, timeout=900):
    return subprocess.run([str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    r = run_bench(SMOKE)
    log = tmp_path_factory.mktemp("bench") / "bench.log"
    log.write_text(r.stdout)
    return r, log


def test_every_figure_and_variant_runs(smoke_run):
    r, log = smoke_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    comments = [l for l in r.stdout.splitlines() if l.startswith("#")]
    # What the benchmark says of a variant that threw, was skipped, or ran without its graphs.
    bad = [l for l in comments if re.match(r"# (.* failed|.* skipped|.* ran eagerly|CUDA graphs off|the device no longer"
                                           r"|decode_b1_gemv_streamed_\S+: )", l)]
    assert not bad, "\n".join(bad)
    figs = gpu_check_table.figures(str(log))
    # RMSNorm folded into the GEMVs under the options that ask for it, and graphs captured.
    assert figs["decode_b1_fold_applies"][0] == 1.0
    assert figs["decode_graphs"][0] >= 4
    # Every batch-1 variant ran (one step line each) and the fastest of them was named.
    b1 = {k for k in figs if k.startswith("decode_b1_") and k.endswith("_time_over_roofline")}
    assert len(b1) >= 25, sorted(b1)
    assert "decode_b1_best_time_over_roofline" in figs
    assert any(l.startswith("# fastest batch-1 step: decode_b1") for l in comments)
    # The streamed GEMV's pipeline search ran every shape.
    assert len([k for k in figs if k.startswith("decode_b1_gemv_streamed_s") and k.endswith("_only_over_roofline")]) == 8


def test_the_table_names_only_figures_the_benchmark_prints(smoke_run):
    r, log = smoke_run
    assert r.returncode == 0
    figs = gpu_check_table.figures(str(log))
    # Figures named by their size carry the toy sizes here (--smoke 1: a 256^3 GEMM, 64-token prefill).
    toy = lambda name: name.replace("8192", "256").replace("2048", "64")
    missing = [ours for _, ours, *_ in gpu_check_table.ROWS if toy(ours) not in figs]
    assert not missing, missing
    # The script itself, as gpu-check runs it (no PyTorch log here): every row has a figure of ours.
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_table.py"), str(log), str(log) + ".none"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "b1 variants, step/roofline: " in out.stdout
    rows = [l for l in out.stdout.splitlines() if l and not l.startswith(("figure", "b1 variants"))]
    assert len(rows) == len(gpu_check_table.ROWS)


def test_a_model_the_device_cannot_hold_fails_with_a_clear_error():
    r = run_bench(["--decode-only", "1", *SHAPE, "--context", "16", "--steps", "1"], env={"TROUPE_EMU_DEVICE_MIB": "8"},
                  timeout=120)
    assert r.returncode == 1
    # What was asked and what was free, in units that do not round a small buffer to "0 MiB".
    assert re.search(r"out of device memory allocating the .+: \d+ KiB asked, \d+ KiB free of 8\.0 MiB", r.stderr), r.stderr


def test_bad_arguments_are_refused():
    for args, says in ((["--heads", "5", "--kv-heads", "2"], "multiple of --kv-heads"), (["--layers", "-1"], "positive"),
                       (["--frobnicate", "1"], "unknown option")):
        r = run_bench([*args, "--smoke", "1"], timeout=60)
        assert r.returncode == 1 and says in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("options, folds", [(["--decode-only", "1", "--fused", "1", "--fold", "1", "--prefetch", "2048"], True),
                                            (["--decode-only", "2", "--streamed", "1"], None),
                                            (["--decode-only", "1", "--streamed", "1", "--fold", "1"], False)])
def test_the_profilers_decode_only_runs(options, folds):
    """scripts/gpu-profile's runs: the model and its decode steps alone, under the options it passes."""
    r = run_bench([*options, *SHAPE, "--context", "160", "--steps", "1"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    batch = options[1]
    assert re.search(rf"^decode_b{batch}_step [0-9.e+]+ ms$", r.stdout, re.M), r.stdout
    # The streamed GEMV is not gemv_bf16, so RMSNorm stays in its own kernels, and the run says so.
    if folds is not None:
        assert ("do not fold RMSNorm" in r.stdout) == (not folds), r.stdout
