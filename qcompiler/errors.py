"""Typed errors. Every user-facing failure is one of these; none leaks a raw traceback.

Each error renders as one message that says where (file, line/column, tensor, op, field) and, where
it applies, what was expected and what was found. The CLI prints ``str(error)`` and exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass


class QcError(Exception):
    """Base class of every error qcompiler raises on purpose."""


@dataclass(frozen=True)
class SourceLocation:
    """A position in a text file: 1-based line and column, plus the text of that line."""

    file: str
    line: int
    column: int
    line_text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class ParseError(QcError):
    """The textual IR (or a pipeline spec) is malformed. Carries the location and shows the line."""

    def __init__(self, message: str, loc: SourceLocation) -> None:
        self.message = message
        self.loc = loc
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.loc}: error: {self.message}"
        if not self.loc.line_text:
            return text
        caret = " " * (self.loc.column - 1) + "^"
        return f"{text}\n{self.loc.line_text}\n{caret}"


class VerifyError(QcError):
    """The IR is well-formed text but breaks a type, op, descriptor or pipeline rule.

    ``where`` names the op (``%y = q.linear``), tensor (``@fc1.weight.codes``) or module; ``field``
    names the part that is wrong; ``expected``/``found`` say the rest.
    """

    def __init__(
        self,
        message: str,
        *,
        where: str = "",
        field: str = "",
        expected: str = "",
        found: str = "",
        loc: SourceLocation | None = None,
    ) -> None:
        self.message = message
        self.where = where
        self.field = field
        self.expected = expected
        self.found = found
        self.loc = loc
        super().__init__(self.render())

    def render(self) -> str:
        parts: list[str] = []
        if self.loc is not None:
            parts.append(f"{self.loc}: ")
        parts.append("error: ")
        if self.where:
            parts.append(f"{self.where}: ")
        if self.field:
            parts.append(f"{self.field}: ")
        parts.append(self.message)
        if self.expected or self.found:
            parts.append(f" (expected {self.expected}, found {self.found})")
        return "".join(parts)


class PipelineError(QcError):
    """A pipeline spec is invalid or its order breaks a pass's requirements; raised before any pass runs."""


class PassError(QcError):
    """A pass failed while running. Names the pass and the passes that ran before it."""


class PassNotImplementedError(PipelineError):
    """A registered pass has no implementation yet; it refuses to run rather than pass IR through."""


class BlobError(QcError):
    """A tensor's bytes are missing, unreadable, of the wrong length, or fail their sha256."""


class UsageError(QcError):
    """The command line was used wrongly (bad flag combination, missing file)."""


class FileError(QcError):
    """Bytes in a file break a rule. ``str(e)`` reads
    ``FILE: tensor 'T': FIELD: message (expected E, found F)``; empty parts are left out."""

    def __init__(
        self, message: str, *, file: str, tensor: str = "", field: str = "", expected: object = "", found: object = ""
    ) -> None:
        self.message, self.file, self.tensor, self.field = message, file, tensor, field
        self.expected, self.found = expected, found
        text = f"{file}: "
        if tensor:
            text += f"tensor '{tensor}': "
        if field:
            text += f"{field}: "
        text += message
        if expected != "" and found != "":
            text += f" (expected {expected}, found {found})"
        elif found != "":
            text += f" (found {found})"
        elif expected != "":
            text += f" (expected {expected})"
        super().__init__(text)
