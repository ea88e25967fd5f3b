"""Inputs at other sizes, for checks that evaluate the exported program (attention masks).

Every dynamic dim takes a few sizes; integer inputs that hold only 0/1 are treated as padding masks
(random, first position always kept); other integer inputs get random values below their example's
maximum + 1; float inputs get normal noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

SIZES = (3, 5, 8)
"""Sizes every dynamic dim takes in the variants (the batch dim at most 2 when seq is dynamic too)."""


def input_variants(
    inputs: Sequence[torch.Tensor],
    names: list[str],
    dynamic: Mapping[str, Mapping[int, object]],
    seed: int = 0,
    extra: Sequence[int] = (),
) -> list[list[torch.Tensor]]:
    """The inputs at each of ``SIZES`` and ``extra`` (lengths past a sliding window)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[torch.Tensor]] = [list(inputs)]
    for size in (*SIZES, *extra):
        variant: list[torch.Tensor] = []
        for x, name in zip(inputs, names, strict=True):
            shape = list(x.shape)
            for axis in dynamic.get(name, {}):
                shape[axis] = size if axis != 0 or len(dynamic.get(name, {})) == 1 else min(size, 2)
            variant.append(fill(x, shape, gen))
        out.append(variant)
    return out


def fill(x: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    if x.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=x.dtype)
    if bool(((x == 0) | (x == 1)).all()) and x.dim() == 2:
        mask = torch.randint(0, 2, shape, generator=gen, dtype=x.dtype)
        mask[:, 0] = 1
        return mask
    hi = int(x.max()) + 1 if x.numel() else 2
    return torch.randint(0, max(hi, 2), shape, generator=gen, dtype=x.dtype)
