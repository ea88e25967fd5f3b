"""Token cursor plus the grammar of types and attribute values (the module grammar builds on it).

Grammar (see docs/ir.md for the full reference)::

    type       := 'tensor' '<' dense '>' | '!q.' FAMILY '<' qbody '>'
    dense      := DTYPE '[' (dim (',' dim)*)? ']'          dim := INT | '?' | '?name'
    qbody      := CODE alphabet '->' dense (',' KEY '=' field)*
    alphabet   := '[' INT ':' INT ']' | '{' INT (',' INT)* '}'
    attr       := INT | FLOAT | STRING | 'true' | 'false' | @symbol | DTYPE | '[' attrs ']' | '{' k '=' attr, ... '}'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from qcompiler.errors import ParseError, SourceLocation
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.lexer import Tok, Token, unescape
from qcompiler.ir.types import (
    Alphabet,
    CodeContract,
    DenseType,
    Dim,
    GroupSpec,
    PackSpec,
    QuantType,
    RateClaim,
    Slot,
    Type,
)

T = TypeVar("T")


MAX_NESTING = 64
"""Deepest bracket nesting (``{ [ ( <``) the IR parser accepts."""
OPENERS = ("{", "[", "(", "<")
INT64 = (-(2**63), 2**63 - 1)
CLOSERS = ("}", "]", ")", ">")


class Cursor:
    """A position in a token list with ``expect``/``accept`` helpers and located errors."""

    def __init__(self, tokens: list[Token], file: str, lines: dict[int, str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.file = file
        self.lines = lines
        self.check_tokens()

    def check_tokens(self) -> None:
        """Before the recursive descent starts: refuse brackets nested deeper than ``MAX_NESTING`` (so
        no input can exhaust the Python stack; a module nests about 6 deep) and integers outside int64
        (every consumer of an IR integer, torch and the backends, holds it in 64 bits)."""
        depth = 0
        for t in self.tokens:
            if t.kind is Tok.INT and (len(t.text) > 20 or not INT64[0] <= int(t.text) <= INT64[1]):
                raise self.error("integer outside the int64 range", t)
            if t.kind is not Tok.PUNCT:
                continue
            if t.text in OPENERS:
                depth += 1
                if depth > MAX_NESTING:
                    raise self.error(f"brackets nested deeper than {MAX_NESTING} levels", t)
            elif t.text in CLOSERS:
                depth = max(depth - 1, 0)

    @property
    def tok(self) -> Token:
        return self.tokens[self.pos]

    def loc(self, tok: Token | None = None) -> SourceLocation:
        t = tok or self.tok
        return SourceLocation(self.file, t.line, t.col, self.lines.get(t.line, ""))

    def error(self, message: str, tok: Token | None = None) -> ParseError:
        return ParseError(message, self.loc(tok))

    def advance(self) -> Token:
        t = self.tok
        if t.kind is not Tok.EOF:
            self.pos += 1
        return t

    def at(self, text: str) -> bool:
        return self.tok.text == text and self.tok.kind in (Tok.PUNCT, Tok.IDENT, Tok.ARROW)

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.advance()
            return True
        return False

    def expect(self, text: str, what: str = "") -> Token:
        if not self.at(text):
            raise self.error(f"expected '{text}'{what} but found {self.tok.show()}")
        return self.advance()

    def expect_kind(self, kind: Tok, what: str) -> Token:
        if self.tok.kind is not kind:
            raise self.error(f"expected {what} but found {self.tok.show()}")
        return self.advance()

    def int(self, what: str = "an integer") -> int:
        return int(self.expect_kind(Tok.INT, what).text)

    def ident(self, what: str = "an identifier") -> str:
        return self.expect_kind(Tok.IDENT, what).text

    def comma_list(self, close: str, item: Callable[[], T]) -> list[T]:
        """Items separated by ',' up to (and consuming) ``close``."""
        out: list[T] = []
        if self.accept(close):
            return out
        out.append(item())
        while self.accept(","):
            out.append(item())
        self.expect(close)
        return out


class TypeParser(Cursor):
    """Parses types and attribute values."""

    # ----------------------------------------------------------------- types

    def type(self) -> Type:
        if self.accept("tensor"):
            self.expect("<")
            t = self.dense()
            self.expect(">")
            return t
        if self.at("!"):
            return self.quant_type()
        raise self.error(f"expected a type ('tensor<...>' or '!q.<family><...>') but found {self.tok.show()}")

    def dtype_name(self) -> str:
        tok = self.expect_kind(Tok.IDENT, "an element type")
        if tok.text not in DTYPES:
            raise self.error(f"unknown element type '{tok.text}' (known: {', '.join(DTYPES)})", tok)
        return tok.text

    def dense(self) -> DenseType:
        name = self.dtype_name()
        self.expect("[", " after the element type")
        shape = self.comma_list("]", self.dim)
        return DenseType(DTYPES[name], tuple(shape))

    def dim(self) -> Dim:
        if self.tok.kind is Tok.DYN:
            return self.advance().text
        tok = self.expect_kind(Tok.INT, "a dimension (integer or '?name')")
        if int(tok.text) < 0:
            raise self.error(f"negative dimension {tok.text}", tok)
        return int(tok.text)

    def quant_type(self) -> QuantType:
        self.expect("!")
        head = self.expect_kind(Tok.IDENT, "a quantized type name like 'q.affine'")
        if not head.text.startswith("q.") or len(head.text) < 3:
            raise self.error(f"quantized types are spelled '!q.<family>', found '!{head.text}'", head)
        self.expect("<")
        code_tok = self.expect_kind(Tok.IDENT, "a code type like 'i4' or 'u8'")
        code = code_dtype(code_tok.text)
        if code is None:
            raise self.error(f"expected a code type i1..i8 or u1..u8 but found '{code_tok.text}'", code_tok)
        alphabet = self.alphabet()
        self.expect("->", " between the code and the expressed type")
        fields: dict[str, Any] = {"family": head.text[2:], "expressed": self.dense()}
        seen: dict[str, Token] = {}
        while self.accept(","):
            key_tok = self.expect_kind(Tok.IDENT, "a descriptor field name")
            parse = _QFIELDS.get(key_tok.text)
            if parse is None:
                raise self.error(f"unknown descriptor field '{key_tok.text}' (known: {', '.join(_QFIELDS)})", key_tok)
            if key_tok.text in seen:
                raise self.error(f"descriptor field '{key_tok.text}' given twice", key_tok)
            seen[key_tok.text] = key_tok
            self.expect("=")
            fields[key_tok.text] = parse(self)
        self.expect(">", " to close the quantized type")
        unit = fields.pop("unit", "element")
        rev = fields.pop("rev", 1)
        return QuantType(code=CodeContract(code, alphabet, unit, rev), **fields)

    def alphabet(self) -> Alphabet:
        if self.accept("["):
            lo = self.int("the alphabet's lowest code")
            self.expect(":")
            hi = self.int("the alphabet's highest code")
            self.expect("]")
            return Alphabet.range(lo, hi)
        if self.at("{"):
            start = self.advance()
            values = self.comma_list("}", self.int)
            if not values:
                raise self.error("alphabet set is empty", start)
            return Alphabet.of(tuple(values))
        raise self.error(f"expected an alphabet '[lo:hi]' or '{{a,b,...}}' but found {self.tok.show()}")

    def slots(self) -> tuple[Slot, ...]:
        self.expect("{")

        def slot() -> Slot:
            name = self.ident("a slot name")
            self.expect(":")
            return (name, self.quant_type() if self.at("!") else self.dense())

        items = self.comma_list("}", slot)
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise self.error("a slot name is given twice")
        return tuple(items)

    def kw_tuple(self, what: str, spec: dict[str, Callable[[TypeParser], Any]]) -> dict[str, Any]:
        """``(key=value, ...)`` with keys from ``spec``."""
        self.expect("(", f" to open {what}")

        out: dict[str, Any] = {}

        def item() -> None:
            tok = self.expect_kind(Tok.IDENT, f"a {what} field")
            if tok.text not in spec:
                raise self.error(f"unknown {what} field '{tok.text}' (known: {', '.join(spec)})", tok)
            if tok.text in out:
                raise self.error(f"{what} field '{tok.text}' given twice", tok)
            self.expect("=")
            out[tok.text] = spec[tok.text](self)

        self.comma_list(")", item)
        return out

    def group(self) -> GroupSpec:
        start = self.tok
        kw = self.kw_tuple("group", {"axis": TypeParser.int, "size": TypeParser.int, "tail": TypeParser.ident})
        if "axis" not in kw or "size" not in kw:
            raise self.error("group needs axis and size", start)
        return GroupSpec(**kw)

    def pack(self) -> PackSpec:
        kw = self.kw_tuple(
            "pack",
            {
                "family": TypeParser.ident,
                "version": TypeParser.int,
                "encoding": TypeParser.ident,
                "tile": lambda p: tuple(p.int_list()),
            },
        )
        return PackSpec(**kw)

    def rate(self) -> RateClaim:
        start = self.tok
        kw = self.kw_tuple(
            "rate",
            {
                "bits": TypeParser.int,
                "per": TypeParser.int,
                "unit": TypeParser.ident,
                "scope": TypeParser.ident,
                "incl": lambda p: tuple(p.ident_list()),
            },
        )
        if "bits" not in kw or "per" not in kw:
            raise self.error("rate needs bits and per", start)
        return RateClaim(**kw)

    def int_list(self) -> list[int]:
        self.expect("[")
        return self.comma_list("]", self.int)

    def ident_list(self) -> list[str]:
        self.expect("[")
        return self.comma_list("]", self.ident)

    # ----------------------------------------------------------------- attributes

    def attr_dict(self) -> dict[str, AttrValue]:
        self.expect("{")
        out: dict[str, AttrValue] = {}

        def item() -> None:
            tok = self.expect_kind(Tok.IDENT, "an attribute name")
            if tok.text in out:
                raise self.error(f"attribute '{tok.text}' given twice", tok)
            self.expect("=", " after the attribute name")
            out[tok.text] = self.attr()

        self.comma_list("}", item)
        return out

    def attr(self) -> AttrValue:
        tok = self.tok
        if tok.kind is Tok.INT:
            return int(self.advance().text)
        if tok.kind is Tok.FLOAT:
            return float(self.advance().text)
        if tok.kind is Tok.STRING:
            return unescape(self.advance().text)
        if tok.kind is Tok.SYMBOL:
            return SymbolRef(symbol_name(self.advance().text))
        if tok.kind is Tok.IDENT and tok.text in ("true", "false"):
            return self.advance().text == "true"
        if tok.kind is Tok.IDENT and tok.text in DTYPES:
            return DTYPES[self.advance().text]
        if self.accept("["):
            return self.comma_list("]", self.attr)
        if self.at("{"):
            return self.attr_dict()
        raise self.error(f"expected an attribute value but found {tok.show()}")


def symbol_name(text: str) -> str:
    """``@name`` or ``@"quoted name"`` to the bare name."""
    body = text[1:]
    return unescape(body) if body.startswith('"') else body


_QFIELDS: dict[str, Callable[[TypeParser], Any]] = {
    "unit": TypeParser.ident,
    "rev": TypeParser.int,
    "group": TypeParser.group,
    "qparams": TypeParser.slots,
    "exceptions": TypeParser.slots,
    "transforms": TypeParser.slots,
    "perm": TypeParser.dense,
    "decoder": TypeParser.int,
    "pack": TypeParser.pack,
    "req": TypeParser.ident,
    "rate": TypeParser.rate,
}
"""Descriptor fields after the head, in canonical order, with the parser of each value."""
