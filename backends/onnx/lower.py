"""QIR graph -> ONNX graph, one table entry per op (opset 21; ``MatMulNBits`` from ``com.microsoft``).

Dynamic dims stay dynamic: a QIR dim ``?seq`` becomes the graph input's ``dim_param`` ``seq``, and an
op whose attributes name it (``reshape {shape = [1, "?seq", 4, 16]}``, ``arange {end = "?seq"}``)
reads it at run time from ``Shape(input, start=j, end=j+1)``. Quantized weights are lowered by the
form's ``WeightForm`` (``weights.py``). An op without an entry fails, naming it.

| QIR | ONNX |
|---|---|
| ``add`` ``sub`` ``mul`` ``div`` ``pow`` | ``Add`` ``Sub`` ``Mul`` ``Div`` ``Pow`` |
| ``maximum`` ``minimum`` | ``Max`` ``Min`` |
| ``neg``, ``exp``, ``sqrt``, ``cos``, ``sin``, ``tanh``, ``erf``, ... | the op of the same meaning |
| ``rsqrt``, ``silu`` | ``Reciprocal(Sqrt)``, ``x * Sigmoid(x)`` |
| ``gelu`` | ``0.5 x (1 + Erf(x / sqrt 2))`` |
| ``reshape``/``expand``/``full`` | ``Reshape``/``Expand``/``ConstantOfShape`` with a shape vector |
| ``slice``, ``concat``, ``transpose``, ``cast`` | ``Slice``, ``Concat``, ``Transpose``, ``Cast`` |
| ``gather`` (torch.gather) | ``GatherElements`` |
| ``mean``/``sum`` | ``ReduceMean``/``ReduceSum`` |
| ``layer_norm`` | ``LayerNormalization`` |
| ``embedding`` | ``Gather(axis=0)`` |
| ``linear`` | ``MatMul(x, Transpose(W))`` (+ ``Add`` bias) |
| ``sdpa`` | GQA heads repeated, ``MatMul(q, k^T) * scale``, mask/causal ``Where``, ``Softmax``, ``MatMul(v)`` |
| ``matmul``, ``clamp`` | ``MatMul``, ``Clip`` |
| ``topk_mask`` (a MoE router's top-k) | ``TopK`` values ``ScatterElements`` onto ``ConstantOfShape`` zeros |
| ``rms_norm``, ``rotary`` (half) | ``x / sqrt(mean(x^2) + eps) * g``, ``x cos + concat(-x2, x1) sin`` |
| ``q.linear``, ``q.embedding``, ``q.dequantize`` | the weight form's nodes (QDQ or MatMulNBits) |
"""

from __future__ import annotations

import onnx
from onnx import helper

from qcompiler.backends.onnx import lower_attention, lower_ops
from qcompiler.backends.onnx.builder import LOWERINGS, ONNX_DTYPES, LowerError, OnnxBuilder, result_type_of
from qcompiler.ir.core import Module

REGISTERED = (lower_ops, lower_attention)
"""The modules whose ``@lowers`` entries fill ``LOWERINGS`` (imported for that)."""


def lower_graph(b: OnnxBuilder) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """Lower ``b.g`` into ``b``'s nodes; returns the ONNX graph inputs and outputs."""
    inputs: list[onnx.ValueInfoProto] = []
    params = b.kv.dim_params() if b.kv is not None else {}
    if b.kv is not None:
        b.taken.update(b.kv.reserved())
    for a in b.g.args:
        t = result_type_of(a)
        b.taken.add(a.name)
        b.names[id(a)] = a.name
        shape = [d if isinstance(d, int) else params.get(d, d.removeprefix("?")) for d in t.shape]
        inputs.append(helper.make_tensor_value_info(a.name, ONNX_DTYPES[t.dtype.name], shape))
        for j, d in enumerate(t.shape):
            if isinstance(d, str) and d not in b.dims:
                b.dims[d] = b.node("Shape", [a.name], f"dim_{d.removeprefix('?')}", start=j, end=j + 1)
    outputs: list[onnx.ValueInfoProto] = []
    for op in b.g.ops:
        xs = [b.name_of(v) for v in op.operands]
        if op.name == "return":
            for i, (v, x) in enumerate(zip(op.operands, xs, strict=True)):
                t = result_type_of(v)
                out = output_name(b.m, i, len(xs))
                b.nodes.append(helper.make_node("Identity", [x], [out], name=out))
                shape = [d if isinstance(d, int) else params.get(d, d.removeprefix("?")) for d in t.shape]
                outputs.append(helper.make_tensor_value_info(out, ONNX_DTYPES[t.dtype.name], shape))
            break
        hook = b.kv.lowering(op) if b.kv is not None else None
        fn = hook or LOWERINGS.get(op.name) or b.weights.lowering(op.name)
        if fn is None:
            raise LowerError(
                f"{op.describe()}: no ONNX lowering for '{op.name}' (known: {', '.join(sorted(LOWERINGS))})"
            )
        if op.results:
            b.names[id(op.result)] = fn(b, op, xs)
    if b.kv is not None:
        inputs += b.kv.graph_inputs()
        outputs += b.kv.graph_outputs()
    prune(b, [o.name for o in outputs])
    return inputs, outputs


def prune(b: OnnxBuilder, outputs: list[str]) -> None:
    """Drop nodes no output depends on, and initializers no kept node reads."""
    made_by = {o: n for n in b.nodes for o in n.output}
    live: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        node = made_by.get(name)
        if node is None or node.name in live:
            continue
        live.add(node.name)
        stack.extend(i for i in node.input if i)
    b.nodes = [n for n in b.nodes if n.name in live]
    used = {i for n in b.nodes for i in n.input}
    b.initializers = [t for t in b.initializers if t.name in used]


OUTPUT_NAMES = {"CausalLMLogits": ("logits",), "EncoderHidden": ("last_hidden_state",)}
"""The capture wrapper (``provenance.model``) -> names of the graph's outputs."""


def output_name(m: Module, i: int, count: int) -> str:
    prov = m.attrs.get("provenance")
    wrapper = str(prov.get("model", "")) if isinstance(prov, dict) else ""
    names = OUTPUT_NAMES.get(wrapper, ())
    return names[i] if i < len(names) and count == len(names) else f"output_{i}"
