"""A `larql accuracy --suite longctx` JSON report as the markdown table docs/FIDELITY.md shows:
per engine, the mean score at each length (over tasks and depths), the mean answer
log-probability, and the largest state it held against `standard`'s.

    python benchmarks/longctx_markdown.py report.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    report = json.loads(parser.parse_args().report.read_text())
    cells = report["cells"]
    lengths = sorted({c["length"] for c in cells})
    by_engine: dict[str, list[dict]] = defaultdict(list)
    for c in cells:
        by_engine[c["engine"]].append(c)
    reference = max(c["memory_bytes"] for c in by_engine.get("standard", cells))
    print(f"model {report['model']}, seed {report['seed']}, dataset {report['dataset_hash']}\n")
    head = " | ".join(f"score @{n}" for n in lengths)
    print(f"| engine | {head} | score, all | ln p(answer) | state MiB (largest) | × standard |")
    print("|---|" + "---|" * (len(lengths) + 4))
    for engine, mine in by_engine.items():
        scores = []
        for n in lengths:
            at = [c["score"] for c in mine if c["length"] == n]
            scores.append(f"{sum(at) / len(at):.2f}")
        logps = [c["answer_logprob"] for c in mine if c["answer_logprob"] is not None]
        held = max(c["memory_bytes"] for c in mine)
        print(
            f"| `{engine}` | {' | '.join(scores)} | "
            f"{sum(c['score'] for c in mine) / len(mine):.2f} | "
            f"{sum(logps) / len(logps):.2f} | {held / 2**20:.1f} | {held / reference:.2f} |"
        )


if __name__ == "__main__":
    main()
