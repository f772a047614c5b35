"""A tiny GPT trained data-parallel under ``forewarn launch``: the migratable-job example.

    forewarn launch --nproc 2 --spares 1 --job-id gpt -- python examples/train_gpt.py
    forewarn migrate --job gpt --rank 1 --reason preventive      # from another shell

The example's code is ``demo/gpt.py`` (read it there: about 170 lines, the whole recipe for a
migratable job); it lives in the ``demo`` package so that an installed wheel runs it too, as
``python -m demo.gpt``. This file runs it from a source tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.gpt import main

if __name__ == "__main__":
    main()
