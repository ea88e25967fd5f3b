"""The ``triton`` target: weights in ``triton-kn`` plus generated Triton kernels for the fused low-bit ops.

Its declarations (``qcompiler.plugins``): the ``triton`` target and the ``triton-kn`` code layout. It
declares no ``KERNELS``: its runtime kernels are generated per artifact (one per kernel key and
phase), so ``TritonBackend.runtime_kernels`` registers them when an artifact is loaded."""

TARGETS = {"triton": ".backend:TritonBackend"}
LAYOUTS = {("triton-kn", 1): ".layouts"}
