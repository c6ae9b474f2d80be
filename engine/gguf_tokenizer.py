"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer` (like tokenizer.json).

llama.cpp keeps the vocabulary, merges (or SentencePiece scores), token types and the split
rules (`tokenizer.ggml.pre`) as metadata; `GGUFTokenizer.build` maps them onto the HF
`tokenizers` pieces the same model's tokenizer.json uses.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from duet.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp token types (`tokenizer.ggml.token_type`).
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Split regexes for byte-level BPE vocabularies, by `tokenizer.ggml.pre`, as llama.cpp and the
# models' own tokenizer.json files split text before BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's (and R1's): three splits in turn, each piece of one split cut by the next: runs
# of up to three digits, runs of CJK ideographs and kana, then words, punctuation and spaces.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek-LLM's and DeepSeek-V2's (`deepseek-llm`): six splits in turn: each line break alone,
# a run of cased letters (Latin, Greek, Cyrillic, ...; not CJK) with one optional space before
# it, a run of ASCII, full-width and CJK punctuation (its ASCII range takes ASCII letters too, so
# it cuts a word around a non-ASCII letter), trailing spaces, CJK and Hangul runs, then digit
# runs of any length. NOTE: escapes, not the characters themselves: several (U+1F7D, U+1FBE,
# U+1FD3, U+1FDB, U+2126, U+212A) have canonical equivalents that an editor or a copy may
# silently NFC-normalize, which turns their ranges around.
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
    "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_SPLITS_BY_PRE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_LLAMA3_PRE, (_LLAMA3_SPLIT,)),
    **dict.fromkeys(_QWEN2_PRE, (_QWEN2_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    "deepseek-v3": _DEEPSEEK3_SPLITS,
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
}
# GPT-2's split after cutting every digit apart (SmolLM2's and StarCoder's tokenizer.json).
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})


class GGUFTokenizer:
    """Builds the tokenizer from a GGUF file's metadata (`field(key, default)` reads a key)."""

    def __init__(
        self,
        field: Callable[..., Any],
        tokens: list[str],
        bos: tuple[str | None, int | None],
        eos: tuple[str | None, int | None],
    ) -> None:
        self._field = field
        self._tokens = tokens
        self.bos_token, self.bos_token_id = bos
        self.eos_token, self.eos_token_id = eos

    def _token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self._tokens):
            return None
        return self._tokens[token_id]

    def build(self) -> Tokenizer:
        """Build a `tokenizers.Tokenizer` equivalent to the model's tokenizer.json (a new one per call).

        Control (and unknown) tokens become special added tokens; user-defined tokens become
        non-special added tokens (matched whole, kept by decode). A BOS/EOS post-processor is set
        when the file asks for it (`tokenizer.ggml.add_bos_token`, default True for SentencePiece
        vocabularies); encode a rendered chat template with `add_special_tokens=False`.
        """
        tokenizer_model = self._field("tokenizer.ggml.model")
        if not self._tokens:
            raise ModelLoadError("tokenizer.ggml.tokens: the GGUF file has no vocabulary")
        if tokenizer_model == "gpt2":
            tokenizer = self._byte_level_tokenizer()
            add_bos_default = False
        elif tokenizer_model == "llama":
            tokenizer = self._sentencepiece_tokenizer()
            add_bos_default = True
        else:
            raise ModelLoadError(
                f"tokenizer.ggml.model: tokenizer {tokenizer_model!r} is not supported; "
                "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
            )
        self._add_special_tokens(tokenizer, byte_level=tokenizer_model == "gpt2")
        add_bos = bool(self._field("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(self._field("tokenizer.ggml.add_eos_token", False))
        post_processor = self._post_processor(add_bos, add_eos)
        if post_processor is not None:
            tokenizer.post_processor = post_processor
        return tokenizer

    def _merges(self) -> list[tuple[str, str]]:
        merges = self._field("tokenizer.ggml.merges")
        if merges is not None:
            pairs = [merge.split(" ", 1) for merge in merges]
            return [(left, right) for left, right in pairs]
        scores = self._field("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError("tokenizer.ggml.merges: the GGUF has neither merges nor scores")
        return _merges_from_scores(self._tokens, scores)

    def _byte_level_tokenizer(self) -> Tokenizer:
        # Tokens are spelled in GPT-2's byte alphabet; respell the few that are not (as
        # transformers does) so every vocabulary entry is reachable.
        alphabet = _byte_to_unicode()
        letters = set(alphabet.values())
        vocab = {
            (token if set(token) <= letters else "".join(alphabet[b] for b in token.encode())): i
            for i, token in enumerate(self._tokens)
        }
        pre = self._field("tokenizer.ggml.pre", "default")
        tokenizer = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=self._merges(),
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _LLAMA3_PRE,  # as Llama 3's tokenizer.json and llama.cpp
            )
        )
        if pre in _SPLITS_BY_PRE:
            splits = [
                pre_tokenizers.Split(Regex(regex), behavior="isolated")
                for regex in _SPLITS_BY_PRE[pre]
            ]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
            if pre in _QWEN2_PRE:
                tokenizer.normalizer = normalizers.NFC()
        elif pre in _DIGITS_PRE:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            if pre not in _GPT2_PRE:
                logger.warning(
                    "tokenizer.ggml.pre %r is not known; splitting text as GPT-2 does", pre
                )
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
                add_prefix_space=False, use_regex=True
            )
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _sentencepiece_tokenizer(self) -> Tokenizer:
        # As transformers' LlamaTokenizer (legacy=False) builds Llama 2 / Mistral tokenizers.
        vocab = {token: i for i, token in enumerate(self._tokens)}
        unk_token = self._token(self._field("tokenizer.ggml.unknown_token_id"))
        add_prefix_space = bool(self._field("tokenizer.ggml.add_space_prefix", True))
        tokenizer = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=self._merges(),
                unk_token=unk_token,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tokenizer.decoder = decoders.Sequence(steps)
        return tokenizer

    def _add_special_tokens(self, tokenizer: Tokenizer, byte_level: bool) -> None:
        token_types = self._field("tokenizer.ggml.token_type") or []
        letters = set(_byte_to_unicode().values()) if byte_level else None
        special, user_defined = [], []
        for token, token_type in zip(self._tokens, token_types, strict=False):
            if token_type in (_TOKEN_CONTROL, _TOKEN_UNKNOWN):
                # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel;
                # adding it would grow the vocabulary past the embedding, so skip it.
                if letters is None or set(token) <= letters:
                    special.append(AddedToken(token, special=True, normalized=False))
            elif token_type == _TOKEN_USER_DEFINED:
                user_defined.append(AddedToken(token, special=False, normalized=False))
        tokenizer.add_special_tokens(special)
        tokenizer.add_tokens(user_defined)

    def _post_processor(self, add_bos: bool, add_eos: bool) -> processors.PostProcessor | None:
        bos = self.bos_token if add_bos else None
        eos = self.eos_token if add_eos else None
        if bos is None and eos is None:
            return None

        def template(sequence: str, type_id: int) -> str:
            parts = [
                bos and f"{bos}:{type_id}",
                f"{sequence}:{type_id}",
                eos and f"{eos}:{type_id}",
            ]
            return " ".join(p for p in parts if p)

        special = [(t, i) for t, i in ((bos, self.bos_token_id), (eos, self.eos_token_id)) if t]
        single, pair = template("$A", 0), template("$A", 0) + " " + template("$B", 1)
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best score first (transformers' `generate_merges`, so both tokenize alike)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]
