#!/usr/bin/env python3
"""`pairgen-bench` from a checkout, installed or not (the code: pairgen/tuning/bench_cli.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's pairgen first

from pairgen.tuning.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
