"""How the bench and accuracy tables print a number: formatted, or "—" where nothing was
measured (None or NaN), never a made-up zero."""

from __future__ import annotations

import math


def shown(value: float | None, fmt: str, missing: str = "—") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, fmt)
