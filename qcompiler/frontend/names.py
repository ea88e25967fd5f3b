"""Value names of a lowered graph, numbered by the compiler rather than by torch's tracer.

A lowering names a value after the FX node it lowers (``mul_21``, or ``linear_7_w`` for a second
value of that node). FX numbers its nodes per base name in the order the tracer *created* them,
including nodes it dropped again: a 1.1B Llama's export numbers the ``mul`` nodes of layers 0 and 2
with a gap of eight (fake-tensor cache misses traced and discarded) and the other layers without,
so the names said more about the tracer's caches than about the graph. Here each FX node that named
a value is numbered again, per base, in the order its first value appears in the graph: the first
``mul`` node's values are ``mul``, the next ``mul_1``, and so on, whatever the tracer skipped. Two
graphs with the same ops in the same order get the same names however they were made, which lets
``stamp.py`` build a model's layers from a copy of one of them and print what the whole export
prints. Values not named after an FX node (constants named after their parameter, ``c``,
``attn_mask``) keep their names; the printer makes repeats unique.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping

from qcompiler.ir.core import Graph, Value

SUFFIX = re.compile(r"^(?:_[A-Za-z].*)?$")
"""What may follow an FX node's name in a value named after it: nothing, or ``_w``, ``_cast``, ...
(never ``_<digits>``: ``mul_1`` is not a value of node ``mul``)."""
COUNTER = re.compile(r"_\d+$")

Origin = tuple[Hashable, str, str]
"""(the node a value is named after, the node's base name, what follows the node's name)."""


def base_of(node_name: str) -> str:
    """``mul_21`` -> ``mul``; ``embedding`` -> ``embedding``."""
    return COUNTER.sub("", node_name)


def origins(values: Iterable[Value], nodes: Mapping[str, Hashable]) -> dict[Value, Origin]:
    """Each value named after one of ``nodes`` (FX node name -> the node) -> its origin: the longest
    node name the value's name starts with, followed by nothing or a ``_word`` suffix."""
    out: dict[Value, Origin] = {}
    for v in values:
        name = v.name
        for cut in sorted((i for i, ch in enumerate(name) if ch == "_"), reverse=True):
            if name[:cut] in nodes and SUFFIX.match(name[cut:]):
                out[v] = (nodes[name[:cut]], base_of(name[:cut]), name[cut:])
                break
        else:
            if name in nodes:
                out[v] = (nodes[name], base_of(name), "")
    return out


def renumber(graph: Graph, named: Mapping[Value, Origin]) -> None:
    """Rename each value of ``named`` to its node's base and the node's number among the nodes of
    that base, in the order their first values appear in ``graph`` (0: the bare base)."""
    number: dict[Hashable, int] = {}
    count: dict[str, int] = {}
    for v in graph.values():
        origin = named.get(v)
        if origin is None:
            continue
        node, base, suffix = origin
        if node not in number:
            number[node] = count.get(base, 0)
            count[base] = number[node] + 1
        n = number[node]
        v.name = f"{base}_{n}{suffix}" if n else f"{base}{suffix}"
