"""How one token flows: shared layer math, FFN backends, the engine protocol, generation."""
