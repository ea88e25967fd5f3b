"""Tokenizer metadata for GGUF, as llama.cpp's converter writes it (``convert_hf_to_gguf.py``:
``get_vocab_base``, ``_set_vocab_gpt2``, ``BertModel.set_vocab``; gguf-py's ``SpecialVocab``), read
from the source's tokenizer files alone: no transformers, no tokenizers, no network.

- ``tokenizer.json`` WordPiece, or ``vocab.txt`` -> ``bert``: tokens in "phantom space" form (a
  word-start token gains U+2581, ``##x`` becomes ``x``, control tokens stay), token_type, special ids,
  add_* flags, normalizer.lowercase/strip_accents.
- ``tokenizer.json`` byte-level BPE -> ``gpt2``: pre, tokens, token_type, merges, special ids, add_* flags.
- ``tokenizer.model`` (SentencePiece, with or without tokenizer.json) -> ``llama``: see ``tokenizer_spm.py``.
- no tokenizer files -> ``none`` (llama.cpp then sizes the vocab from ``<arch>.vocab_size``).
- all: ``tokenizer.chat_template`` when there is one; ``token_type_count`` for the bert arch.

Types: special (or special-looking, ``<|...|>``) added tokens are control, other added tokens
user-defined, the rest normal. llama.cpp has no CLS id key: CLS is written as BOS (and SEP as EOS when
there is none), as ``SpecialVocab`` does. No scores: the converter writes none for these tokenizers.
Refused: duplicate tokens (llama.cpp will not load them), a count other than config.json's
``vocab_size`` (the converter would pad with ``[PAD<i>]``), ids out of range, a SentencePiece-style
tokenizer.json (byte fallback or Metaspace) without its ``tokenizer.model``.
"""

from __future__ import annotations

from collections.abc import Callable

from qcompiler.backends.gguf.tokenizer_common import (
    PHANTOM,
    Config,
    Files,
    Json,
    TokenizerError,
    TokenType,
    added_tokens,
    chat_template,
    check_tokens,
    is_int,
    load_json,
    looks_special,
    special_kvs,
    special_names,
    text,
    token_text,
)
from qcompiler.backends.gguf.tokenizer_spm import sentencepiece_metadata
from qcompiler.backends.gguf.writer import KV, GGUFValueType

__all__ = ["LLAMA3_SPLIT", "TokenizerError", "tokenizer_metadata"]

