"""Tokenizer for the textual IR.

Whole lines that are blank or start with ``//`` are *trivia*: kept aside with their line numbers so
the parser can attach them to the next statement (and the printer can reproduce them). A ``//``
after code on the same line ends that line's tokens and is not kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from qcompiler.errors import ParseError, SourceLocation


class Tok(Enum):
    IDENT = "identifier"
    VALUE = "%value"
    SYMBOL = "@symbol"
    DYN = "?dim"
    INT = "integer"
    FLOAT = "float"
    STRING = "string"
    PUNCT = "punctuation"
    ARROW = "'->'"
    EOF = "end of input"


@dataclass(frozen=True)
class Token:
    kind: Tok
    text: str
    line: int
    col: int

    def show(self) -> str:
        return "end of input" if self.kind is Tok.EOF else f"'{self.text}'"


_SPEC: list[tuple[Tok | None, str]] = [
    (None, r"[ \t\r]+"),
    (None, r"//[^\n]*"),
    (Tok.STRING, r'"(?:[^"\\\n]|\\.)*"'),
    (Tok.ARROW, r"->"),
    (Tok.FLOAT, r"-?(?:\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|inf\b|nan\b)"),
    (Tok.INT, r"-?\d+"),
    (Tok.VALUE, r"%[A-Za-z0-9_][A-Za-z0-9_.]*"),
    (Tok.SYMBOL, r'@(?:"(?:[^"\\\n]|\\.)*"|[A-Za-z0-9_][A-Za-z0-9_./\-]*)'),
    (Tok.DYN, r"\?[A-Za-z0-9_]*"),
    (Tok.IDENT, r"[A-Za-z_][A-Za-z0-9_.]*(?:-[A-Za-z][A-Za-z0-9_.]*)*"),
    (Tok.PUNCT, r"[()\[\]{}<>,:=!]"),
]
_MASTER = re.compile("|".join(f"(?P<g{i}>{pat})" for i, (_, pat) in enumerate(_SPEC)))


def unescape(s: str) -> str:
    """The value of a string token (without quotes)."""
    out: list[str] = []
    i = 1
    while i < len(s) - 1:
        c = s[i]
        if c == "\\":
            nxt = s[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def is_trivia(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("//")


def tokenize(text: str, file: str, first_line: int = 1) -> tuple[list[Token], list[tuple[int, str]]]:
    """Tokens of the non-trivia lines, and ``(line number, text)`` of every trivia line."""
    tokens: list[Token] = []
    trivia: list[tuple[int, str]] = []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    for offset, line in enumerate(lines):
        lineno = first_line + offset
        if is_trivia(line):
            trivia.append((lineno, line))
            continue
        pos = 0
        while pos < len(line):
            m = _MASTER.match(line, pos)
            if m is None:
                loc = SourceLocation(file, lineno, pos + 1, line)
                what = "unterminated string" if line[pos] == '"' else f"unexpected character '{line[pos]}'"
                raise ParseError(what, loc)
            kind = _SPEC[int((m.lastgroup or "g0")[1:])][0]
            if kind is not None:
                tokens.append(Token(kind, m.group(), lineno, pos + 1))
            pos = m.end()
    # end of input is placed just after the last line of code, so errors there show that line
    end_line, end_col = first_line, 1
    for offset in range(len(lines) - 1, -1, -1):
        if not is_trivia(lines[offset]):
            end_line, end_col = first_line + offset, len(lines[offset].rstrip()) + 1
            break
    tokens.append(Token(Tok.EOF, "", end_line, end_col))
    return tokens, trivia
