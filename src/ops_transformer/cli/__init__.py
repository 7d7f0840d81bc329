"""The ``ops-transformer`` command line: one module per command."""
