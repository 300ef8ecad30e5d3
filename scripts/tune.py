#!/usr/bin/env python3
"""`pairgen-tune` from a checkout, installed or not (the code: pairgen/tuning/tune_cli.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's pairgen first

from pairgen.tuning.tune_cli import main, starting_points  # noqa: E402,F401  (starting_points: tests/test_tuned.py)

if __name__ == "__main__":
    sys.exit(main())
