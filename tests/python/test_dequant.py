"""GGUF loading and reference dequantization against the gguf Python package (the independent
reference): every supported type must come out bit-identical to gguf.quants.dequantize, and every
corrupt file must be refused with one `error:` line naming the file and the culprit.

Drives `troupe_gguf_tool` ($TROUPE_BUILD_DIR/tests/tools/troupe_gguf_tool)."""

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGML_QUANT_SIZES, quants  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "default.gguf"


@pytest.fixture(scope="session")
def tool() -> Path:
    build = os.environ.get("TROUPE_BUILD_DIR")
    if not build:
        pytest.skip("TROUPE_BUILD_DIR is not set (ctest sets it to the build directory)")
    path = Path(build) / "tests" / "tools" / "troupe_gguf_tool"
    if not path.exists():
        pytest.fail(f"{path} is missing: build the troupe_gguf_tool target")
    return path


def run_tool(tool: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=300)


# ---- random tensors of every type -----------------------------------------------------------------

SHAPES_32 = [(32,), (3, 64), (2, 3, 96), (2, 1, 2, 32)]  # numpy order: last axis is ne[0]
SHAPES_256 = [(256,), (3, 512), (2, 2, 256)]


def sane_fp16(rng, n: int, scale: float) -> np.ndarray:
    """n finite fp16 scales as raw bytes, shape (n, 2)."""
    return (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(rng, qtype: T, shape) -> np.ndarray:
    """Random raw blocks (every quant value reachable) with finite fp16 scales, in byte shape."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
        raw[:, 0:2] = sane_fp16(rng, n_blocks, 0.05)
    elif qtype in (T.Q4_1, T.Q4_K, T.Q5_K):  # d and min / dmin
        raw[:, 0:2] = sane_fp16(rng, n_blocks, 0.05)
        raw[:, 2:4] = sane_fp16(rng, n_blocks, 0.05)
    elif qtype == T.Q6_K:  # d is the last field
        raw[:, -2:] = sane_fp16(rng, n_blocks, 0.05)
    return raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def special_floats() -> np.ndarray:
    return np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-45, 65504.0, 65520.0, 6e-8, 3e-5, 1.0, -2.5],
                    dtype=np.float32)


def tensors_for(qtype: T, rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (what GGUFWriter stores, the expected float32 values in numpy order)."""
    out = {}
    if qtype == T.F32:
        for i, shape in enumerate(SHAPES_32):
            x = rng.standard_normal(shape).astype(np.float32)
            out[f"f32.{i}"] = (x, x)  # F32 must come back as the very same bits
        x = np.concatenate([special_floats(), np.array([np.nan], np.float32),
                            np.array([0x7f800001, 0xffc01234], np.uint32).view(np.float32)])
        out["f32.special"] = (x, x)
    elif qtype == T.F16:
        for i, shape in enumerate(SHAPES_32):
            x = (rng.standard_normal(shape) * 10).astype(np.float16)
            out[f"f16.{i}"] = (x, quants.dequantize(x.view(np.uint8), T.F16))
        # every fp16 bit pattern: subnormals, inf, NaN payloads, -0
        x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(64, 1024)
        out["f16.all"] = (x, quants.dequantize(x.view(np.uint8), T.F16))
    elif qtype == T.BF16:
        for i, shape in enumerate(SHAPES_32):
            q = quants.quantize(rng.standard_normal(shape).astype(np.float32) * 100, T.BF16)
            out[f"bf16.{i}"] = (q, quants.dequantize(q, T.BF16))
        raw = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(64, 2048)
        out["bf16.all"] = (raw, quants.dequantize(raw, T.BF16))
    else:
        block_size = GGML_QUANT_SIZES[qtype][0]
        shapes = SHAPES_32 if block_size == 32 else SHAPES_256
        for i, shape in enumerate(shapes):
            raw = random_blocks(rng, qtype, shape)
            out[f"{qtype.name.lower()}.raw{i}"] = (raw, quants.dequantize(raw, qtype))
        if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):  # also what the reference quantizer makes of floats
            for i, shape in enumerate(shapes):
                q = quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
                out[f"{qtype.name.lower()}.q{i}"] = (q, quants.dequantize(q, qtype))
    return out


