"""What every tokenizer conversion for GGUF shares, as llama.cpp's converter and gguf-py's
``SpecialVocab`` do it: the source's JSON files read strictly, added tokens, the named special tokens
and their ids, the ``add_*`` flags from tokenizer.json's post-processor, the chat template, and the
checks llama.cpp's loader needs (count = config.json's ``vocab_size``, no duplicate tokens).

Used by ``tokenizer.py`` (WordPiece, byte-level BPE) and ``tokenizer_spm.py`` (SentencePiece).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import Any, TypeGuard

from qcompiler.backends.gguf.writer import KV
from qcompiler.errors import QcError

PHANTOM = "\u2581"
"""llama.cpp's word-start marker in a WordPiece vocab (and SentencePiece's space)."""
SPECIAL_ID_KEYS: dict[str, str] = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}
Files = Mapping[str, bytes]
Json = dict[str, Any]
Config = Mapping[str, Any]


class TokenType(IntEnum):
    """llama.cpp's token types (``tokenizer.ggml.token_type``), the same numbers as SentencePiece's piece types."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenizerError(QcError):
    """The tokenizer files cannot become llama.cpp metadata; the message names the file and the fault."""


def load_json(files: Files, name: str) -> Json | None:
    raw = files.get(name)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{name}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{name}: expected a JSON object, found {type(doc).__name__}")
    return doc


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def token_text(entry: object) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(entry, dict):
        entry = entry.get("content")  # pyright: ignore[reportUnknownMemberType]
    return entry if isinstance(entry, str) else None


def added_tokens(doc: Json | None, tc: Json) -> dict[int, tuple[str, bool]]:
    """Added tokens, id -> (content, special): tokenizer.json's, else tokenizer_config.json's."""
    out: dict[int, tuple[str, bool]] = {}
    if doc is not None:
        for entry in doc.get("added_tokens") or []:
            i, content = entry.get("id"), entry.get("content")
            if not is_int(i) or i < 0 or not isinstance(content, str):
                raise TokenizerError(f"tokenizer.json: malformed added token {entry!r}")
            out[i] = (content, bool(entry.get("special", False)))
        return out
    for key, entry in (tc.get("added_tokens_decoder") or {}).items():
        content = token_text(entry)
        if not key.isdigit() or content is None:
            raise TokenizerError(f"tokenizer_config.json: malformed added_tokens_decoder entry {key!r}")
        out[int(key)] = (content, bool(entry.get("special", False)))
    return out


def special_names(files: Files, tc: Json) -> dict[str, str]:
    """Named special tokens (bos, eos, ...) from tokenizer_config.json, then special_tokens_map.json."""
    stm = load_json(files, "special_tokens_map.json") or {}
    names: dict[str, str] = {}
    for typ in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        text = token_text(tc.get(f"{typ}_token")) or token_text(stm.get(f"{typ}_token"))
        if text:
            names[typ] = text
    names.setdefault("bos", names.get("cls", ""))
    names.setdefault("eos", names.get("sep", ""))
    return {k: v for k, v in names.items() if v}


def looks_special(tok: str) -> bool:
    """The converter's ``does_token_look_special``: added tokens some models forget to mark special."""
    return (
        tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (tok.startswith("<|") and tok.endswith("|>"))
        or (tok.startswith("<\uff5c") and tok.endswith("\uff5c>"))
        or (tok.startswith("<unused") and tok.endswith(">"))
    )


def add_flags(doc: Json | None, names: dict[str, str]) -> dict[str, bool]:
    """add_bos/add_eos/add_sep from tokenizer.json's post-processor, read as ``SpecialVocab`` reads it.

    A template's leading/trailing special token names BOS/EOS when nothing else does; a trailing one
    other than the named EOS becomes the EOS and the old EOS the EOT (``names`` is updated).
    """
    post = (doc or {}).get("post_processor") or {}
    flags: dict[str, bool] = {}
    for proc in post.get("processors", [post]):
        if proc.get("type") == "RobertaProcessing":
            flags.update(bos=True, eos=True, sep=True)
        if proc.get("type") != "TemplateProcessing":
            continue
        single, pair = proc.get("single") or [], proc.get("pair") or []
        first = last = None
        if len(single) > 1:
            if first := single[0].get("SpecialToken", {}).get("id"):
                names.setdefault("bos", first)
                flags["bos"] = first in (names["bos"], names.get("cls"))
            if last := single[-1].get("SpecialToken", {}).get("id"):
                if names.setdefault("eos", last) != last:
                    names["eot"], names["eos"] = names["eos"], last
                flags["eos"] = True
        start = 1 if first and pair and pair[0].get("SpecialToken", {}).get("id") == first else 0
        stop = -1 if last and pair and pair[-1].get("SpecialToken", {}).get("id") == last else None
        pair = pair[start:stop]
        if not pair or pair[0].get("Sequence", {}).get("id") != "A" or pair[-1].get("Sequence", {}).get("id") != "B":
            continue
        if middle := [p.get("SpecialToken", {}).get("id") for p in pair[1:-1]]:
            seps = (names.get("sep"), names.get("eos"))
            flags["sep"] = (middle[0] in seps and not last) or (len(middle) == 2 and middle[1] in seps)
    return flags


def chat_template(files: Files, tc: Json) -> str | None:
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        return template
    return text(files, "chat_template.jinja") if "chat_template.jinja" in files else None


def text(files: Files, name: str) -> str:
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{name}: not UTF-8: {e}") from None


def check_tokens(source: str, tokens: Sequence[str], config: Config) -> None:
    """Count against config.json's vocab_size, and the duplicates llama.cpp refuses to load."""
    n, want = len(tokens), config.get("vocab_size")
    if is_int(want) and n != want:
        extra = f" (token {tokens[want]!r} has id {want}, out of range)" if n > want else ""
        raise TokenizerError(f"{source}: token count != config.json vocab_size: expected {want}, found {n}{extra}")
    seen: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        key = tok or f"[EMPTY_{i}]"  # llama.cpp renames an empty token
        if key in seen:
            raise TokenizerError(f"{source}: duplicate token {tok!r} at ids {seen[key]} and {i} (after conversion)")
        seen[key] = i


def special_kvs(
    names: dict[str, str], raw_ids: Mapping[str, int], n_tokens: int, doc: Json | None, tc: Json, config: Config
) -> list[KV]:
    """Special ids (named tokens first, then config.json's ``<typ>_token_id``) and add_* flags.

    ``names``: typ -> token text (updated by the post-processor's reading); ``raw_ids``: text -> id.
    """
    flags = add_flags(doc, names)
    ids: dict[str, int] = {}
    for typ in SPECIAL_ID_KEYS:
        name = names.get(typ)
        if name is not None and name in raw_ids:
            ids[typ] = raw_ids[name]
            continue
        tid = config.get(f"{typ}_token_id")
        if is_int(tid):
            if not 0 <= tid < n_tokens:
                raise TokenizerError(f"config.json: {typ}_token_id {tid} is out of range for {n_tokens} tokens")
            ids[typ] = tid
    kvs = [KV.u32(key, ids[typ]) for typ, key in SPECIAL_ID_KEYS.items() if typ in ids]
    for typ in ("bos", "eos", "sep"):
        entry = tc.get(f"add_{typ}_token")
        if isinstance(entry, bool):
            flags[typ] = entry
    kvs += [KV.boolean(f"tokenizer.ggml.add_{typ}_token", v) for typ, v in flags.items()]
    return kvs
