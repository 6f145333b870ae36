"""Prompts of an exact length in the served model's own tokens, different for every request.

The benchmark's input length means tokens as the model counts them, so prompts
are built and checked with the model's tokenizer (llama.cpp's, read from the
GGUF with vocab_only: no weights are loaded).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from pathlib import Path

__all__ = ["default_tokenizer_path", "GGUFTokenizer", "PromptBuilder", "WordPromptBuilder", "Prompt"]

# A word piece that re-tokenizes to itself alone and cannot glue onto its neighbours:
# a space and lower-case ASCII letters (byte-level BPE and SentencePiece both split there).
_WORD_PIECE = re.compile(r"^ [a-z]{2,14}$")
_MAX_CANDIDATES = 4000
_FIT_ATTEMPTS = 64


def default_tokenizer_path() -> Path:
    """The prepared default model (the q4_0 copy `syshaxd.model` makes) in the models folder.

    That folder is the daemon's default `model_dir` (relative to the working directory,
    as a started syshaxd sees it) when the model is there, else the checkout's models/.
    Computed when called, never at import, so a later models/ or a moved tree is seen.
    """
    from syshaxd.config import Config
    from syshaxd.model import DEFAULT_QUANTIZED_NAME

    in_model_dir = Config().model_dir_path() / DEFAULT_QUANTIZED_NAME
    if in_model_dir.is_file():
        return in_model_dir.resolve()
    return Path(__file__).resolve().parents[2] / Config().model_dir / DEFAULT_QUANTIZED_NAME


class GGUFTokenizer:
    """The tokenizer of a GGUF model through llama-cpp-python, loaded without its weights."""

    def __init__(self, model_path: str | Path):
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"--tokenizer: {str(path)!r} is not a file; give the GGUF of the model being served"
            )
        try:
            import llama_cpp  # deferred: a heavy import that only prompt building needs
        except ImportError as exc:
            raise RuntimeError(f"building prompts needs llama-cpp-python ({exc})") from exc
        self.path = path
        with _quiet_stderr():
            self._llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

    @property
    def n_vocab(self) -> int:
        return self._llama.n_vocab()

    def encode(self, text: str) -> list[int]:
        """Token ids of text as a server would count it inside a prompt: no BOS, specials as text."""
        return self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def decode(self, ids: list[int]) -> str:
        return self._llama.detokenize(ids).decode("utf-8", errors="replace")

    def eos_ids(self) -> list[int]:
        """End-of-generation token ids (EOS, and EOT when the model has a distinct one)."""
        ids = {self._llama.token_eos()}
        try:
            import llama_cpp

            eot = llama_cpp.llama_vocab_eot(llama_cpp.llama_model_get_vocab(self._llama.model))
            if eot >= 0:
                ids.add(int(eot))
        except (AttributeError, ImportError):  # older bindings: EOS alone
            pass
        return sorted(i for i in ids if i >= 0)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 for a moment: llama.cpp's C logging ignores verbose=False for a few lines,
    which would tear the progress bar and the table."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Prompt:
    """One request's prompt: its text and the number of tokens the tokenizer counts in it."""

    __slots__ = ("text", "n_tokens", "seed")

    def __init__(self, text: str, n_tokens: int, seed: int):
        self.text = text
        self.n_tokens = n_tokens
        self.seed = seed


class PromptBuilder:
    """Builds random-word prompts that re-tokenize to exactly the length asked for.

    Words are drawn from the model's own vocabulary (pieces that are one token each),
    with a different random draw per seed so that no two requests share a prefix a
    server's prefix cache could reuse.
    """

    def __init__(self, tokenizer: GGUFTokenizer):
        self.tokenizer = tokenizer
        self._words = self._single_token_words()

    def _single_token_words(self) -> list[str]:
        tok = self.tokenizer
        order = list(range(tok.n_vocab))
        random.Random(0).shuffle(order)  # a spread over the vocabulary, the same on every run
        words: list[str] = []
        for token_id in order:
            piece = tok.decode([token_id])
            if not piece.startswith(" "):
                piece = " " + piece  # tokenizers that drop the leading space of a lone piece
            if not _WORD_PIECE.match(piece) or tok.encode(piece) != [token_id]:
                continue
            words.append(piece)
            if len(words) >= _MAX_CANDIDATES:
                break
        if len(words) < 50:
            # An odd vocabulary: fall back to plain words and let _fit adjust the count.
            words = [" " + w for w in "the of and to in is it that was for on are with as his they be at one have".split()]
        return words

    def build(self, n_tokens: int, seed: int) -> Prompt:
        """A prompt of exactly n_tokens tokens, the same for the same seed."""
        if n_tokens < 1:
            raise ValueError(f"prompt length {n_tokens} is not allowed; it must be at least 1")
        rng = random.Random(seed)
        text = "".join(rng.choices(self._words, k=n_tokens))
        text = self._fit(text, n_tokens, rng)
        return Prompt(text, n_tokens, seed)

    def _fit(self, text: str, n_tokens: int, rng: random.Random) -> str:
        """text adjusted until it encodes to exactly n_tokens tokens.

        Usually text is right at once. Where it is not (decode/encode round trips can
        merge or split tokens at the seams), cut or extend and check again; cut a little
        deeper each time a cut overshoots, so the loop cannot swing forever.
        """
        tok = self.tokenizer
        deeper = 0
        for _ in range(_FIT_ATTEMPTS):
            ids = tok.encode(text)
            if len(ids) == n_tokens:
                return text
            if len(ids) > n_tokens:
                keep = max(1, n_tokens - deeper)
                text = tok.decode(ids[:keep])
                deeper += 1
            else:
                text += rng.choice(self._words)
        raise RuntimeError(
            f"could not build a prompt of exactly {n_tokens} tokens with the tokenizer of {tok.path}"
        )


class WordPromptBuilder:
    """Prompts of n random words, for the instant stub alone (it counts words as tokens): no model needed."""

    _WORDS = [" " + w for w in (
        "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa"
        " quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
    ).split()]

    def build(self, n_tokens: int, seed: int) -> Prompt:
        if n_tokens < 1:
            raise ValueError(f"prompt length {n_tokens} is not allowed; it must be at least 1")
        return Prompt("".join(random.Random(seed).choices(self._WORDS, k=n_tokens)), n_tokens, seed)
