"""Command-line front doors: ``mlscope`` and ``mlscope-submit``.

The CLI is the top layer: it may import every other package, and nothing imports it.
Subcommand modules are imported only when their command runs.
"""
