#!/usr/bin/env python
"""Convert checkpoints between HF safetensors and Megatron torch_dist (same as ``armor-convert``).

python tools/convert_checkpoint.py hf-to-mcore HF_DIR OUT_DIR
python tools/convert_checkpoint.py mcore-to-hf MCORE_DIR OUT_DIR
python tools/convert_checkpoint.py verify HF_DIR MCORE_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from armor_megatron.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
