#!/usr/bin/env python
"""Expand a config grid (alpha, tau, G, seed, any dotted key) into a SLURM job array.

    python tools/sweep.py --config configs/qwen25_math_7b_dapo_armor.yaml --out sweeps/alpha-tau \
        --grid alpha=0.875,0.9375 --grid tau=80,160 --grid seed=1,2 --max-parallel 4 [--dry-run | --submit]

See armor_megatron/launch/sweep.py for the naming and file layout, armor_megatron/cli/sweep.py for the options.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from armor_megatron.cli.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
