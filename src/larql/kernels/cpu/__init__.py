"""CPU kernels of our own (C++), compiled at `make setup`, with torch as the fallback.
`cpu_extension()` is the one way in: the built module, or None."""

from larql.kernels.cpu.build import cpu_extension

__all__ = ["cpu_extension"]
