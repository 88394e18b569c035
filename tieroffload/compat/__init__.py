"""Private PyTorch internals, one small adapter per module, each with the torch versions it was
tested on (``TESTED``). Nothing else in tieroffload touches a private torch name."""
