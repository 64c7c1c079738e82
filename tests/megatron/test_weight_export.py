"""Weight export (Megatron shards -> HF-named full tensors on rank 0) is the converter's inverse,
bit for bit, at every parallel layout and with every expert layout megatron-core builds; it is
what weight sync sends to the rollout engine, so an incomplete export is an error, never a push."""

import os

import pytest
import torch
from safetensors import safe_open

from tests.convert.conftest import save_tiny_model
from tests.megatron.spawn import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def assert_exact(exported: list, expected: dict) -> None:
    """Every HF tensor exactly once (a list keeps duplicates), each equal to the original."""
    assert sorted(name for name, _ in exported) == sorted(expected)
    for name, tensor in exported:
        assert torch.equal(tensor, expected[name]), name


def loaded_model(hf_dir, mcore_dir, layout):
    from armor_megatron.megatron.dist import ParallelConfig, initialize
    from armor_megatron.megatron.model import build_model_chunks
    from armor_megatron.megatron.model_state import load_model_weights
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(**layout)
    initialize(parallel, arch)
    chunks = build_model_chunks(arch, parallel)
    load_model_weights(chunks, mcore_dir)
    return arch, parallel, chunks


def export_worker(rank, hf_dir, mcore_dir, layout):
    from armor_megatron.megatron.weight_export import export_to_list

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, layout)
    return export_to_list(chunks, arch)


@pytest.mark.parametrize(
    "family, layout",
    [
        ("qwen2", dict(tp=2)),
        ("qwen3", dict(tp=2, pp=2)),
        ("mixtral", dict(ep=2)),
        ("mistral", dict(tp=2)),
        ("qwen2_moe", dict(ep=2)),
        ("deepseek_dense", dict(tp=2)),
        ("deepseek_v3", dict(ep=2)),
    ],
    ids=["qwen2-tp2", "qwen3-tp2pp2", "mixtral-ep2", "mistral-tp2", "qwen2_moe-ep2", "deepseek-tp2", "deepseek_v3-ep2"],
)
def test_export_gives_back_every_hf_tensor_exactly(tmp_path, family, layout):
    from armor_megatron.convert import convert_hf_to_mcore

    hf_dir = save_tiny_model(family, str(tmp_path / "hf"))
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    world = layout.get("tp", 1) * layout.get("pp", 1) * max(layout.get("ep", 1), 1)
    exported = run_ranks(export_worker, world, hf_dir, str(tmp_path / "mcore"), layout)[0]
    assert_exact(exported, hf_tensors(hf_dir))


def counted_gathers_worker(rank, hf_dir, mcore_dir, layout):
    """The export, with this rank's data-parallel rank and how many tensor gathers it joined."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from armor_megatron.megatron.weight_export import export_to_list

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, layout)
    calls, gather = [0], dist.gather

    def counted(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    dist.gather = counted
    try:
        exported = export_to_list(chunks, arch)
    finally:
        dist.gather = gather
    return exported, ps.get_data_parallel_rank(), calls[0]


def test_only_the_exporting_replica_gathers_its_shards(tmp_path):
    """TP=2 × DP=2: the export is exact, and the second data-parallel replica's TP group joins no
    gather (it exports nothing), so a sync costs one replica's traffic whatever the DP size."""
    from armor_megatron.convert import convert_hf_to_mcore

    hf_dir = save_tiny_model("qwen2", str(tmp_path / "hf"))
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    results = run_ranks(counted_gathers_worker, 4, hf_dir, str(tmp_path / "mcore"), dict(tp=2))
    assert_exact(results[0][0], hf_tensors(hf_dir))
    gathers = {rank: (dp, calls) for rank, (_, dp, calls) in enumerate(results)}
    assert all(calls > 0 for dp, calls in gathers.values() if dp == 0), gathers
    assert all(calls == 0 for dp, calls in gathers.values() if dp == 1), gathers


def expert_layouts_worker(rank, hf_dir, mcore_dir, layout):
    """The same checkpoint exported from SequentialMLP, TEGroupedMLP-named and GroupedMLP experts;
    with layer 0's expert parameter shapes by name, per layout."""
    from armor_megatron.megatron.model_state import load_model_weights
    from armor_megatron.megatron.weight_export import export_to_list
    from tests.megatron.expert_layouts import build_legacy_grouped_chunks, use_te_grouped_experts

    arch, parallel, chunks = loaded_model(hf_dir, mcore_dir, layout)
    legacy = build_legacy_grouped_chunks(arch, parallel)
    load_model_weights(legacy, mcore_dir)
    exports, expert_params = {}, {}
    for name, model in [("sequential", chunks), ("te_grouped", None), ("legacy_grouped", legacy)]:
        if model is None:
            use_te_grouped_experts(chunks)
            model = chunks
        expert_params[name] = {
            n: tuple(p.shape) for n, p in model[0].named_parameters() if n.startswith("decoder.layers.0.mlp.experts.")
        }
        exports[name] = export_to_list(model, arch)
    return exports, expert_params


