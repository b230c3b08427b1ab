"""`troupe` on bad input: one clear `troupe: error:` line on stderr, exit code 1, never a crash or
a hang (every call runs under a timeout)."""
import os
import subprocess

import pytest

BIN = os.environ.get("TROUPE_BIN")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "default.gguf")

pytestmark = pytest.mark.skipif(not BIN, reason="TROUPE_BIN not set (run through ctest)")


def run(*args, stdin=None):
    return subprocess.run([BIN, *args], input=stdin, capture_output=True, text=True, timeout=60)


def assert_one_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("troupe: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_missing_model_file():
    assert_one_error(run("generate", "-m", "/nonexistent/model.gguf", "-p", "hi"), "/nonexistent/model.gguf")


@pytest.mark.parametrize("cut", [0, 3, 24, 1000, 2_000_000])
def test_truncated_model_file(tmp_path, cut):
    bad = tmp_path / "cut.gguf"
    with open(MODEL, "rb") as f:
        bad.write_bytes(f.read(cut))
    assert_one_error(run("generate", "-m", str(bad), "-p", "hi"), str(bad))


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "text.gguf"
    bad.write_text("this is not a model\n" * 100)
    assert_one_error(run("generate", "-m", str(bad), "-p", "hi"), str(bad), "magic")


def test_corrupt_tensor_offset(tmp_path):
    # Flip bytes in the tensor table (after the metadata): a tensor offset or shape goes wrong.
    data = bytearray(open(MODEL, "rb").read(2_000_000))
    full = bytearray(open(MODEL, "rb").read())
    from gguf import GGUFReader
    r = GGUFReader(MODEL)
    t = r.tensors[5]
    # the tensor-info entry's offset field sits right before the next name; corrupt the data offset
    # by rewriting the file with an impossible offset through the reader's memory map position.
    off_field = t.field.parts[-1]
    pos = int(off_field.ctypes.data - r.data.ctypes.data)
    full[pos:pos + 8] = (len(full) * 4).to_bytes(8, "little")
    bad = tmp_path / "offset.gguf"
    bad.write_bytes(bytes(full))
    assert_one_error(run("generate", "-m", str(bad), "-p", "hi"), str(bad), t.name)


def test_empty_prompt():
    assert_one_error(run("generate", "-p", ""), "prompt is empty")


def test_prompt_longer_than_context():
    assert_one_error(run("generate", "-c", "32", "-p", "word " * 100), "exceed the context of 32")


@pytest.mark.parametrize("flag,value,field", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--min-p", "2", "min_p"),
    ("--top-k", "-3", "top_k"),
    ("--presence-penalty", "9", "presence"),
    ("--repeat-penalty", "0", "repetition"),
    ("--temperature", "nan", "temperature"),
])
def test_invalid_sampling(flag, value, field):
    assert_one_error(run("generate", "-p", "hi", flag, value), field)


@pytest.mark.parametrize("args,needle", [
    (["-n", "0"], "max-tokens"),
    (["-t", "-2"], "threads"),
    (["--kv-block-size", "3"], "kv-block-size"),
])
def test_invalid_engine_values(args, needle):
    assert_one_error(run("generate", "-p", "hi", *args), needle)


def test_bad_token_ids():
    assert_one_error(run("generate", "--prompt-tokens", "1,abc"), "abc")
    assert_one_error(run("generate", "--prompt-tokens", "1,99999999"), "outside the vocabulary")


def test_serve_device_refused_at_start():
    """--device: a bad name, or a CUDA device this machine (or build) lacks, stops `serve` at once
    with one error line naming it (after the effective config), not a server whose circuit opens."""
    r = run("serve", "--port", "0", "--device", "gpu")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("troupe: error: engine.device (--device)")
    if subprocess.run(["sh", "-c", "command -v nvidia-smi && nvidia-smi -L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is present: the CUDA device exists")
    r = run("serve", "--port", "0", "--device", "cuda:0")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("troupe: error: ") and ("no CUDA device 0" in last or "no CUDA backend" in last), last


def test_serve_cuda_flags_reach_the_effective_config():
    """--cuda-graphs and --cuda-fused-decode land in the effective configuration `serve` prints
    (engine.cuda_graphs, engine.cuda_fused_decode); a value that is not a boolean is refused."""
    # A KV cache beyond the machine's memory stops `serve` right after it prints the configuration.
    r = run("serve", "--port", "0", "--kv-mb", "16000000", "--cuda-graphs", "false", "--cuda-fused-decode", "true")
    assert r.returncode == 1, r.stderr
    assert "\ncuda_graphs = false\n" in r.stderr and "\ncuda_fused_decode = true\n" in r.stderr, r.stderr
    r = run("serve", "--port", "0", "--kv-mb", "16000000")
    assert "\ncuda_graphs = true\n" in r.stderr and "\ncuda_fused_decode = false\n" in r.stderr, r.stderr
    r = run("serve", "--port", "0", "--cuda-fused-decode", "maybe")
    assert r.returncode != 0 and "--cuda-fused-decode" in r.stderr, r.stderr


def test_serve_kv_beyond_memory_refused_at_start():
    """A KV cache larger than the machine's memory stops `serve` at once with one error line,
    before anything is allocated (not a server whose executor dies allocating it)."""
    r = run("serve", "--port", "0", "--kv-mb", "16000000")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("troupe: error: the KV cache needs") and "lower --kv-mb" in last, last


@pytest.mark.parametrize("args,needle", [
    (["--target-itl-ms", "-1"], "scheduler.target_itl_ms (--target-itl-ms) must be >= 0"),
    (["--target-itl-ms", "inf"], "scheduler.target_itl_ms (--target-itl-ms)"),
    (["--itl-stretch", "0.9"], "scheduler.itl_stretch (--itl-stretch) must be >= 1"),
    (["--min-prefill-tokens", "0"], "scheduler.min_prefill_tokens (--min-prefill-tokens) must be in [1, 65536]"),
])
def test_serve_scheduler_limits_refused_at_start(args, needle):
    r = run("serve", "--port", "0", *args)
    assert r.returncode == 1, r.stderr
    assert needle in r.stderr.strip().splitlines()[-1], r.stderr


def test_good_run_after_errors():
    r = run("generate", "-p", "The capital of France is", "-n", "4", "--temperature", "0", "-q")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
