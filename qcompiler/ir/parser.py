"""The textual IR parser: text -> ``Module``. Errors carry file, line and column and show the line.

Module grammar (types and attributes: ``parse_types``)::

    file   := module
    module := 'module' @name ('attributes' attrs)? '{' (tensor | graph)* '}'
    tensor := 'tensor' @name ':' dense '=' 'blob' '<' "sha256:HEX" ',' "location" '>' attrs?
    graph  := 'graph' @name '(' (%arg ':' type),* ')' '{' op* '}'
    op     := (%r, ... '=')? NAME '(' %operand,* ')' attrs? (':' type, ...)?

``parse_module`` parses one module; ``split_input`` cuts a file at ``// -----`` lines for tests
that hold many cases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qcompiler.errors import ParseError, SourceLocation
from qcompiler.ir.core import BlobRef, Graph, Module, Op, TensorDecl, Value, create_op
from qcompiler.ir.lexer import Tok, Token, tokenize, unescape
from qcompiler.ir.parse_types import TypeParser, symbol_name
from qcompiler.ir.types import DenseType, Type

SPLIT_MARKER = "// -----"
_SHA256 = re.compile(r"^sha256:[0-9a-f]{64}$")


class ModuleParser(TypeParser):
    """Parses one module; attaches trivia (comment and blank lines) to the statement after them."""

    def __init__(self, text: str, file: str, first_line: int = 1) -> None:
        tokens, trivia = tokenize(text, file, first_line)
        lines = dict(enumerate(text.split("\n"), start=first_line))
        super().__init__(tokens, file, lines)
        self.trivia = trivia
        self.trivia_pos = 0
        self.values: dict[str, Value] = {}

    def take_trivia(self, before_line: int) -> list[str]:
        out: list[str] = []
        while self.trivia_pos < len(self.trivia) and self.trivia[self.trivia_pos][0] < before_line:
            out.append(self.trivia[self.trivia_pos][1])
            self.trivia_pos += 1
        return out

    def symbol(self, what: str) -> str:
        return symbol_name(self.expect_kind(Tok.SYMBOL, what).text)

    # ----------------------------------------------------------------- module

    def module(self) -> Module:
        comments = self.take_trivia(self.tok.line)
        start = self.tok
        self.expect("module", " to start the file")
        m = Module(self.symbol("a module name '@name'"), comments=comments, loc=self.loc(start))
        if self.accept("attributes"):
            m.attrs = self.attr_dict()
        self.expect("{", " to open the module body")
        while not self.at("}"):
            if self.tok.kind is Tok.EOF:
                raise self.error(f"module @{m.name} is not closed with '}}' (does a graph miss its closing brace?)")
            if self.at("tensor"):
                self.tensor(m)
            elif self.at("graph"):
                m.graphs.append(self.graph(m))
            else:
                raise self.error(f"expected 'tensor', 'graph' or '}}' in the module body but found {self.tok.show()}")
        m.end_comments = self.take_trivia(self.tok.line)
        self.expect("}")
        if self.tok.kind is not Tok.EOF:
            raise self.error(f"expected end of input after the module but found {self.tok.show()}")
        m.trailer = self.take_trivia(10**12)
        return m

    def tensor(self, m: Module) -> None:
        comments = self.take_trivia(self.tok.line)
        start = self.expect("tensor")
        name_tok = self.tok
        name = self.symbol("a tensor name '@name'")
        if name in m.tensors:
            raise self.error(f"tensor @{name} declared twice", name_tok)
        self.expect(":")
        t = self.dense()
        if not t.is_static:
            raise self.error(f"tensor @{name} must have a static shape, found {t.short()}", name_tok)
        self.expect("=")
        self.expect("blob")
        self.expect("<")
        hash_tok = self.expect_kind(Tok.STRING, 'a content hash "sha256:<64 hex digits>"')
        digest = unescape(hash_tok.text)
        if not _SHA256.match(digest):
            raise self.error(f'expected "sha256:<64 lowercase hex digits>" but found "{digest}"', hash_tok)
        self.expect(",")
        location = unescape(self.expect_kind(Tok.STRING, 'a location string like "mem" or "file:data.bin"').text)
        self.expect(">")
        attrs = self.attr_dict() if self.at("{") else {}
        blob = BlobRef(t.dtype, tuple(int(d) for d in t.shape), digest[len("sha256:") :], location)
        m.tensors[name] = TensorDecl(name, blob, attrs, comments, self.loc(start))

    # ----------------------------------------------------------------- graphs and ops

    def graph(self, m: Module) -> Graph:
        comments = self.take_trivia(self.tok.line)
        start = self.expect("graph")
        g = Graph(self.symbol("a graph name '@name'"), comments=comments, loc=self.loc(start))
        if m.graph(g.name) is not None:
            raise self.error(f"graph @{g.name} defined twice", start)
        self.values = {}
        self.expect("(")
        g.args = self.comma_list(")", self.graph_arg)
        self.expect("{", " to open the graph body")
        while not self.at("}"):
            if self.tok.kind is Tok.EOF or self.at("graph") or self.at("tensor"):
                raise self.error(f"graph @{g.name} is not closed with '}}' before {self.tok.show()}")
            g.ops.append(self.op())
        g.end_comments = self.take_trivia(self.tok.line)
        self.expect("}")
        return g

    def graph_arg(self) -> Value:
        tok = self.expect_kind(Tok.VALUE, "an argument name '%name'")
        self.expect(":")
        v = Value(tok.text[1:], self.type())
        self.define(v, tok)
        return v

    def define(self, v: Value, tok: Token) -> None:
        if v.name in self.values:
            raise self.error(f"value %{v.name} is defined twice", tok)
        self.values[v.name] = v

    def use(self) -> Value:
        tok = self.expect_kind(Tok.VALUE, "an operand '%name'")
        v = self.values.get(tok.text[1:])
        if v is None:
            raise self.error(f"use of undefined value {tok.text}", tok)
        return v

    def op(self) -> Op:
        comments = self.take_trivia(self.tok.line)
        start = self.tok
        result_toks: list[Token] = []
        if self.tok.kind is Tok.VALUE:
            result_toks.append(self.advance())
            while self.accept(","):
                result_toks.append(self.expect_kind(Tok.VALUE, "a result name '%name'"))
            self.expect("=", " after the result names")
        name_tok = self.expect_kind(Tok.IDENT, "an op name")
        if name_tok.text not in Op.registry:
            raise self.error(f"unknown op '{name_tok.text}'", name_tok)
        self.expect("(", " after the op name")
        operands = self.comma_list(")", self.use)
        attrs = self.attr_dict() if self.at("{") else {}
        types: list[Type] = []
        if self.accept(":"):
            types.append(self.type())
            while self.accept(","):
                types.append(self.type())
        if len(types) != len(result_toks):
            raise self.error(
                f"op '{name_tok.text}' names {len(result_toks)} result(s) but gives {len(types)} type(s)", name_tok
            )
        op = create_op(name_tok.text, operands, types, attrs, [t.text[1:] for t in result_toks])
        op.comments = comments
        op.loc = self.loc(start)
        for v, tok in zip(op.results, result_toks, strict=True):
            self.define(v, tok)
        return op


def parse_module(text: str, file: str = "<input>", first_line: int = 1) -> Module:
    """Parse one module. Raises ``ParseError`` (with location) on malformed text."""
    return ModuleParser(text, file, first_line).module()


def parse_type(text: str) -> Type:
    """Parse a single type (``tensor<f32[4]>`` or ``!q.affine<...>``)."""
    p = ModuleParser(text, "<type>")
    t = p.type()
    if p.tok.kind is not Tok.EOF:
        raise p.error(f"unexpected {p.tok.show()} after the type")
    return t


def parse_dense(text: str) -> DenseType:
    t = parse_type(text)
    if not isinstance(t, DenseType):
        raise ParseError("expected a dense tensor type", SourceLocation("<type>", 1, 1, text))
    return t


@dataclass(frozen=True)
class Chunk:
    """One ``// -----``-separated piece of a file, with the line it starts on."""

    text: str
    first_line: int


def split_input(text: str) -> list[Chunk]:
    """Cut ``text`` at lines that are exactly ``// -----``; line numbers stay those of the file."""
    chunks: list[Chunk] = []
    current: list[str] = []
    first = 1
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    for i, line in enumerate(lines, start=1):
        if line.strip() == SPLIT_MARKER:
            chunks.append(Chunk("".join(x + "\n" for x in current), first))
            current, first = [], i + 1
            continue
        current.append(line)
    chunks.append(Chunk("".join(x + "\n" for x in current), first))
    return chunks
