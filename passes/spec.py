"""Pipeline spec strings: ``freeze-semantics,place-shards{tp=2,max-shard-size=2GB},emit-container{target=gguf}``.

``parse_pipeline(text)`` gives pass instances; ``format_pipeline(passes)`` prints them back. Option
values are converted to the field's type (int, float, bool, str, or a tuple of ints written
``[1,2]``). The canonical text leaves out options equal to their defaults, so
``format_pipeline(parse_pipeline(s)) == s`` for canonical ``s``.
"""

from __future__ import annotations

import difflib
from typing import Any

from qcompiler.errors import PipelineError
from qcompiler.passes import get_pass_class, pass_names
from qcompiler.passes.base import Pass

_CLOSERS = {"}": "{", "]": "["}


def split_top_level(text: str) -> list[tuple[int, str]]:
    """Split at commas outside ``{}`` and ``[]``; each piece with its column (1-based)."""
    pieces: list[tuple[int, str]] = []
    open_at: list[int] = []
    start = 0
    for i, c in enumerate(text):
        if c in "{[":
            open_at.append(i)
        elif c in _CLOSERS:
            if not open_at or text[open_at[-1]] != _CLOSERS[c]:
                raise PipelineError(f"pipeline spec column {i + 1}: '{c}' does not close anything in {text!r}")
            open_at.pop()
        elif c == "," and not open_at:
            pieces.append((start + 1, text[start:i]))
            start = i + 1
    if open_at:
        col = open_at[-1]
        raise PipelineError(f"pipeline spec column {col + 1}: '{text[col]}' is never closed in {text!r}")
    pieces.append((start + 1, text[start:]))
    return pieces


def parse_pipeline(text: str) -> list[Pass]:
    """Parse a spec into pass instances. An empty spec is an empty pipeline."""
    if not text.strip():
        return []
    return [parse_pass(piece.strip(), col) for col, piece in split_top_level(text)]


def parse_pass(text: str, col: int) -> Pass:
    name, brace, rest = text.partition("{")
    name = name.strip()
    if not name:
        raise PipelineError(f"pipeline spec column {col}: empty pass name")
    cls = get_pass_class(name)
    if cls is None:
        close = difflib.get_close_matches(name, pass_names(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(pass_names())})"
        raise PipelineError(f"pipeline spec column {col}: unknown pass '{name}'{hint}")
    kwargs: dict[str, Any] = {}
    if brace:
        if not rest.endswith("}"):
            raise PipelineError(f"pipeline spec column {col}: options of '{name}' must end with '}}'")
        kwargs = parse_options(cls, rest[:-1], col)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"pipeline spec column {col}: bad options for '{name}': {e}") from None


def parse_options(cls: type[Pass], body: str, col: int) -> dict[str, Any]:
    fields = cls.option_fields()
    out: dict[str, Any] = {}
    for _, item in split_top_level(body) if body.strip() else []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise PipelineError(f"pipeline spec column {col}: option '{key}' of '{cls.name}' needs '=value'")
        f = fields.get(key)
        if f is None:
            known = ", ".join(fields) or "none"
            raise PipelineError(
                f"pipeline spec column {col}: pass '{cls.name}' has no option '{key}' (options: {known})"
            )
        out[f.name] = convert(cls.name, key, raw.strip(), f.default, col)
    return out


_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    tuple: "a list of integers [1,2]",
}


def convert(pass_name: str, key: str, raw: str, default: object, col: int) -> object:
    """Convert ``raw`` to the type of the option's default value."""
    try:
        if isinstance(default, bool):
            if raw not in ("true", "false"):
                raise ValueError(raw)
            return raw == "true"
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, tuple):
            inner = raw.removeprefix("[").removesuffix("]")
            return tuple(int(x) for x in inner.split(",") if x.strip())
    except ValueError:
        want = _KINDS[type(default)]
        raise PipelineError(
            f"pipeline spec column {col}: option '{key}' of '{pass_name}' must be {want}, found {raw!r}"
        ) from None
    return raw


def format_pipeline(passes: list[Pass]) -> str:
    return ",".join(p.spec() for p in passes)
