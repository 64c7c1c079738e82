"""Install armor_megatron.

On a CPU machine install torch==2.13.0 first (see README): the open range below would
otherwise let pip pick a multi-GB CUDA build. GPU jobs run two environments, each installed
from its lock file in tools/envs/ (docs/gpu.md, "GPU environments"; tools/check_envs.py writes the
locks from the requirements below and checks them).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("armor_megatron/__init__.py").read_text()).group(1)

setup(
    name="armor_megatron",
    version=version,
    description="ARMOR (Anchor Rollout and Mixed Optimization for RL) post-training on Megatron-core",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["armor_megatron", "armor_megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        # megatron-core 0.16's floor; Transformer Engine's torch extension compiles against the
        # installed torch. The GPU locks pin the torch sglang pins, in both environments (one NCCL
        # on both sides of a weight sync: tools/check_envs.py).
        "torch>=2.6",
        # The release the CPU compatibility layer and the local layer spec's edits were checked
        # against (megatron/cpu_compat.py CHECKED_MCORE_VERSIONS); 0.17 moved internals both touch.
        "megatron-core>=0.16.1,<0.17",
        # megatron-core's checkpoint writer needs psutil but does not declare it.
        "psutil",
        "numpy",
        "pyyaml>=6",
        "pyarrow>=14",  # Parquet prompt datasets (DAPO-Math-17k and friends ship as Parquet)
        "safetensors>=0.4",
        "xxhash>=3",  # checkpoint checksums in the converter (xxh3-128: hashes at memory speed)
        "transformers>=4.51",
        "math-verify>=0.7",
    ],
    extras_require={
        # The trainer's GPU packages. Transformer Engine: the range megatron-core 0.16 is tested with
        # (its dev extra: >=2.9,<2.12). The router the trainer starts in front of the engines.
        # NVIDIA Apex is not on the package index; docs/gpu.md explains the source build.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "tensorboard", "sglang-router==0.3.2"],
        # The SGLang servers' own environment (rollout.sglang.python): sglang pins torch and
        # transformers (0.5.23: torch 2.14.1, transformers 5.19.0), so it does not share the trainer's.
        "sglang": ["sglang==0.5.23", "sglang-router==0.3.2"],
        "plot": ["matplotlib>=3.7"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # `pytest -n 2`: the suite on two workers (docs/contributing.md, Tests)
            "pytest-random-order==1.2.0",  # off unless asked: `pytest --random-order` (docs/contributing.md, Tests)
            "matplotlib>=3.7",
            "ruff==0.17.6",
            "mypy==2.4.1",  # .ci/run type-checks the package (settings in pyproject.toml)
            "types-PyYAML==6.0.12.20261122",
            "coverage>=7.6",
            "sglang-router==0.3.2",  # the real router binary (CPU): tests/rollout/sglang/test_router.py
            "peft>=0.17",  # HF PEFT loads the LoRA adapter directory: tests/megatron/test_lora.py
        ],
    },
    entry_points={
        "console_scripts": [
            "armor-train=armor_megatron.cli.train:main",
            "armor-convert=armor_megatron.cli.convert:main",
            "armor-eval=armor_megatron.cli.eval:main",
            "armor-plot=armor_megatron.cli.plot:main",
            "armor-slurm=armor_megatron.cli.slurm:main",
            "armor-sweep=armor_megatron.cli.sweep:main",
        ]
    },
)
