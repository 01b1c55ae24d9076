"""Which library test/gpu should run on after the A/B: the candidate that beat trig (median
over rounds, at least 0.1 us) where it was meant to, else trig itself."""

import json
import statistics
import sys
from pathlib import Path

work, rounds = Path(sys.argv[1]), int(sys.argv[2])


def median(name: str, world: int, tokens: int, column: str) -> float:
    values = []
    for r in range(1, rounds + 1):
        path = work / f"{name}-{r}" / "bench_allreduce.json"
        if not path.exists():
            return float("inf")
        for result in json.loads(path.read_text())["results"]:
            for row in result["rows"]:
                if result["world_size"] == world and row["tokens"] == tokens:
                    values.append(row[column])
    return statistics.median(values) if values else float("inf")


def beats(name: str, cells: list[tuple[int, int, str]]) -> bool:
    return all(median(name, *c) <= median("trig", *c) - 0.1 for c in cells)


if beats("warpx", [(2, 1, "ours_fused"), (2, 16, "ours_fused")]):
    print("warpx")
elif beats("backoff", [(8, 1, "ours_plain"), (8, 2, "ours_plain")]):
    print("backoff")
else:
    print("trig")
