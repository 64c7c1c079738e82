"""Weight export (Megatron shards -> HF-named full tensors on rank 0) is the converter's inverse,
bit for bit, at every parallel layout; it is what weight sync sends to the rollout engine."""

import os

import pytest
import torch
from safetensors import safe_open

from tests.convert.conftest import save_tiny_model
from tests.megatron.spawn import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def export_worker(rank, hf_dir, mcore_dir, layout):
    from armor_megatron.megatron.checkpoint import load_model_weights
    from armor_megatron.megatron.dist import ParallelConfig, initialize
    from armor_megatron.megatron.model import build_model_chunks
    from armor_megatron.megatron.weight_export import export_to_list
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(**layout)
    initialize(parallel, arch)
    chunks = build_model_chunks(arch, parallel)
    load_model_weights(chunks, mcore_dir)
    exported = export_to_list(chunks, arch)
    return None if exported is None else dict(exported)


@pytest.mark.parametrize(
    "family, layout",
    [("qwen2", dict(tp=2)), ("qwen3", dict(tp=2, pp=2)), ("mixtral", dict(ep=2))],
    ids=["qwen2-tp2", "qwen3-tp2pp2", "mixtral-ep2"],
)
def test_export_gives_back_every_hf_tensor_exactly(tmp_path, family, layout):
    from armor_megatron.convert import convert_hf_to_mcore

    hf_dir = save_tiny_model(family, str(tmp_path / "hf"))
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    world = layout.get("tp", 1) * layout.get("pp", 1) * max(layout.get("ep", 1), 1)
    exported = run_ranks(export_worker, world, hf_dir, str(tmp_path / "mcore"), layout)[0]
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        expected = {name: f.get_tensor(name) for name in f.keys()}
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
