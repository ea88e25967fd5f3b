"""qcompiler: compile quantized PyTorch models into verified deployable artifacts."""

__version__ = "0.1.0"
