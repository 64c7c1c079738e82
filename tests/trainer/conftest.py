import os

import pytest

from armor_megatron.config import load_config
from armor_megatron.tasks.tiny_run import prepare_tiny_run

CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny_cpu.yaml"
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Overrides pointing the tiny CPU config at a warmed-up tiny model and its data (built once)."""
    data = tmp_path_factory.mktemp("tiny")
    paths = [
        f"model.path={data}/hf",
        f"data.train_path={data}/train.jsonl",
        f"eval.datasets=[{{name: val, path: {data}/val.jsonl, k: 1}}]",
    ]
    prepare_tiny_run(load_config(CONFIG, paths), num_val=16, warmup_steps=150, log=None)
    return paths
