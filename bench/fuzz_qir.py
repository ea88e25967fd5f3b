"""``graph.qir`` mutators of ``bench/fuzz.py``: a token (number, dtype, ``%value``/``@symbol`` name,
string: a sha256 digit, a blob location's file or tensor), a whole line (deleted, duplicated, swapped,
truncated after), deep bracket nesting, or a stray character. ``where`` names the line's kind (op,
tensor decl) and the attribute the token sits in."""

from __future__ import annotations

import random
import re

from fuzz_mutators import WEIRD_STRINGS, Ctx, Mutation, clip, write_text

QIR_TOKEN = re.compile(
    r'"(?:[^"\\\n]|\\.)*"|->|-?\d+\.\d*(?:[eE][+-]?\d+)?|-?\d+(?:[eE][+-]?\d+)?|%[\w.]+|@[\w./-]+|\?\w*|[A-Za-z_][\w.]*|\S'
)
PAST = {"delete": "deleted", "duplicate": "duplicated", "swap": "swapped", "truncate": "truncated after"}
QIR_DTYPES = ["f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "i4", "u4", "i2", "bool", "f8e4m3", "q9"]
QIR_NUMBERS = [
    "0", "1", "-1", "2", "3", "7", "8", "-8", "15", "16", "31", "32", "33", "63", "65", "127", "128", "4096",
    "2147483648", "9223372036854775807", "9223372036854775808", "18446744073709551616", "1e308", "1e999",
    "nan", "inf", "-inf", "-0.0", "0.5", "1.0", "1" + "0" * 5000, "0x10", "1_000",
]  # fmt: skip


def line_kind(line: str) -> str:
    s = line.strip()
    for prefix, kind in (("tensor ", "tensor decl"), ("module ", "module header"), ("graph ", "graph header")):
        if s.startswith(prefix):
            return kind
    if s.startswith("return"):
        return "return"
    if s.startswith("%"):
        op = re.match(r"%[\w.]+\s*=\s*([\w.]+)", s)
        return f"op {op.group(1)}" if op else "op"
    return "other"


def token_context(line: str, start: int) -> str:
    """What a token at ``start`` is part of: the attribute key before it, a type, or a shape."""
    before = line[:start]
    if re.search(r"(?:[a-z]\d+|bf16|bool)\[[^\]]*$", before):
        return "shape"
    key = re.findall(r"([A-Za-z_][\w.]*)\s*[=:]\s*[^=:]*$", before)
    return f"attr {key[-1]}" if key else "token"


def qir_mutator(ctx: Ctx) -> Mutation:
    """One edit of ``graph.qir``: a token (number, dtype, name, string), a line, or deep nesting."""
    path = ctx.root / "graph.qir"
    text = path.read_text()
    lines = text.split("\n")
    rng = ctx.rng
    op = rng.choice(["number", "number", "dtype", "name", "string", "string", "token", "line", "nest", "char"])
    if op == "line":
        i = rng.randrange(len(lines))
        kind = rng.choice(["delete", "duplicate", "swap", "truncate"])
        where = f"{kind} line: {line_kind(lines[i])}"
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = min(len(lines) - 1, i + rng.choice([1, 2, 5]))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            lines = lines[:i]
        write_text(path, "\n".join(lines))
        shown = clip(lines[i] if i < len(lines) else "")
        return Mutation("qir", "graph.qir", where, f"line {i + 1} {PAST[kind]}: {shown}")
    pick = {"number": r"-?\d", "name": r"[%@]", "string": r'"', "nest": r"[\[{(]"}.get(op, r".")
    candidates = [
        (i, m)
        for i, line in enumerate(lines)
        for m in QIR_TOKEN.finditer(line)
        if re.match(pick, m.group()) and (op != "dtype" or line[m.end() : m.end() + 1] == "[")
    ]
    i, m = rng.choice(candidates)
    line, tok = lines[i], m.group()
    where = f"{line_kind(line)}: {op} in {token_context(line, m.start())}"
    new = qir_replacement(op, tok, text, rng)
    lines[i] = line[: m.start()] + new + line[m.end() :]
    write_text(path, "\n".join(lines))
    return Mutation("qir", "graph.qir", where, f"line {i + 1}: {clip(tok, 40)!r} -> {clip(new, 50)!r}")


def qir_replacement(op: str, tok: str, text: str, rng: random.Random) -> str:
    if op == "number":
        return rng.choice(QIR_NUMBERS)
    if op == "dtype":
        return rng.choice(QIR_DTYPES)
    if op == "name":
        same = re.findall(re.escape(tok[0]) + r"[\w./-]+", text)
        return rng.choice([rng.choice(same), tok + "x", tok[0], tok[0] + "undefined", tok + "." + tok[1:]])
    if op == "string":
        return rng.choice([string_edit(tok, rng, text)] * 3 + ['""', '"' + rng.choice(WEIRD_STRINGS[:12]) + '"'])
    if op == "nest":
        n = rng.choice([64, 1000, 100_000])
        return tok + "[" * n + "]" * n if rng.random() < 0.5 else tok * n
    if op == "char":
        return rng.choice(["", tok + tok, "\x00", "\u00a0", "\\", '"', "//", "\n", tok + "\r"])
    return rng.choice(["", tok + " " + tok, "?", "->", "<", "{"])


def string_edit(tok: str, rng: random.Random, text: str) -> str:
    """Edit a string literal where it matters: a sha256 digit, a blob location's file or tensor."""
    body = tok[1:-1]
    if body.startswith("sha256:") and len(body) > 10:
        k = rng.randrange(7, len(body))
        digit = rng.choice([c for c in "0123456789abcdefA" if c != body[k]])
        others = re.findall(r'"sha256:[0-9a-f]{64}"', text)
        return rng.choice(['"' + body[:k] + digit + body[k + 1 :] + '"', rng.choice(others), '"' + body[:-1] + '"'])
    if ":" in body and "#" in body:
        scheme, _, rest = body.partition(":")
        file, _, tensor = rest.partition("#")
        others = re.findall(r'"[a-z-]+:[^"#]+#[^"]+"', text)
        other_file = rng.choice(["../outside/x", "/etc/passwd", "manifest.json", "graph.qir", file + "x"])
        other_scheme = rng.choice(["file", "gguf", "safetensors", "onnx", "http"])
        part = rng.choice(["codes", "scale", "values", "zero", "bogus"])
        return rng.choice(
            [
                rng.choice(others),
                f'"{scheme}:{other_file}#{tensor}"',
                f'"{scheme}:{file}#{tensor}x"',
                f'"{other_scheme}:{file}#{tensor}"',
                f'"{scheme}:{file}#{tensor.replace("!qk=", "!qk=1")}"',
                f'"{scheme}:{file}#{tensor.partition("@")[0]}@{part}"',
            ]
        )
    return '"' + interesting_text(body, rng) + '"'


def interesting_text(body: str, rng: random.Random) -> str:
    return rng.choice([body + "x", body.upper(), body[:-1], "", body * 2, "\\u0000", "\\ud800", body + "\\n"])