CONTINUATION = "##"
ENCODER_ARCHS = frozenset({"bert"})
"""Architectures whose loader requires ``tokenizer.ggml.token_type_count``."""
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRE = [
    {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
]
"""The Llama 3 pre-tokenizers as tokenizer.json spells them (llama.cpp's ``llama-bpe``)."""
VOCAB_FILES: dict[str, Callable[[Files, Json, Config, str], list[KV]]] = {"tokenizer.model": sentencepiece_metadata}
"""Vocabularies in a file of their own, converted by their module (these win over tokenizer.json)."""
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_metadata(files: Files, config: Config, arch: str) -> list[KV]:
    """The ``tokenizer.*`` metadata for ``arch`` from the source's tokenizer files (name -> bytes)."""
    tc = load_json(files, "tokenizer_config.json") or {}
    own = next((conv for name, conv in VOCAB_FILES.items() if name in files), None)
    doc = None if own is not None else load_json(files, "tokenizer.json")
    try:
        kvs = own(files, tc, config, arch) if own is not None else convert(files, doc, tc, config)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field of an unexpected shape
        source = "tokenizer.json" if doc is not None else "tokenizer files"
        raise TokenizerError(f"{source}: malformed: {type(e).__name__}: {e}") from None
    if arch in ENCODER_ARCHS:  # read (and required) by llama.cpp's BERT loader, vocab or not
        n_types = config.get("type_vocab_size", 1)
        if not is_int(n_types) or n_types <= 0:
            raise TokenizerError(f"config.json: type_vocab_size must be a positive integer, found {n_types!r}")
        kvs.append(KV.u32("tokenizer.ggml.token_type_count", n_types))
    return kvs


def convert(files: Files, doc: Json | None, tc: Json, config: Config) -> list[KV]:
    kind = doc["model"].get("type") if doc is not None else "WordPiece" if "vocab.txt" in files else None
    if kind == "WordPiece":
        vocab = Vocab(files, doc, tc, config, wordpiece=True)
        lower, strip = normalizer_options(doc, tc)
        head = [KV.string("tokenizer.ggml.model", "bert")]
        tail = [KV.boolean("tokenizer.ggml.normalizer.lowercase", lower)]
        tail.append(KV.boolean("tokenizer.ggml.normalizer.strip_accents", strip))
    elif kind == "BPE" and doc is not None:
        model = doc["model"]
        parts = component_types(doc.get("pre_tokenizer")) | component_types(doc.get("decoder"))
        if model.get("byte_fallback") or "Metaspace" in parts or "ByteLevel" not in parts:
            msg = "a SentencePiece-style BPE (byte_fallback, or not ByteLevel) needs its tokenizer.model"
            raise TokenizerError(f"tokenizer.json: {msg}")
        vocab = Vocab(files, doc, tc, config, wordpiece=False)
        head = [KV.string("tokenizer.ggml.model", "gpt2"), KV.string("tokenizer.ggml.pre", pre_tokenizer_name(doc))]
        tail = [KV.array("tokenizer.ggml.merges", GGUFValueType.STRING, merges(model))]
    elif doc is not None:
        raise TokenizerError(f"tokenizer.json: model type {kind!r} is not supported yet (WordPiece and BPE are)")
    elif "vocab.json" in files:
        raise TokenizerError("vocab.json: slow-BPE vocabularies (without tokenizer.json) are not supported yet")
    elif present := [n for n in CONFIG_FILES if n in files]:
        raise TokenizerError(f"{present[0]}: tokenizer settings without a vocabulary (tokenizer.json or vocab.txt)")
    else:
        return [KV.string("tokenizer.ggml.model", "none")]  # a factory model: llama.cpp uses <arch>.vocab_size
    kvs = [
        *head,
        KV.array("tokenizer.ggml.tokens", GGUFValueType.STRING, vocab.tokens),
        KV.array("tokenizer.ggml.token_type", GGUFValueType.INT32, [int(t) for t in vocab.types]),
        *tail,
        *vocab.special_kvs(doc, tc, config),
    ]
    if template := chat_template(files, tc):
        kvs.append(KV.string("tokenizer.chat_template", template))
    return kvs


def base_vocab(files: Files, doc: Json | None) -> tuple[dict[int, str], str]:
    """The model's own id -> token map and the file it came from."""
    if doc is None:
        lines = text(files, "vocab.txt").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return dict(enumerate(lines)), "vocab.txt"
    vocab = doc["model"].get("vocab")
    if not isinstance(vocab, dict):
        raise TokenizerError("tokenizer.json: model.vocab must be an object of token -> id")
    out: dict[int, str] = {}
    for tok, i in vocab.items():
        if not is_int(i) or i < 0:
            raise TokenizerError(f"tokenizer.json: token {tok!r} has id {i!r}, not a non-negative integer")
        if i in out:
            raise TokenizerError(f"tokenizer.json: tokens {out[i]!r} and {tok!r} both have id {i}")
        out[i] = tok
    return out, "tokenizer.json"


class Vocab:
    """Tokens in id order with their types, plus what the special-token and flag logic needs."""

    def __init__(self, files: Files, doc: Json | None, tc: Json, config: Config, *, wordpiece: bool) -> None:
        base, self.source = base_vocab(files, doc)
        added = added_tokens(doc, tc)
        self.names = special_names(files, tc)
        # transformers adds every named special token as a special added token
        specials = set(self.names.values())
        specials.update(t for t in map(token_text, tc.get("additional_special_tokens") or []) if t)
        merged = dict(base)
        for i, (content, _) in added.items():
            if i in base and base[i] != content:
                raise TokenizerError(f"{self.source}: id {i} is both {base[i]!r} and added token {content!r}")
            merged[i] = content
        self.raw_ids: dict[str, int] = {}  # raw text -> id, added tokens first (as SpecialVocab looks them up)
        for i in sorted(added):
            self.raw_ids.setdefault(added[i][0], i)
        self.tokens: list[str] = []
        self.types: list[int] = []
        for i in range(max(merged, default=-1) + 1):
            tok = merged.get(i)
            if tok is None:
                raise TokenizerError(f"{self.source}: id {i} has no token (ids must run 0..{max(merged)})")
            self.raw_ids.setdefault(tok, i)
            if (i in added and added[i][1]) or tok in specials or (i in added and looks_special(tok)):
                self.types.append(TokenType.CONTROL)
            elif i in added:
                tok = tok.replace(PHANTOM, " ")  # the converter pre-normalizes user-defined spaces
                self.types.append(TokenType.USER_DEFINED)
            else:
                self.types.append(TokenType.NORMAL)
            if wordpiece and self.types[-1] != TokenType.CONTROL:  # phantom-space form
                tok = tok[len(CONTINUATION) :] if tok.startswith(CONTINUATION) else PHANTOM + tok
            self.tokens.append(tok)
        check_tokens(self.source, self.tokens, config)

    def special_kvs(self, doc: Json | None, tc: Json, config: Config) -> list[KV]:
        return special_kvs(self.names, self.raw_ids, len(self.tokens), doc, tc, config)


def normalizer_options(doc: Json | None, tc: Json) -> tuple[bool, bool]:
    """(lowercase, strip_accents) of the BERT normalizer; HF's rule: strip_accents None follows lowercase."""
    if doc is None or "normalizer" not in doc:
        lower, strip = bool(tc.get("do_lower_case", True)), tc.get("strip_accents")
        return lower, lower if strip is None else bool(strip)
    norm = doc["normalizer"] or {}
    lower, strip = False, False
    for part in norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]:
        kind = part.get("type")
        if kind == "BertNormalizer":
            lower = bool(part.get("lowercase", True))
            s = part.get("strip_accents")
            strip = lower if s is None else bool(s)
        elif kind == "Lowercase":
            lower = True
        elif kind == "StripAccents":
            strip = True
    return lower, strip


