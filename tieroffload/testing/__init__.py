"""A small GPT and a token stream, for examples, benches and tests."""

from .models import GPT, token_batch

__all__ = ["GPT", "token_batch"]
