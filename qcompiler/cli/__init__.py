"""The ``qcompiler`` command line: one module per subcommand, registered in ``main.COMMANDS``."""