def component_types(node: object) -> set[str]:
    """The ``type`` names of a pre-tokenizer or decoder, through Sequence nesting."""
    if not isinstance(node, dict):
        return set()
    out = {str(node.get("type"))}  # pyright: ignore[reportUnknownMemberType]
    for key in ("pretokenizers", "decoders"):
        for child in node.get(key) or []:  # pyright: ignore[reportUnknownMemberType]
            out |= component_types(child)
    return out


def merges(model: Json) -> list[str]:
    """``"a b"`` merges; the list-of-pairs form has its spaces written as U+0120 (gguf-py's rule)."""
    raw = model.get("merges") or []
    if not raw:
        raise TokenizerError("tokenizer.json: the BPE model has no merges (llama.cpp needs at least one)")
    out: list[str] = []
    for m in raw:
        if isinstance(m, str) and len(m.split(" ")) == 2 and all(m.split(" ")):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and p for p in m):
            out.append(" ".join(p.replace(" ", "\u0120") for p in m))
        else:
            raise TokenizerError(f"tokenizer.json: malformed merge {m!r} (expected 'a b' or ['a', 'b'])")
    return out


def pre_tokenizer_name(doc: Json) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for the two pre-tokenizers recognised by structure, else "default".

    GPT-2's plain ByteLevel regex is llama.cpp's ``gpt-2``; the Llama 3 Split regex + ByteLevel with
    ``ignore_merges`` is ``llama-bpe``. Anything else gets llama.cpp's generic ``default``.
    """
    pre, model = doc.get("pre_tokenizer") or {}, doc["model"]
    if doc.get("normalizer"):
        return "default"
    if pre.get("type") == "ByteLevel":
        plain = not pre.get("add_prefix_space", True) and pre.get("use_regex", True)
        return "gpt-2" if plain and not model.get("ignore_merges") else "default"
    if pre.get("type") == "Sequence" and model.get("ignore_merges") and pre.get("pretokenizers") == LLAMA3_PRE:
        return "llama-bpe"
    return "default"
