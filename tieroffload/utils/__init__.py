"""Helpers every layer may use: byte sizes, process memory, distributed rank, directory rules."""
