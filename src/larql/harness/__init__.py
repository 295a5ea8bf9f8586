"""User-facing measurement: `bench` (speed and memory) and `accuracy` (fidelity)."""
