"""Command-line tools over the library: the demo and ``tieroffload-bench``. The library never
imports this package."""
