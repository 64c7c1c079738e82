"""Model weights read straight from HF safetensors (`hf_weights`): at TP=2, PP=2 and EP=2, dense,
tied, MoE and MLA families, every rank's parameters and buffers equal bit for bit those that
``dist_checkpointing`` loads from the converter's torch_dist checkpoint of the same directory,
and a rank's peak memory while loading stays near its own share of the model."""

from __future__ import annotations

import os

import pytest
import torch

from armor_megatron.convert import convert_hf_to_mcore
from armor_megatron.convert.errors import CheckpointError
from tests.convert.conftest import save_tiny_model
from tests.megatron.spawn import run_ranks


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _compare_rank(rank, cases, parallel_kwargs, model_dtype):
    """On every rank, per (family, hf_dir, mcore_dir): load the converted checkpoint, keep the
    state, overwrite every tensor, load from HF, compare bit for bit."""
    from megatron.core import parallel_state as ps

    from armor_megatron.megatron import dist
    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.models import ModelArch

    checked = {}
    for family, hf_dir, mcore_dir in cases:
        arch = ModelArch.from_hf_dir(hf_dir)
        parallel = dist.ParallelConfig(**parallel_kwargs)
        dist.initialize(parallel, arch)
        model = build_gpt_model(
            arch,
            parallel,
            dtype=model_dtype,
            use_te=False,
            moe_token_dispatcher="allgather",
            variable_seq_lengths=False,
        )
        load_weights([model], mcore_dir)
        expected = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        with torch.no_grad():
            for v in model.state_dict(keep_vars=True).values():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.fill_(0.123)
        load_weights([model], hf_dir)
        got = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        assert got.keys() == expected.keys()
        differ = [k for k in got if not torch.equal(got[k], expected[k])]
        assert not differ, f"{family}: {differ[:5]}"
        checked[family] = len(got)
        ps.destroy_model_parallel()
    dist.shutdown()
    return checked


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF dir, torch_dist dir converted from it)."""
    root = tmp_path_factory.mktemp("hf_weights")
    out = {}
    for family, dtype in (
        ("llama", torch.float32),
        ("qwen2", torch.bfloat16),  # tied embeddings; a bf16 file into an fp32 model: the cast path
        ("qwen3", torch.float32),
        ("qwen3_moe", torch.float32),
        ("mixtral", torch.bfloat16),
        ("qwen2_moe", torch.float32),
        ("deepseek", torch.float32),  # MLA, a dense first layer then MoE layers (per-layer keys)
        ("deepseek_dense", torch.float32),  # MLA with q LoRA, stacked layers
        ("deepseek_v3", torch.float32),  # MLA, sigmoid router with its bias buffer
    ):
        hf_dir = save_tiny_model(family, str(root / family), dtype=dtype, vocab_size=250)  # padded to 256
        convert_hf_to_mcore(hf_dir, str(root / f"{family}-mcore"), progress_stream=None)
        out[family] = (hf_dir, str(root / f"{family}-mcore"))
    return out


def _run(converted, families, parallel_kwargs, dtype=torch.float32):
    cases = [(f, *converted[f]) for f in families]
    results = run_ranks(_compare_rank, 2, cases, parallel_kwargs, dtype, timeout=400)
    for checked in results:
        assert set(checked) == set(families) and all(n > 0 for n in checked.values())


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_tp2_equals_the_converted_checkpoint(converted):
    _run(converted, ["llama", "qwen2", "qwen3", "deepseek_dense"], {"tp": 2})


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_pp2_equals_the_converted_checkpoint(converted):
    _run(converted, ["qwen2", "mixtral", "deepseek"], {"pp": 2})


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_ep2_equals_the_converted_checkpoint(converted):
    _run(converted, ["qwen3_moe", "qwen2_moe", "deepseek_v3"], {"ep": 2})


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_bf16_model_equals_the_converted_checkpoint(converted):
    _run(converted, ["llama", "mixtral"], {"pp": 2}, dtype=torch.bfloat16)


def _peak_rank(rank, hf_dir):
    """Build this rank's TP=2 stage, then load from HF: how far the peak RSS rose over the
    rank's share of the weights (its parameters' bytes)."""
    from armor_megatron.megatron import dist
    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = dist.ParallelConfig(tp=2)
    dist.initialize(parallel, arch)
    model = build_gpt_model(arch, parallel, dtype=torch.float32, use_te=False)
    share = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _status_kib("VmRSS") * 1024
    _reset_peak_rss()
    load_weights([model], hf_dir)
    risen = _status_kib("VmHWM") * 1024 - before
    first = next(model.parameters()).detach().clone()
    dist.shutdown()
    return share, risen, first.abs().sum().item()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_reads_only_its_share(tmp_path):
    """~100 MB of fp32 weights at TP=2: each rank's peak RSS rises by well under half of its
    ~50 MB share while it loads (reading every tensor whole would add the whole model)."""
    hf_dir = save_tiny_model(
        "qwen3",
        str(tmp_path / "qwen3"),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
    )
    # peak RSS: processes of their own
    for share, risen, first_sum in run_ranks(_peak_rank, 2, hf_dir, timeout=280, fresh=True):
        assert share > 40e6 and first_sum > 0
        assert (share + risen) / share <= 1.25, (
            f"peak rose by {risen / 2**20:.1f} MiB over a {share / 2**20:.1f} MiB share"
        )


def test_a_missing_tensor_is_one_line(tmp_path):
    """An HF directory without one of the tensors the model needs: CheckpointError naming it."""
    from safetensors.torch import load_file, save_file

    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.verify import single_process_megatron
    from armor_megatron.models import ModelArch

    hf_dir = save_tiny_model("llama", str(tmp_path / "llama"))
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with single_process_megatron():
        model = build_gpt_model(ModelArch.from_hf_dir(hf_dir), use_te=False)
        with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
            load_weights([model], hf_dir)


def test_boxes_built_as_copies_are_loaded_as_dist_checkpointing_does(tmp_path, monkeypatch):
    """Where a sharded state dict's tensors are copies, not views of the parameters, the loaded
    boxes go through the factories' merges and ``load_state_dict``: the same weights result."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import armor_megatron.megatron.hf_weights as hf_weights
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.verify import single_process_megatron
    from armor_megatron.models import ModelArch

    hf_dir = save_tiny_model("qwen3", str(tmp_path / "qwen3"))
    mcore_dir = str(tmp_path / "mcore")
    convert_hf_to_mcore(hf_dir, mcore_dir, progress_stream=None)
    real = hf_weights.chunks_sharded_state_dict

    def copied(chunks, prefix=""):
        state = real(chunks, prefix)
        for sd in state.values():
            for v in sd.values():
                if isinstance(v, ShardedTensor):
                    v.data = v.data.detach().clone()
        return state

    with single_process_megatron():
        model = build_gpt_model(ModelArch.from_hf_dir(hf_dir), use_te=False)
        hf_weights.load_weights([model], mcore_dir)
        expected = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        monkeypatch.setattr(hf_weights, "chunks_sharded_state_dict", copied)
        hf_weights.load_weights([model], hf_dir)
        got = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
