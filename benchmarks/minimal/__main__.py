"""``python -m benchmarks.minimal``: see ``bench.py``."""

from __future__ import annotations

from benchmarks.minimal.bench import main

main()
