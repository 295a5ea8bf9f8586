"""CPU kernels of our own, compiled at `make setup`, with torch as the fallback."""
