"""Per-strategy split of the three corpora: match rates, mean bits, follow and
fallback rates, and served rates (NaN where nothing was served — never a silent 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from larql.harness.accuracy.scoring import PromptScore
from larql.harness.formatting import Unbroken


@dataclass(frozen=True)
class AxisSplit:
    n: int
    served: int
    rate: float  # match rate (facts) or follow rate (conflict), over served
    mean_bits: float = math.nan
    fallback_rate: float = math.nan  # conflict only

    @property
    def served_rate(self) -> float:
        return self.served / self.n if self.n else math.nan


@dataclass(frozen=True)
class StrategySplit:
    strategy: str
    kv_engine: str
    ffn_backend: str
    parametric: AxisSplit
    in_context: AxisSplit
    conflict: AxisSplit

    def as_dict(self) -> dict[str, Any]:
        def axis(a: AxisSplit) -> dict[str, Any]:
            return {
                "n": a.n,
                "served": a.served,
                "served_rate": _json_num(a.served_rate),
                "rate": _json_num(a.rate),
                "mean_bits": _json_num(a.mean_bits),
                "fallback_rate": _json_num(a.fallback_rate),
            }

        return {
            "strategy": self.strategy,
            "kv_engine": self.kv_engine,
            "ffn_backend": self.ffn_backend,
            "parametric": axis(self.parametric),
            "in_context": axis(self.in_context),
            "conflict": axis(self.conflict),
        }


def _json_num(x: float) -> float | None:
    return None if math.isnan(x) else x


def _ratio(num: int, den: int) -> float:
    return num / den if den else math.nan


def fact_axis(scores: list[PromptScore]) -> AxisSplit:
    served = [s for s in scores if s.served]
    bits = [s.bits for s in served if s.bits is not None and math.isfinite(s.bits)]
    return AxisSplit(
        n=len(scores),
        served=len(served),
        rate=_ratio(sum(bool(s.matched) for s in served), len(served)),
        mean_bits=sum(bits) / len(bits) if bits else math.nan,
    )


def conflict_axis(scores: list[PromptScore]) -> AxisSplit:
    served = [s for s in scores if s.served]
    return AxisSplit(
        n=len(scores),
        served=len(served),
        rate=_ratio(sum(bool(s.followed_context) for s in served), len(served)),
        fallback_rate=_ratio(sum(bool(s.parametric_fallback) for s in served), len(served)),
    )


def strategy_splits(scores: list[PromptScore]) -> list[StrategySplit]:
    splits = []
    for strategy in sorted({s.strategy for s in scores}):
        mine = [s for s in scores if s.strategy == strategy]
        splits.append(
            StrategySplit(
                strategy=strategy,
                kv_engine=mine[0].kv_engine,
                ffn_backend=mine[0].ffn_backend,
                parametric=fact_axis([s for s in mine if s.source == "parametric"]),
                in_context=fact_axis([s for s in mine if s.source == "in_context"]),
                conflict=conflict_axis([s for s in mine if s.source == "conflict"]),
            )
        )
    return splits


def _pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{100 * x:.1f}"


def _bits(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def split_table(splits: list[StrategySplit]) -> Unbroken:
    """The reference layout; with any non-dense FFN, KV engine and FFN backend lead the row."""
    two_axes = any(s.ffn_backend != "dense" for s in splits)
    table = Table(title="=== Engine Split: Parametric vs In-Context vs Conflict ===")
    lead = ["KV engine", "FFN backend"] if two_axes else ["Strategy"]
    for col in [*lead, "Param %", "Param bits", "InCtx %", "InCtx bits", "Follow %", "Fallback %"]:
        table.add_column(col, justify="left" if col in lead else "right")
    for s in splits:
        head = [s.kv_engine, s.ffn_backend] if two_axes else [s.strategy]
        table.add_row(
            *head,
            _pct(s.parametric.rate),
            _bits(s.parametric.mean_bits),
            _pct(s.in_context.rate),
            _bits(s.in_context.mean_bits),
            _pct(s.conflict.rate),
            _pct(s.conflict.fallback_rate),
        )
    return Unbroken(table, ("Fallback %", "InCtx bits", "Param bits"))


def served_lines(splits: list[StrategySplit]) -> list[str]:
    """One line per strategy that skipped prompts: `served: P=a/b, IC=c/d, C=e/f`."""
    lines = []
    for s in splits:
        axes = (s.parametric, s.in_context, s.conflict)
        if any(a.served < a.n for a in axes):
            p, ic, c = axes
            lines.append(
                f"{s.strategy} served: P={p.served}/{p.n}, IC={ic.served}/{ic.n}, "
                f"C={c.served}/{c.n}"
            )
    return lines
