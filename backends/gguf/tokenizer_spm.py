"""SentencePiece vocabularies (``tokenizer.model``) as llama.cpp's ``llama`` (SPM) tokenizer, the way
``convert_hf_to_gguf.py`` writes them (``_create_vocab_sentencepiece``, ``_set_vocab_sentencepiece``,
Gemma's and Phi-3's ``set_vocab``; gguf-py's ``SpecialVocab``), read with our own bounded protobuf
reader: no ``sentencepiece`` package, no transformers, no network.

    tokenizer.model piece i (text, score, type)  ->  tokens[i], scores[i], token_type[i]
    added token (added_tokens.json, tokenizer_config.json's added_tokens_decoder, else
    tokenizer.json's added_tokens)                ->  its text, score -1000, control or user-defined
    an id below config.json's vocab_size no piece or added token names  ->  "[PAD<id>]", -10000, unused

Piece types keep SentencePiece's numbers, which are llama.cpp's (normal 1, unknown 2, control 3,
user-defined 4, unused 5, byte 6). An added token is control when marked special or special-looking,
else user-defined with U+2581 written as a space (the converter's pre-normalization). Gemma's archs
get ``add_space_prefix`` false, as their ``set_vocab`` writes; so does a model whose normalizer says
``add_dummy_prefix: false``. Refused, naming the file and field: a malformed or truncated protobuf,
a piece that is not UTF-8, a score that is not finite, an unknown piece type, an added token at or
past config.json's ``vocab_size`` (the converter drops it), duplicate tokens.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass

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
)
from qcompiler.backends.gguf.writer import KV, GGUFValueType

SOURCE = "tokenizer.model"
MAX_PIECES = 1 << 22
"""Pieces a ``tokenizer.model`` may hold (Gemma 3's has 262144)."""
ADDED_SCORE = -1000.0
PAD_SCORE = -10000.0
NO_SPACE_PREFIX_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
"""Architectures whose ``set_vocab`` writes ``tokenizer.ggml.add_space_prefix`` false."""
MODEL_PIECES, MODEL_NORMALIZER = 1, 3
"""ModelProto's fields this reader uses (``pieces``, ``normalizer_spec``)."""
PIECE_TEXT, PIECE_SCORE, PIECE_TYPE = 1, 2, 3
NORMALIZER_ADD_DUMMY_PREFIX = 3
VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Piece:
    text: str
    score: float
    type: TokenType


@dataclass(frozen=True)
class SpModel:
    pieces: list[Piece]
    add_dummy_prefix: bool


def varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(buf):
            raise TokenizerError(f"{SOURCE}: {where}: truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise TokenizerError(f"{SOURCE}: {where}: varint longer than 10 bytes")


def fields(buf: bytes, where: str) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one protobuf message: an int, or bytes for a length-delimited one."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos, where)
        num, wire = key >> 3, key & 7
        value: int | bytes
        if num == 0:
            raise TokenizerError(f"{SOURCE}: {where}: field number 0 at byte {pos}")
        if wire == VARINT:
            value, pos = varint(buf, pos, where)
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
            if pos + size > len(buf):
                raise TokenizerError(f"{SOURCE}: {where}: field {num} truncated: needs {size} bytes")
            value, pos = int.from_bytes(buf[pos : pos + size], "little"), pos + size
        elif wire == BYTES:
            size, pos = varint(buf, pos, where)
            if size > len(buf) - pos:
                raise TokenizerError(
                    f"{SOURCE}: {where}: field {num} truncated: {size} bytes declared, {len(buf) - pos} left"
                )
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise TokenizerError(f"{SOURCE}: {where}: field {num} has wire type {wire} (expected 0, 1, 2 or 5)")
        yield num, wire, value


def expect(wire: int, want: int, where: str, value: int | bytes) -> None:
    if wire != want or isinstance(value, bytes) != (want == BYTES):
        raise TokenizerError(f"{SOURCE}: {where}: wire type {wire}, expected {want}")


def read_piece(buf: bytes, index: int) -> Piece:
    where = f"pieces[{index}]"
    text: str | None = None
    score, kind = 0.0, int(TokenType.NORMAL)  # proto2 defaults
    for num, wire, value in fields(buf, where):
        if num == PIECE_TEXT:
            expect(wire, BYTES, f"{where}.piece", value)
            assert isinstance(value, bytes)
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{SOURCE}: {where}.piece: not UTF-8: {e}") from None
        elif num == PIECE_SCORE:
            expect(wire, FIXED32, f"{where}.score", value)
            assert isinstance(value, int)
            score = struct.unpack("<f", value.to_bytes(4, "little"))[0]
            if not math.isfinite(score):
                raise TokenizerError(f"{SOURCE}: {where}.score: expected a finite float, found {score}")
        elif num == PIECE_TYPE:
            expect(wire, VARINT, f"{where}.type", value)
            assert isinstance(value, int)
            kind = value
    if text is None:
        raise TokenizerError(f"{SOURCE}: {where}.piece: missing")
    if kind not in TokenType._value2member_map_:
        raise TokenizerError(f"{SOURCE}: {where}.type: expected 1..6 (NORMAL..BYTE), found {kind}")
    return Piece(text, score, TokenType(kind))


def read_model(raw: bytes) -> SpModel:
    """A SentencePiece ModelProto's pieces and ``normalizer_spec.add_dummy_prefix``."""
    pieces: list[Piece] = []
    add_dummy_prefix = True
    for num, wire, value in fields(raw, "ModelProto"):
        if num == MODEL_PIECES:
            expect(wire, BYTES, f"pieces[{len(pieces)}]", value)
            assert isinstance(value, bytes)
            if len(pieces) >= MAX_PIECES:
                raise TokenizerError(f"{SOURCE}: pieces: more than {MAX_PIECES}")
            pieces.append(read_piece(value, len(pieces)))
        elif num == MODEL_NORMALIZER:
            expect(wire, BYTES, "normalizer_spec", value)
            assert isinstance(value, bytes)
            for n, w, v in fields(value, "normalizer_spec"):
                if n == NORMALIZER_ADD_DUMMY_PREFIX:
                    expect(w, VARINT, "normalizer_spec.add_dummy_prefix", v)
                    add_dummy_prefix = bool(v)
    if not pieces:
        raise TokenizerError(f"{SOURCE}: pieces: none (not a SentencePiece model?)")
    return SpModel(pieces, add_dummy_prefix)


def added_entries(files: Files, tc: Json) -> list[tuple[int, str, TokenType]]:
    """(id, text, type) of each added token, in the converter's order (added_tokens.json first)."""
    out: list[tuple[int, str, TokenType]] = []
    for text, i in (load_json(files, "added_tokens.json") or {}).items():
        if not is_int(i) or i < 0:
            raise TokenizerError(f"added_tokens.json: token {text!r} has id {i!r}, not a non-negative integer")
        out.append((i, text, TokenType.USER_DEFINED))
    decoder = added_tokens(None, tc) or added_tokens(load_json(files, "tokenizer.json"), {})
    for i, (text, special) in sorted(decoder.items()):
        if special or looks_special(text):
            out.append((i, text, TokenType.CONTROL))
        else:
            out.append((i, text.replace(PHANTOM, " "), TokenType.USER_DEFINED))
    return out


def sentencepiece_metadata(files: Files, tc: Json, config: Config, arch: str) -> list[KV]:
    """The ``tokenizer.*`` metadata of a SentencePiece ``tokenizer.model`` (llama.cpp's ``llama`` model)."""
    model = read_model(files[SOURCE])
    want = config.get("vocab_size")
    n = want if is_int(want) and want > 0 else len(model.pieces)
    if len(model.pieces) > n:
        raise TokenizerError(
            f"{SOURCE}: token count > config.json vocab_size: expected {n}, found {len(model.pieces)} pieces"
        )
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores, types = [PAD_SCORE] * n, [TokenType.UNUSED] * n
    for i, p in enumerate(model.pieces):
        tokens[i], scores[i], types[i] = p.text, p.score, p.type
    try:
        added = added_entries(files, tc)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field of an unexpected shape
        raise TokenizerError(f"added tokens: malformed: {type(e).__name__}: {e}") from None
    raw_ids: dict[str, int] = {}
    for i, text, kind in added:
        if i >= n:
            raise TokenizerError(f"added token {text!r}: id {i} is out of range for config.json vocab_size {n}")
        tokens[i], scores[i], types[i] = text, ADDED_SCORE, kind
        raw_ids.setdefault(text, i)
    check_tokens(SOURCE, tokens, config)
    for i, tok in enumerate(tokens):
        raw_ids.setdefault(tok, i)
    kvs = [
        KV.string("tokenizer.ggml.model", "llama"),
        KV.string("tokenizer.ggml.pre", "default"),
        KV.array("tokenizer.ggml.tokens", GGUFValueType.STRING, tokens),
        KV.array("tokenizer.ggml.scores", GGUFValueType.FLOAT32, scores),
        KV.array("tokenizer.ggml.token_type", GGUFValueType.INT32, [int(t) for t in types]),
    ]
    doc = load_json(files, "tokenizer.json")
    try:
        kvs += special_kvs(special_names(files, tc), raw_ids, n, doc, tc, config)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"tokenizer.json: malformed: {type(e).__name__}: {e}") from None
    if arch in NO_SPACE_PREFIX_ARCHS or not model.add_dummy_prefix:
        kvs.append(KV.boolean("tokenizer.ggml.add_space_prefix", False))
    if template := chat_template(files, tc):
        kvs.append(KV.string("tokenizer.chat_template", template))
    return kvs