def write_gguf(path: Path, tensors: dict, qtype: T) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for name, (stored, _) in tensors.items():
        if stored.dtype in (np.float32, np.float16):
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequant_is_bit_identical_to_gguf_py(tool, tmp_path, qtype):
    rng = np.random.default_rng(1234 + int(qtype))
    tensors = tensors_for(qtype, rng)
    model = tmp_path / f"{qtype.name}.gguf"
    write_gguf(model, tensors, qtype)
    outdir = tmp_path / "out"
    outdir.mkdir()
    r = run_tool(tool, "dequant", model, outdir)
    assert r.returncode == 0, r.stderr

    reader = gguf.GGUFReader(str(model))
    assert {t.name for t in reader.tensors} == set(tensors)
    for name, (_, want) in tensors.items():
        got = np.fromfile(outdir / f"{name}.f32", dtype="<f4")
        want = np.ascontiguousarray(want, dtype=np.float32).ravel()
        assert got.size == want.size, name
        if qtype not in (T.F32, T.F16, T.BF16):
            assert np.isfinite(want).all(), f"{name}: the test data should give finite weights"
        mismatch = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
        assert mismatch.size == 0, (
            f"{name}: {mismatch.size} of {want.size} values differ, first at {mismatch[0]}: "
            f"got {got[mismatch[0]]!r} want {want[mismatch[0]]!r}")


def test_info_lists_shapes_and_types(tool, tmp_path):
    rng = np.random.default_rng(7)
    tensors = tensors_for(T.Q4_K, rng)
    model = tmp_path / "m.gguf"
    write_gguf(model, tensors, T.Q4_K)
    r = run_tool(tool, "info", model)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[0]["version"] == 3 and lines[0]["n_tensors"] == len(tensors)
    assert {"key": "llama.block_count", "value": 1} in lines
    got = {d["tensor"]: d for d in lines if "tensor" in d}
    for name, (_, want) in tensors.items():
        assert got[name]["type"] == "Q4_K"
        assert got[name]["ne"] == list(reversed(want.shape))


# ---- corrupt files ------------------------------------------------------------------------------

def gguf_bytes(tensors, kv=(), magic=b"GGUF", version=3, alignment=32) -> bytes:
    """A GGUF file by hand. tensors: (name, ne, type id, offset, data bytes); kv: (key, type, value bytes)."""
    def s(x: bytes) -> bytes:
        return struct.pack("<Q", len(x)) + x

    out = bytearray(magic + struct.pack("<IQQ", version, len(tensors), len(kv)))
    for key, vtype, value in kv:
        out += s(key.encode()) + struct.pack("<I", vtype) + value
    for name, ne, ttype, offset, _ in tensors:
        out += s(name.encode()) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", ttype, offset)
    out += bytes(-len(out) % alignment)
    start = len(out)
    for _, _, _, offset, data in tensors:
        end = start + offset + len(data)
        if len(out) < end:
            out += bytes(end - len(out))
        out[start + offset:end] = data
    return bytes(out)


def good_tensors():
    return [("tok", [64, 2], int(T.Q8_0), 0, bytes(136)), ("w", [32, 3], int(T.F32), 160, bytes(384))]


CORRUPTIONS = {
    "bad magic": (dict(magic=b"GGML"), ["magic"]),
    "version 4": (dict(version=4), ["version 4"]),
    "unknown tensor type": ("w.type=99", ["tensor 'w'", "unsupported tensor type 99"]),
    "Q5_1 unsupported": ("w.type=7", ["tensor 'w'", "Q5_1"]),
    "5 dims": ("w.ne=[32,1,1,1,3]", ["tensor 'w'", "5 dimensions"]),
    "zero dim": ("w.ne=[32,0]", ["tensor 'w'", "dimension 1"]),
    "row not whole blocks": ("tok.ne=[48,2]", ["tensor 'tok'", "block size 32"]),
    "misaligned offset": ("w.offset=176", ["tensor 'w'", "alignment"]),
    "overlap": ("w.offset=128", ["tensor 'w'", "'tok'", "overlap"]),
    "data past EOF": ("w.data=383", ["tensor 'w'", "truncated"]),
    "duplicate name": ("w.name=tok", ["tensor 'tok'", "duplicate"]),
    "string past EOF": ("kv.general.name", ["key 'general.name'", "truncated"]),
}


