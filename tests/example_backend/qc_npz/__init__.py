"""An example backend, outside qcompiler's tree: ``--target npz`` stores every tensor of the IR (the
logical codes, qparams and dense weights) in one uncompressed ``weights.npz`` beside ``graph.qir``.
A debugging target: it shows the codes exactly as the IR holds them, and ``npz.codes-linear`` runs
its layout on the CPU (``kernels.py``). Its whole registration is these declarations plus one
entry-point line (``qc_npz-0.1.dist-info/entry_points.txt``)."""

TARGETS = {"npz": ".backend:NpzBackend"}
LAYOUTS = {("npz-codes", 1): ".layouts"}
BLOB_SCHEMES = {"npz": ".backend"}
KERNELS = {"npz.codes-linear": ".kernels:KERNELS"}
