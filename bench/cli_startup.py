"""Wall time of `rlx --help` (and `rlx render`), next to a bare Python start-up.

    python bench/cli_startup.py [--runs 15]

Prints a table: median and p90 seconds per command, and the ratio to `python -c pass`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], runs: int) -> list[float]:
    subprocess.run(argv, capture_output=True, check=True)  # warm the file cache
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    py = sys.executable
    recipe = str(REPO / "recipes" / "gsm8k-grpo.yaml")
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "rlx --help": [py, "-m", "rlx", "--help"],
        "rlx render (sky)": [py, "-m", "rlx", "render", recipe, "-b", "sky"],
        "rlx lint recipes/": [py, "-m", "rlx", "lint", str(REPO / "recipes")],
    }
    results = {name: timed(argv, args.runs) for name, argv in cases.items()}
    base = statistics.median(results["python -c pass"])
    print(f"{'command':<22} {'median s':>9} {'p90 s':>7} {'x python':>9}")
    for name, times in results.items():
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        median = statistics.median(times)
        print(f"{name:<22} {median:>9.3f} {p90:>7.3f} {median / base:>9.1f}")


if __name__ == "__main__":
    main()
