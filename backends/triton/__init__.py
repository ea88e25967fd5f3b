"""The ``triton`` target: weights in ``triton-kn`` plus generated Triton kernels for the fused low-bit ops.

Its declarations (``qcompiler.plugins``): the ``triton`` target and the ``triton-kn`` code layout."""

TARGETS = {"triton": ".backend:TritonBackend"}
LAYOUTS = {("triton-kn", 1): ".layouts"}
