"""Errors the engine raises for user mistakes. Each names the field and the allowed range."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """A request or config value is out of range. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(ValueError):
    """The model could not be loaded: missing path, unsupported architecture or quantization."""