@pytest.mark.parametrize(
    "family, layout",
    [("mixtral", dict(ep=2)), ("mixtral", dict(ep=2, etp=2)), ("qwen3_moe", dict(ep=4))],
    ids=["mixtral-ep2-edp2", "mixtral-ep2-etp2", "qwen3_moe-ep4"],
)
def test_every_expert_layout_exports_every_expert_exactly_once(tmp_path, family, layout):
    """4 ranks, 8 experts: at ep=2 the expert-data-parallel replicas (edp=2) must not push twice;
    with etp=2 expert shards are gathered first; at ep=4 each rank holds 2 experts (GroupedMLP
    stacks them in one parameter)."""
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.models import ModelArch

    experts = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}[family]
    hf_dir = save_tiny_model(family, str(tmp_path / "hf"), **{experts: 8})
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    results = run_ranks(expert_layouts_worker, 4, hf_dir, str(tmp_path / "mcore"), layout, timeout=360)
    exports, params = results[0]
    arch = ModelArch.from_hf_dir(hf_dir)
    local, h, f = 8 // layout["ep"], arch.hidden_size, arch.moe_ffn_hidden_size // layout.get("etp", 1)
    prefix = "decoder.layers.0.mlp.experts."
    assert params["sequential"] == {
        **{f"{prefix}local_experts.{j}.linear_fc1.weight": (2 * f, h) for j in range(local)},
        **{f"{prefix}local_experts.{j}.linear_fc2.weight": (h, f) for j in range(local)},
    }
    assert params["te_grouped"] == {
        **{f"{prefix}linear_fc1.weight{j}": (2 * f, h) for j in range(local)},
        **{f"{prefix}linear_fc2.weight{j}": (h, f) for j in range(local)},
    }
    assert params["legacy_grouped"] == {f"{prefix}weight1": (h, local * 2 * f), f"{prefix}weight2": (local * f, h)}
    assert all(r[0] == dict.fromkeys(params) for r in results[1:])
    expected = hf_tensors(hf_dir)
    for exported in exports.values():
        assert_exact(exported, expected)


