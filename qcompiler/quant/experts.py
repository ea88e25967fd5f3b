"""Mixture-of-experts blocks as a static, exact graph of per-expert Linears (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers holds a block's experts as two 3-D parameters (``gate_up_proj [E, 2*ff, hidden]``,
``down_proj [E, hidden, ff]``) and runs only the experts a token picked (``nonzero``, ``index_add_``):
no static graph. ``unfuse_experts`` replaces each such block, in place, with ``DenseMoe``:

- the router stays float: ``Router`` holds the ``[E, hidden]`` weight as a plain parameter (not an
  ``nn.Linear``, so no quantizer takes it); so does Qwen2-MoE's shared-expert gate (``shared_expert_gate``,
  ``[1, hidden]``: one sigmoid weight per token), as llama.cpp keeps both float (``ffn_gate_inp`` and
  ``ffn_gate_inp_shexp``, which its quantizer sees as 1-D and never quantizes);
- every expert is three ``nn.Linear`` (gate, up, down), named as the checkpoint names them
  (Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``; Qwen's ``mlp.experts.N.gate_proj/up_proj/down_proj``),
  so each is a logical ``[N, K]`` weight that any scheme quantizes along K like every other Linear;
- every expert runs on every token; the router's top-k weights are scattered to a dense ``[tokens, E]``
  matrix (``qcompiler::topk_mask``: zero for the experts a token did not pick), renormalised when the
  model does, and the output is ``sum_e expert_e(x) * w[:, e]`` in expert order. A zero weight adds an
  exact zero, so this is transformers' own sum up to the order of float summation in the matmuls.

The values are the checkpoint's, sliced from the 3-D parameters (no arithmetic). A block whose layer
attribute differs from the checkpoint's name (Mixtral's ``mlp`` is ``block_sparse_moe`` on disk) is
installed under the checkpoint's name; the layer's ``mlp`` becomes a forwarding ``Route`` holding no
parameters, so the model's state names are the checkpoint's.

``DenseMoe`` (Mixtral, top-2 of 4 experts, one layer)::

    %p = softmax(%router_logits) {axis = -1}
    %w = topk_mask(%p) {k = 2}           // top-k kept, zeros elsewhere
    %w2 = div(%w, sum(%w) {axes = [-1], keepdim = true})
    %y = add(mul(%expert0, slice(%w2) {axis = 2, start = 0, end = 1}), ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("qcompiler::topk_mask", mutates_args=())
def topk_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` where it is among the ``k`` largest along the last axis (``torch.topk``'s choice), else 0."""
    values, index = torch.topk(x, k, dim=-1)
    return torch.zeros_like(x).scatter(-1, index, values)


@topk_mask.register_fake
def _(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass(frozen=True)
class MoeForm:
    """How one transformers MoE block is stored in its checkpoint."""

    attr: str
    """The layer's attribute (and checkpoint path part) the block lives under."""
    names: tuple[str, str, str]
    """Each expert's gate, up and down Linear, as the checkpoint names them."""
    shared: bool = False
    """A shared expert (``shared_expert`` Linears gate/up/down) and its float sigmoid gate (``shared_expert_gate``)."""


FORMS: dict[str, MoeForm] = {
    "MixtralSparseMoeBlock": MoeForm("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeSparseMoeBlock": MoeForm("mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen2MoeSparseMoeBlock": MoeForm("mlp", ("gate_proj", "up_proj", "down_proj"), shared=True),
}
"""transformers' MoE block class -> its checkpoint form."""


class Router(nn.Module):
    """The router's float ``[E, hidden]`` weight (a parameter, not a Linear: no quantizer takes it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class Expert(nn.Module):
    """One gated MLP: ``down(act(gate(x)) * up(x))``, its Linears under the checkpoint's names."""

    def __init__(self, names: tuple[str, str, str], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.names = names
        for name, w in zip(names, (gate, up, down), strict=True):
            lin = nn.Linear(int(w.shape[1]), int(w.shape[0]), bias=False, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            self.add_module(name, lin)

    def forward(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        gate, up, down = (self.get_submodule(n) for n in self.names)
        y: torch.Tensor = down(act(gate(x)) * up(x))
        return y


class DenseMoe(nn.Module):
    """Every expert on every token, weighted by the router's dense top-k matrix (module docstring)."""

    def __init__(self, block: nn.Module, form: MoeForm) -> None:
        super().__init__()
        router, experts = block.get_submodule("gate"), block.get_submodule("experts")
        self.top_k = int(getattr(router, "top_k", 0))
        self.normalise = bool(getattr(router, "norm_topk_prob", True))
        self.act = experts.get_submodule("act_fn")
        self.gate = Router(router.get_parameter("weight").detach())
        gate_up, down = experts.get_parameter("gate_up_proj").detach(), experts.get_parameter("down_proj").detach()
        ff = int(down.shape[2])
        self.experts = nn.ModuleList(
            Expert(form.names, gate_up[e, :ff], gate_up[e, ff:], down[e]) for e in range(int(gate_up.shape[0]))
        )
        if form.shared:
            self.shared_expert = block.get_submodule("shared_expert")
            self.shared_expert_gate = Router(block.get_submodule("shared_expert_gate").get_parameter("weight").detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        weights = topk_mask(torch.softmax(logits.float(), dim=-1), self.top_k)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        ys: list[torch.Tensor] = [
            expert(x, self.act) * weights[..., e : e + 1] for e, expert in enumerate(self.experts)
        ]
        out = ys[0]
        for y in ys[1:]:  # in expert order, as transformers' index_add_ adds them
            out = out + y
        if "shared_expert" in self._modules:
            shared: torch.Tensor = self.get_submodule("shared_expert")(x)
            gate = F.linear(x, self.get_submodule("shared_expert_gate").get_parameter("weight"))
            out = out + torch.sigmoid(gate) * shared
        return out


class Route(nn.Module):
    """The layer's ``mlp`` when the block lives under another name: calls it, holds no parameter."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", target)  # not registered: its parameters keep their one name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target: nn.Module = self.__dict__["target"]
        y: torch.Tensor = target(x)
        return y


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, MoeForm]]:
    """Every transformers MoE block of a known form in ``model``: (qualified name, block, form)."""
    return [(fqn, mod, FORMS[type(mod).__name__]) for fqn, mod in model.named_modules() if type(mod).__name__ in FORMS]


def unfuse_experts(model: nn.Module) -> nn.Module:
    """``model`` with every known MoE block replaced by its ``DenseMoe`` (in place; see the module docstring)."""
    for fqn, block, form in moe_blocks(model):
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = DenseMoe(block, form)
        if child == form.attr:
            setattr(parent, child, dense)
            continue
        delattr(parent, child)
        setattr(parent, form.attr, dense)
        setattr(parent, child, Route(dense))
    return model
