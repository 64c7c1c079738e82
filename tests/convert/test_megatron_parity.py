"""Converted checkpoints load into the project's Megatron GPTModel and match transformers,
and checkpoints Megatron saves at TP=2 / PP=2 / EP=2 convert back to the source tensors.

Each test runs ``megatron_worker.py`` on gloo ranks (CPU) over several families; see the
worker's docstring for what every rank checks (exact checkpoint keys at world size 1,
rank-local parameters == ``tp_split`` of the rules, logits within 1e-4 of transformers).
"""

from __future__ import annotations

import os

import pytest
import torch

from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.verify import compare_tensors, hf_logits, prompts
from tests.convert.conftest import FAMILIES, MOE_FAMILIES
from tests.megatron.spawn import run_ranks

DENSE = [f for f in FAMILIES if f not in MOE_FAMILIES]


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory) -> dict[str, str]:
    """family -> worker CASE string (HF dir, converted torch_dist dir, transformers' logits)."""
    root = tmp_path_factory.mktemp("parity")
    cases = {}
    for family, hf_dir in tiny_models.items():
        mcore_dir, expected = os.path.join(root, family), os.path.join(root, f"{family}.logits.pt")
        convert_hf_to_mcore(hf_dir, mcore_dir, progress_stream=None)
        torch.save(hf_logits(hf_dir, prompts(HFCheckpoint(hf_dir).arch)), expected)
        cases[family] = ",".join((hf_dir, mcore_dir, expected))
    return cases


def _worker_rank(rank: int, argv: list[str]) -> list[str]:
    from tests.convert.megatron_worker import check_cases

    return check_cases(argv)


def run_worker(nproc: int, families, converted, *flags: str) -> str:
    """``megatron_worker.py FLAGS CASE...`` on `nproc` gloo ranks: every rank's ``WORKER OK`` lines."""
    ranks = run_ranks(_worker_rank, nproc, [*flags, *(converted[f] for f in families)], timeout=400)
    out = "\n".join(line for lines in ranks for line in lines)
    assert out.count("WORKER OK") == nproc * len(families), out
    return out


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_tp1_exact_keys_and_logits(converted):
    out = run_worker(1, list(FAMILIES), converted, "--check-keys")
    assert out.count("logits max diff") == len(FAMILIES)


def assert_megatron_saves_convert_back(saved_root, families, tiny_models, tmp_path):
    """Checkpoints Megatron itself saved at some parallelism convert back to the source HF tensors."""
    for family in families:
        out = tmp_path / f"{family}-hf"
        convert_mcore_to_hf(
            os.path.join(saved_root, family), str(out), hf_config_dir=tiny_models[family], progress_stream=None
        )
        compared, mismatched = compare_tensors(HFCheckpoint(tiny_models[family]), HFCheckpoint(str(out)))
        assert mismatched == [] and compared > 0, family


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_tp2_dense(converted, tiny_models, tmp_path):
    out = run_worker(2, DENSE, converted, "--tp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2 * len(DENSE)  # both TP ranks are last-stage ranks
    assert_megatron_saves_convert_back(tmp_path / "saved", DENSE, tiny_models, tmp_path)


# Every family, qwen2's tied embeddings included (the last stage's copy of the embedding is
# synchronised from the first stage: cpu_compat.tied_embedding_sync_on_cpu).
PP_FAMILIES = list(FAMILIES)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_pp2(converted, tiny_models, tmp_path):
    out = run_worker(2, PP_FAMILIES, converted, "--pp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == len(PP_FAMILIES)
    assert_megatron_saves_convert_back(tmp_path / "saved", PP_FAMILIES, tiny_models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_ep2_moe(converted, tiny_models, tmp_path):
    out = run_worker(2, list(MOE_FAMILIES), converted, "--ep", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2 * len(MOE_FAMILIES)
    assert_megatron_saves_convert_back(tmp_path / "saved", MOE_FAMILIES, tiny_models, tmp_path)