def broken_export_worker(rank, hf_dir):
    """ep=2 on 2 ranks: export the chunks twice (every rank duplicates), then with a parameter no
    rule knows on rank 1, then with rank 1's last local expert of layer 0 gone (global expert 3
    missing); every rank must raise each time, in lockstep."""
    from armor_megatron.megatron.dist import ParallelConfig, initialize
    from armor_megatron.megatron.model import build_model_chunks
    from armor_megatron.megatron.weight_export import WeightExportError, export_to_list
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(ep=2)
    initialize(parallel, arch)
    chunks = build_model_chunks(arch, parallel)
    errors = {}
    with pytest.raises(WeightExportError) as duplicated:
        export_to_list(chunks + chunks, arch)
    errors["duplicated"] = str(duplicated.value)
    experts = chunks[0].decoder.layers[0].mlp.experts
    if rank == 1:
        experts.register_parameter("stray", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(WeightExportError) as unknown:
        export_to_list(chunks, arch)
    errors["unknown"] = str(unknown.value)
    if rank == 1:
        del experts.stray
    if rank == 1:
        del experts.local_experts[-1]
    with pytest.raises(WeightExportError) as missing:
        export_to_list(chunks, arch)
    errors["missing"] = str(missing.value)
    return errors


def test_missing_or_duplicated_tensors_fail_the_export_on_every_rank(tmp_path):
    from armor_megatron.convert.rules import hf_tensor_names
    from armor_megatron.models import ModelArch

    hf_dir = save_tiny_model("qwen3_moe", str(tmp_path / "hf"))
    total = len(hf_tensor_names(ModelArch.from_hf_dir(hf_dir)))
    expert3 = [f"model.layers.0.mlp.experts.3.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    for errors in run_ranks(broken_export_worker, 2, hf_dir, timeout=200):
        assert errors["missing"].endswith(f"nothing was pushed: 3 missing: {', '.join(expert3)}")
        assert f"{total} duplicated: model.embed_tokens.weight (ranks 0, 0), " in errors["duplicated"]
        assert errors["duplicated"].endswith(f"(+{total - 8} more)")
        assert errors["unknown"].endswith(
            "nothing was pushed: rank 1: decoder.layers.0.mlp.experts.stray: not a Megatron parameter of a qwen3_moe model"
        )


def test_incompleteness_names_missing_duplicated_and_unexpected_names_truncated():
    from armor_megatron.megatron.weight_export import incompleteness

    expected = [f"t{i}" for i in range(20)]
    assert incompleteness(expected, {0: expected[:10], 1: expected[10:]}) is None
    message = incompleteness(expected, {0: expected[:8] + ["t0", "x"], 1: expected[9:10]})
    assert message == (
        "11 missing: t8, t10, t11, t12, t13, t14, t15, t16, … (+3 more); 1 duplicated: t0 (ranks 0, 0); 1 unexpected: x"
    )
    assert incompleteness(expected, {0: expected, 3: ["t5"]}) == "1 duplicated: t5 (ranks 0, 3)"


def duplicated_down_projections_worker(rank, hf_dir, mcore_dir):
    """tp=2 DeepSeek with the MLA down projections whole on both TP ranks, as the TE spec builds
    them (TELinear(parallel_mode="duplicated"); Transformer Engine needs CUDA, so the local spec's
    row shards are replaced by the gathered tensor): the export must be exact. Then one rank's
    down projection gets a shape that is neither: every rank must refuse."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from armor_megatron.megatron.weight_export import WeightExportError, export_to_list

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, dict(tp=2))
    group = ps.get_tensor_model_parallel_group()
    replaced = []
    for layer in chunks[0].decoder.layers:
        attention = layer.self_attention
        for proj in (attention.linear_q_down_proj, attention.linear_kv_down_proj):
            shards = [torch.empty_like(proj.weight) for _ in range(2)]
            dist.all_gather(shards, proj.weight.detach().contiguous(), group=group)
            proj.weight = torch.nn.Parameter(torch.cat(shards))
            replaced.append(tuple(proj.weight.shape))
    exported = export_to_list(chunks, arch)
    proj = chunks[0].decoder.layers[0].self_attention.linear_kv_down_proj
    if rank == 1:
        proj.weight = torch.nn.Parameter(proj.weight[:-1].detach().clone())
    with pytest.raises(WeightExportError) as refused:
        export_to_list(chunks, arch)
    return exported, replaced, str(refused.value)


def test_te_duplicated_mla_down_projections_export_exactly(tmp_path):
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.models import ModelArch

    hf_dir = save_tiny_model("deepseek_dense", str(tmp_path / "hf"))
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    arch = ModelArch.from_hf_dir(hf_dir)
    results = run_ranks(duplicated_down_projections_worker, 2, hf_dir, str(tmp_path / "mcore"), timeout=300)
    assert arch.mla is not None
    h, kv_rows = arch.hidden_size, arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
    for _, replaced, refused in results:
        assert replaced == [(arch.mla.q_lora_rank, h), (kv_rows, h)] * arch.num_layers
        assert refused.endswith(
            f"nothing was pushed: rank 1: decoder.layers.0.self_attention.linear_kv_down_proj.weight: shape "
            f"({kv_rows - 1}, {h}) is neither the tp=2 shard ({kv_rows // 2}, {h}) of "
            f"decoder.layers.self_attention.linear_kv_down_proj.weight nor its whole ({kv_rows}, {h})"
        )
    assert_exact(results[0][0], hf_tensors(hf_dir))


def padded_vocabulary_worker(rank, hf_dir, out_dir):
    """At TP=2 the vocabulary (255 rows) is padded to 256: the export used by weight sync (gathered on
    rank 0) and the HF copy of a checkpoint (`save_hf`, each owner delivering) both cut the padding."""
    from armor_megatron.megatron.dist import ParallelConfig, initialize
    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.model import build_model_chunks, padded_vocab_size
    from armor_megatron.megatron.weight_export import HFWeightExport, export_to_list
    from armor_megatron.models import ModelArch
    from armor_megatron.trainer.hf_save import record_hf_files, save_hf

    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(tp=2)
    initialize(parallel, arch)
    chunks = build_model_chunks(arch, parallel)
    load_weights(chunks, hf_dir)
    rows = dict(chunks[0].named_parameters())["embedding.word_embeddings.weight"].shape[0]
    assert rows * 2 == padded_vocab_size(arch, 2) > arch.vocab_size
    exported = export_to_list(chunks, arch)
    if rank == 0:
        record_hf_files(hf_dir, out_dir)
    torch.distributed.barrier()
    saved = save_hf(HFWeightExport(chunks, arch), out_dir, step=1)
    return exported, saved


def test_a_vocabulary_tp_does_not_divide_exports_at_the_hf_size(tmp_path):
    hf_dir = save_tiny_model("qwen2", str(tmp_path / "hf"), vocab_size=255, tie_word_embeddings=False)
    exported, saved = run_ranks(padded_vocabulary_worker, 2, hf_dir, str(tmp_path / "run"), timeout=300)[0]
    expected = hf_tensors(hf_dir)
    assert expected["model.embed_tokens.weight"].shape[0] == expected["lm_head.weight"].shape[0] == 255
    assert_exact(exported, expected)
    from safetensors.torch import load_file

    files = [f for f in sorted(os.listdir(saved)) if f.endswith(".safetensors")]
    assert_exact([pair for f in files for pair in load_file(os.path.join(saved, f)).items()], expected)
