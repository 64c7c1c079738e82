"""The families added after the first five (Mistral, Qwen2-MoE, DeepSeek-V2/V3), end to end
through the converter and Megatron: transformers-parity of logits at TP=1 / TP=2 / PP=2 / EP=2,
checkpoints Megatron saves converting back bit for bit, the round trips, and DeepSeek-V3's
router bias and multi-token-prediction layers.

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
    first layer, routed + shared experts; V3: sigmoid group-limited routing with the selection bias
    (router.expert_bias), renormalised and scaled top-k."""
    out = run_worker(1, list(DEEPSEEK_FAMILIES), cases, "--check-keys")
    assert out.count("logits max diff") == len(DEEPSEEK_FAMILIES)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_deepseek_tp2_dense(cases, models, tmp_path):
    """TP=2 on the all-dense DeepSeek (MoE with tp > 1 needs sequence parallelism, hence TE): the
    local spec splits the MLA down projections by rows (column parallel) like the up projections."""
    out = run_worker(2, ["deepseek_dense"], cases, "--tp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2
    assert_megatron_saves_convert_back(tmp_path / "saved", ["deepseek_dense"], models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_deepseek_pp2(cases, models, tmp_path):
    """PP=2: the dense first layer on stage 0, the MoE layer on stage 1 (per-layer keys)."""
    families = list(DEEPSEEK_FAMILIES)
    out = run_worker(2, families, cases, "--pp", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == len(families)
    assert_megatron_saves_convert_back(tmp_path / "saved", families, models, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_deepseek_ep2(cases, models, tmp_path):
    families = ["deepseek", "deepseek_v3"]
    out = run_worker(2, families, cases, "--ep", "2", "--save-dir", str(tmp_path / "saved"))
    assert out.count("logits max diff") == 2 * len(families)
    assert_megatron_saves_convert_back(tmp_path / "saved", families, models, tmp_path)


def with_extra_tensors(hf_dir: str, out_dir: str, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the HF model ``hf_dir`` whose checkpoint also holds ``extra``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    return out_dir


def mtp_layer(arch, layer: int) -> dict[str, torch.Tensor]:
    """Some tensors of a DeepSeek-V3 multi-token-prediction layer (as V3's checkpoint names them)."""
    h, prefix = arch.hidden_size, f"model.layers.{layer}."
    return {
        prefix + "enorm.weight": torch.ones(h),
        prefix + "hnorm.weight": torch.ones(h),
        prefix + "eh_proj.weight": torch.randn(h, 2 * h),
        prefix + "shared_head.norm.weight": torch.ones(h),
        prefix + "self_attn.kv_a_layernorm.weight": torch.ones(arch.mla.kv_lora_rank),
    }


def test_deepseek_v3_mtp_layers_are_left_out_with_a_notice(models, tmp_path):
    """V3's multi-token-prediction layer (model.layers.{num_hidden_layers}) is not part of the model:
    conversion says so in one line and skips it, the round trip compares everything else bit for
    bit, the export and the converted-back checkpoint hold none of it."""
    import io

    from armor_megatron.convert.verify import round_trip

    arch = HFCheckpoint(models["deepseek_v3"]).arch
    assert arch.mtp_layers == 1 and arch.num_layers == 2
    hf_dir = with_extra_tensors(models["deepseek_v3"], str(tmp_path / "hf"), mtp_layer(arch, 2))
    stream = io.StringIO()
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=stream)
    notices = [line for line in stream.getvalue().splitlines() if "multi-token-prediction" in line]
    assert notices == [
        f"{hf_dir}: ignoring the 5 tensors of 1 multi-token-prediction layer(s) (model.layers.2): "
        "they are not part of the converted model"
    ]
    compared, mismatched = round_trip(hf_dir, str(tmp_path / "mcore"))
    assert mismatched == [] and compared == len(HFCheckpoint(models["deepseek_v3"]).tensors)
    convert_mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"), progress_stream=None)
    back = HFCheckpoint(str(tmp_path / "back")).tensors
    assert not [n for n in back if n.startswith("model.layers.2.")]
    assert not [n for n in hf_tensor_names(arch) if n.startswith("model.layers.2.")]


def test_layers_beyond_the_mtp_layers_are_still_refused(models, tmp_path):
    from armor_megatron.convert.errors import CheckpointError

    arch = HFCheckpoint(models["deepseek_v3"]).arch
    hf_dir = with_extra_tensors(models["deepseek_v3"], str(tmp_path / "hf"), mtp_layer(arch, 3))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.3\.eh_proj\.weight is not part of a deepseek"):
        convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    dense = HFCheckpoint(models["deepseek"]).arch  # V2: no MTP layers, so layer 2 is unexpected
    assert dense.mtp_layers == 0
    v2_dir = with_extra_tensors(models["deepseek"], str(tmp_path / "v2"), mtp_layer(dense, 2))
    with pytest.raises(CheckpointError, match="5 unexpected tensors"):
        convert_hf_to_mcore(v2_dir, str(tmp_path / "v2-mcore"), progress_stream=None)


def test_deepseek_v3_router_bias_is_megatrons_expert_bias(models):
    """e_score_correction_bias [E] <-> decoder.layers.{i}.mlp.router.expert_bias (MoE layers only)."""
    from armor_megatron.convert import resolve_param
    from armor_megatron.convert.rules import tensor_rules

    arch = HFCheckpoint(models["deepseek_v3"]).arch
    biases = [r for r in tensor_rules(arch) if r.ckpt_key.endswith("router.expert_bias")]
    assert [(r.ckpt_key, r.hf_names, r.shape, r.tp) for r in biases] == [
        (
            "decoder.layers.1.mlp.router.expert_bias",
            ("model.layers.1.mlp.gate.e_score_correction_bias",),
            (8,),
            "replicated",
        )
    ]
    ref = resolve_param(arch, "decoder.layers.1.mlp.router.expert_bias")
    assert ref.hf_names == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    v2 = HFCheckpoint(models["deepseek"]).arch
    assert not [r for r in tensor_rules(v2) if "expert_bias" in r.ckpt_key]


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_deepseek_convert_and_verify_as_a_user_runs_them(models, tmp_path):
    """``armor-convert hf-to-mcore`` for V2-Lite (no notice) and for V3 with a multi-token-prediction
    layer in its checkpoint (the notice on stderr), then ``verify`` (round trip + logits at TP=1) of
    the V3 one. V2-Lite's round trip and logits are the same functions' (test_round_trip_* and
    test_deepseek_tp1_exact_keys_and_logits above)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "tools", "convert_checkpoint.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    v3 = HFCheckpoint(models["deepseek_v3"]).arch
    for name, hf_dir in [
        ("deepseek", models["deepseek"]),
        ("deepseek_v3", with_extra_tensors(models["deepseek_v3"], str(tmp_path / "v3-mtp"), mtp_layer(v3, 2))),
    ]:
        mcore = str(tmp_path / f"{name}-mcore")
        converted = subprocess.run(
            cmd + ["hf-to-mcore", hf_dir, mcore], capture_output=True, text=True, env=env, timeout=200
        )
        assert converted.returncode == 0, converted.stderr[-3000:]
        assert ("multi-token-prediction" in converted.stderr) == (name == "deepseek_v3"), converted.stderr
        if name != "deepseek_v3":
            continue
        proc = subprocess.run(cmd + ["verify", hf_dir, mcore], capture_output=True, text=True, env=env, timeout=200)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "logits: max |megatron - transformers|" in proc.stdout and "verify: OK" in proc.stdout, proc.stdout
