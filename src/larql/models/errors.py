"""Errors raised while finding, reading or configuring a model."""

from larql.errors import LarqlError


class ModelError(LarqlError):
    """A model could not be used."""


class ModelNotFound(ModelError):
    """The name is neither a known model nor an existing path, or the model is not installed."""


class ModelFormatError(ModelError):
    """The file or directory exists but is not a model larql can read."""


class UnsupportedArchitecture(ModelError):
    """The model's architecture (or one of its options) is not implemented."""
