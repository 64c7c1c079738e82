"""The families added after the first five (Mistral, Qwen2-MoE, DeepSeek-V2/V3 layout), end to end
through the converter and Megatron: transformers-parity of logits at TP=1 / TP=2 / PP=2 / EP=2,
checkpoints Megatron saves converting back bit for bit, and the DeepSeek round trip.

The parity runs use ``megatron_worker.py`` (see its docstring) on these families only.
"""

from __future__ import annotations

import os

import pytest
import torch

from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.rules import hf_tensor_names
from armor_megatron.convert.verify import compare_tensors, hf_logits, prompts
from tests.convert.conftest import DEEPSEEK_FAMILIES, save_tiny_model
from tests.convert.test_megatron_parity import assert_megatron_saves_convert_back, run_worker

NEW = ("mistral", "qwen2_moe")
NEW_MOE = ("qwen2_moe",)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_tiny_model(f, os.path.join(root, f)) for f in (*NEW, *DEEPSEEK_FAMILIES)}


@pytest.fixture(scope="module")
def cases(models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families-mcore")
    out = {}
    for family, hf_dir in models.items():
        mcore_dir, expected = os.path.join(root, family), os.path.join(root, f"{family}.logits.pt")
        convert_hf_to_mcore(hf_dir, mcore_dir, progress_stream=None)
        torch.save(hf_logits(hf_dir, prompts(HFCheckpoint(hf_dir).arch)), expected)
        out[family] = ",".join((hf_dir, mcore_dir, expected))
    return out


@pytest.mark.parametrize("family", [*NEW, *DEEPSEEK_FAMILIES])
def test_round_trip_is_bit_identical_and_complete(family, models, tmp_path):
    hf_dir = models[family]
    source = HFCheckpoint(hf_dir)
    assert sorted(hf_tensor_names(source.arch)) == sorted(source.tensors)
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    convert_mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"), progress_stream=None)
    compared, mismatched = compare_tensors(source, HFCheckpoint(str(tmp_path / "back")))
    assert mismatched == [] and compared == len(source.tensors)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_tp1_exact_keys_and_logits(cases):
    out = run_worker(1, NEW, cases, "--check-keys")
    assert out.count("logits max diff") == len(NEW)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_tp2_mistral(cases, models, tmp_path):
    out = run_worker(2, ["mistral"], cases, "--tp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2
    assert_megatron_saves_convert_back(tmp_path / "saved", ["mistral"], models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_pp2(cases, models, tmp_path):
    out = run_worker(2, NEW, cases, "--pp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == len(NEW)
    assert_megatron_saves_convert_back(tmp_path / "saved", NEW, models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_ep2_moe(cases, models, tmp_path):
    out = run_worker(2, NEW_MOE, cases, "--ep", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2 * len(NEW_MOE)
    assert_megatron_saves_convert_back(tmp_path / "saved", NEW_MOE, models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_deepseek_tp1_exact_keys_and_logits(cases):
    """MLA (local spec core attention: armor_megatron.megatron.local_mla_attention), YaRN, a dense
    first layer, routed + shared experts."""
    out = run_worker(1, list(DEEPSEEK_FAMILIES), cases, "--check-keys")
    assert out.count("logits max diff") == len(DEEPSEEK_FAMILIES)
