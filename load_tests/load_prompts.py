"""Prompts of random common words with about a target token count, for load_driver.py.

When the server has a llama.cpp-style `POST /tokenize` ({"content": text} -> {"tokens": [...]}), the
word count of each prompt is adjusted until the server's own count matches the target (within a few
tries); otherwise the length is estimated from TOKENS_PER_WORD.
"""
from __future__ import annotations

import json
import random
from typing import Optional

from load_http import Connection, HttpError

# Short, common English words: each is one token (with its leading space) in GPT-2-style BPE vocabs
# such as SmolLM2's, so the estimate below is close even without a tokenizer endpoint.
WORDS = """
the of and to in is for on that with as at by from this be are was it or an have not they
which one you were all we can but there more has their if will other about out many then them
these so some her would make like him into time two look write go see number no way could
people my than first water been call who now find long down day did get come made may part over
new sound take only little work know place year live me back give most very after thing our just
name good sentence man think say great where help through much before line right too mean old any
same tell boy follow came want show also around form three small set put end does another well
large must big even such because turn here why ask went men read need land different home us move
try kind hand picture again change off play spell air away animal house point page letter mother
answer found study still learn should world high every near add food between own below country
plant last school father keep tree never start city earth eye light thought head under story saw
left few while along might close something seem next hard open example begin life always those
both paper together got group often run important until children side feet car mile night walk
white sea began grow took river four carry state once book hear stop without second later miss
idea enough eat face watch far real almost let above girl sometimes mountain cut young talk soon
list song being leave family body music color stand sun question fish area mark dog horse birds
problem complete room knew since ever piece told usually friends easy heard order red door sure
become top ship across today during short better best however low hours black products happened
whole measure remember early waves reached listen wind rock space covered fast several hold himself
toward five step morning passed vowel true hundred against pattern table north slowly money map
""".split()

TOKENS_PER_WORD = 1.0    # measured with the SmolLM2 vocab: these words are single tokens


def parse_mix(spec: str) -> list[tuple[int, int]]:
    """'64:64,512:128' -> [(64, 64), (512, 128)]; raises ValueError on anything else."""
    shapes = []
    for item in spec.split(","):
        p, sep, g = item.strip().partition(":")
        if not sep or not p.strip().isdigit() or not g.strip().isdigit():
            raise ValueError(f"bad mix entry {item!r}: expected PROMPT_TOKENS:GEN_TOKENS")
        shape = (int(p), int(g))
        if shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"bad mix entry {item!r}: lengths must be >= 1")
        shapes.append(shape)
    if not shapes:
        raise ValueError("empty mix")
    return shapes


class PromptFactory:
    """Makes distinct random-word prompts of a target token length."""

    MAX_TRIES = 8

    def __init__(self, target, tokenize_path: str, seed: int):
        self.target = target
        self.tokenize_path = tokenize_path
        self.rng = random.Random(seed)
        self.conn = None
        self.use_server = False
        self.calibrated: dict[int, tuple[int, int]] = {}   # target -> (n_words, n_tokens)

    async def probe(self) -> None:
        """Checks whether the server can count tokens; falls back to the estimate if not."""
        if not self.tokenize_path:
            return
        self.conn = Connection(self.target)
        try:
            self.use_server = (await self._count("hello world")) is not None
        except (OSError, HttpError, ValueError):
            self.use_server = False
        if not self.use_server:
            self.conn.close()
            self.conn = None

    async def _count(self, text: str) -> Optional[int]:
        status, body = await self.conn.call("POST", self.tokenize_path, {"content": text})
        if status != 200:
            return None
        tokens = json.loads(body).get("tokens")
        return len(tokens) if isinstance(tokens, list) else None

    async def make(self, n_target: int) -> tuple[str, int]:
        """Returns (prompt, token count): exact when the server counts, else estimated.

        Remembers the word count that hit the target, for make_quick.
        """
        words = self._words(n_target)
        n_words = max(1, round(n_target / TOKENS_PER_WORD))
        if not self.use_server:
            return " ".join(words[:n_words]), round(n_words * TOKENS_PER_WORD)
        best = None
        for _ in range(self.MAX_TRIES):
            text = " ".join(words[:n_words])
            n = await self._count(text)
            if n is None:
                raise ValueError(f"{self.tokenize_path} stopped answering")
            if best is None or abs(n - n_target) < abs(best[2] - n_target):
                best = (text, n_words, n)
            if n == n_target:
                break
            n_words = min(len(words), max(1, n_words + round((n_target - n) / TOKENS_PER_WORD)))
        self.calibrated[n_target] = (best[1], best[2])
        return best[0], best[2]

    def make_quick(self, n_target: int) -> tuple[str, int]:
        """Like make, without asking the server: reuses the word count make found for this
        target (its token count is then an estimate), else the TOKENS_PER_WORD estimate."""
        n_words, n_tokens = self.calibrated.get(
            n_target, (max(1, round(n_target / TOKENS_PER_WORD)), None))
        if n_tokens is None:
            n_tokens = round(n_words * TOKENS_PER_WORD)
        return " ".join(self._words(n_target)[:n_words]), n_tokens

    def _words(self, n_target: int) -> list[str]:
        return [self.rng.choice(WORDS) for _ in range(int(n_target / TOKENS_PER_WORD) * 2 + 16)]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class TokenIdFactory:
    """Prompts of random token ids in [100, n_vocab), exactly n_target long, as `troupe bench
    --concurrency` makes them: the same workload through HTTP and through the in-process handle."""

    def __init__(self, n_vocab: int, seed: int):
        if n_vocab <= 100:
            raise ValueError("--token-ids needs a vocabulary of more than 100 tokens")
        self.n_vocab = n_vocab
        self.rng = random.Random(seed)

    async def probe(self) -> None:
        pass

    async def make(self, n_target: int) -> tuple[list[int], int]:
        return self.make_quick(n_target)

    def make_quick(self, n_target: int) -> tuple[list[int], int]:
        return [self.rng.randrange(100, self.n_vocab) for _ in range(n_target)], n_target

    def close(self) -> None:
        pass
