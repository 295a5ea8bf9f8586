"""larql: decode with language models through pluggable KV engines.

```python
import larql
model = larql.load_model("smollm2-135m")
result = larql.generate(model, "turbo-quant:bits=4", "The capital of France is", max_new_tokens=8)
```

The functions are `larql.api`'s (docs/API.md), loaded on first use: `import larql` alone does
not import torch or a model."""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

_API = (
    "EngineSpec",
    "EngineSpecError",
    "Generation",
    "InvalidInput",
    "LarqlError",
    "Model",
    "PrefixCache",
    "SnapshotError",
    "Resumed",
    "State",
    "accuracy",
    "bench",
    "generate",
    "load_model",
    "load_state",
    "parse_engine",
    "parse_engines",
    "prefill",
    "resume",
    "stream",
    "teacher_forced_logits",
)

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import larql.api as api

        return getattr(api, name)
    raise AttributeError(f"module 'larql' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