def corrupt(change: str) -> bytes:
    tensors = [list(t) for t in good_tensors()]
    kv = [("general.architecture", 8, struct.pack("<Q", 5) + b"llama")]
    if change.startswith("kv."):
        kv.append((change[3:], 8, struct.pack("<Q", 1 << 40) + b"x"))
    else:
        which, assign = change.split(".", 1)
        field, value = assign.split("=")
        t = tensors[0 if which == "tok" else 1]
        if field == "type":
            t[2] = int(value)
        elif field == "ne":
            t[1] = json.loads(value)
        elif field == "offset":
            t[3] = int(value)
        elif field == "data":
            t[4] = t[4][: int(value)]
        elif field == "name":
            t[0] = value
    return gguf_bytes([tuple(t) for t in tensors], kv)


def test_hand_written_file_is_valid(tool, tmp_path):
    """The base of the corruption cases loads: each case below fails for its one change only."""
    model = tmp_path / "good.gguf"
    model.write_bytes(gguf_bytes(good_tensors(), [("general.architecture", 8, struct.pack("<Q", 5) + b"llama")]))
    r = run_tool(tool, "dequant", model, tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.fromfile(tmp_path / "w.f32", dtype="<f4").tolist() == [0.0] * 96
    reader = gguf.GGUFReader(str(model))  # the reference reader agrees it is well formed
    assert [t.name for t in reader.tensors] == ["tok", "w"]


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_file_gives_one_error_line(tool, tmp_path, case):
    change, needles = CORRUPTIONS[case]
    data = gguf_bytes(good_tensors(), [], **change) if isinstance(change, dict) else corrupt(change)
    model = tmp_path / "bad.gguf"
    model.write_bytes(data)
    for args in (("dequant", model, tmp_path), ("info", model)):
        r = run_tool(tool, *args)
        assert r.returncode == 1, (case, r.stdout, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert str(model) in lines[0], lines[0]
        for n in needles:
            assert n in lines[0], (n, lines[0])


def test_missing_file_and_missing_tensor(tool, tmp_path):
    r = run_tool(tool, "info", tmp_path / "nope.gguf")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "nope.gguf" in r.stderr
    model = tmp_path / "good.gguf"
    model.write_bytes(gguf_bytes(good_tensors()))
    r = run_tool(tool, "dequant", model, tmp_path, "absent.weight")
    assert r.returncode == 1 and "'absent.weight'" in r.stderr


# ---- the real default model ---------------------------------------------------------------------

@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason=f"{DEFAULT_MODEL} not present (scripts/setup.sh)")
def test_default_model_loads_and_dequantizes(tool, tmp_path):
    r = run_tool(tool, "info", DEFAULT_MODEL)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[0]["n_tensors"] == 272
    assert {"key": "llama.block_count", "value": 30} in lines
    tensors = {d["tensor"]: d for d in lines if "tensor" in d}
    assert len(tensors) == 272
    assert tensors["token_embd.weight"]["type"] == "Q8_0"
    assert tensors["token_embd.weight"]["ne"] == [576, 49152]

    reader = gguf.GGUFReader(str(DEFAULT_MODEL))
    by_name = {t.name: t for t in reader.tensors}
    names = ["token_embd.weight", "blk.0.ffn_down.weight", "blk.29.attn_q.weight", "output_norm.weight"]
    r = run_tool(tool, "dequant", DEFAULT_MODEL, tmp_path, *names)
    assert r.returncode == 0, r.stderr
    for name in names:
        t = by_name[name]
        assert tensors[name]["type"] == t.tensor_type.name
        want = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).ravel()
        got = np.fromfile(tmp_path / f"{name}.f32", dtype="<f4")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
