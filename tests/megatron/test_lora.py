"""LoRA adapters on megatron's TP linears (`megatron.lora`).

In one process (TP=1): B = 0 gives the base model's log-probs exactly; only adapters train
(no gradient buffer, master copy or Adam state for the base) and they raise the log-probs of
responses with a positive advantage; the fused QKV / gated fc1 adapters
equal HF PEFT's per-projection adapters (checked against a hand-made merged weight); the reference
is the same model with the adapters off; a reset merges and leaves the policy unchanged. A
checkpoint holds the base only once a reset has merged into it (before: the adapters, and the HF
directory the base is read from again, refused if it changed).

In a 2-rank gloo job: TP=2, PP=2 and VPP (pp=2, vpp=2) log-probs, adapter gradients and merged
weight exports (the padded vocabulary cut to the HF one) equal the TP=1 ones on the same base and
adapters (fp32), and a TP=2 checkpoint's adapters load at PP=2; an MoE model's attention adapters
(experts frozen) at ep=2 likewise; B = 0 is the base and a reset keeps the policy in every layout.
The merged export, saved as safetensors, loads in transformers with the trainer's log-probs, and
so does the PEFT adapter directory on the base in HF PEFT; the reference's export is the base
checkpoint exactly; ``armor-convert`` refuses a LoRA training checkpoint in one line.
"""

import dataclasses
import json
import zlib

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import _positive_mean, make_batch, settings
from tests.megatron.test_parallel_logprobs import QWEN2, QWEN3_MOE

# GQA (4 heads, 2 groups), q/k/v bias; vocabulary 125, padded to 128 (the export cuts the padding at any TP)
ARCH = QWEN2
DEEP = dataclasses.replace(QWEN2, num_layers=4)  # two layers per virtual pipeline stage at pp=2, vpp=2

LOSS = PolicyLossConfig(alpha=0.9, eps_low=0.2, eps_high=0.28)
OPTIM = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1e9)


def _lora(**kw):
    from armor_megatron.megatron.lora import LoRASettings

    return LoRASettings(**{"rank": 4, "alpha": 8.0, "seed": 3, **kw})


def _actor(parallel=ParallelConfig(), lora=None, dtype="float32", arch=ARCH):
    from armor_megatron.megatron.actor import MegatronActor

    return MegatronActor(
        settings(arch, parallel, dtype=dtype), optimizer=OPTIM, loss=LOSS, total_steps=10, seed=5, lora=lora
    )


def _lp(model, batch):
    return model.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs


def _full_b(layer: int, target: str, proj: str, shape) -> torch.Tensor:
    """A non-zero B, the same in every layout (drawn at its full shape from a key of its own)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{layer}/{target}/{proj}".encode()))
    return torch.randn(*shape, generator=g) * 0.3


@torch.no_grad()
def _set_nonzero_b(actor) -> None:
    """Every B set to `_full_b`, this rank taking its TP shard of the split ones (column-parallel)."""
    from armor_megatron.megatron.lora import adapters_of

    for _, _, a in adapters_of(actor.model_chunks):
        for proj, b in a.B.items():
            rows = b.shape[0] * (a.tp_size if a.column else 1)
            full = _full_b(a.layer, a.target, proj, (rows, a.rank))
            b.copy_(full[a.tp_rank * b.shape[0] : (a.tp_rank + 1) * b.shape[0]] if a.column else full)


def _train_batch(actor, batch):
    lp = _lp(actor, batch)
    return {**batch, "old_logprobs": lp - 0.05, "ref_logprobs": lp}


# ----------------------------------------------------------------------------- one process
def test_b_zero_is_the_base_model_exactly_and_only_adapters_train(world_of_one):
    from armor_megatron.megatron.lora import adapters_of

    batch = make_batch()
    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    base = _actor()
    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    adapted = _actor(lora=_lora())
    assert torch.equal(_lp(adapted, batch), _lp(base, batch))

    adapters = adapters_of(adapted.model_chunks)
    assert len(adapters) == 4 * ARCH.num_layers
    trained = [p for c in adapted.model_chunks for p in c.parameters() if p.requires_grad]
    assert {id(p) for p in trained} == {id(p) for _, _, a in adapters for p in a.parameters()}
    in_optimizer = [p for g in adapted.optimizer.param_groups for p in g["params"]]
    assert len(in_optimizer) == len(trained)
    ddp_numel = sum(b.grad_data.numel() for d in adapted.ddp_chunks for b in d.buffers)
    assert ddp_numel >= sum(p.numel() for p in trained)
    assert ddp_numel < sum(p.numel() for c in adapted.model_chunks for p in c.parameters()) / 4
    frozen = dict(adapted.model_chunks[0].named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
    before = frozen.detach().clone()
    start = _lp(adapted, batch)
    train = _train_batch(adapted, batch)
    for _ in range(3):
        assert adapted.train_step(train)["grad_norm"] > 0
    assert torch.equal(frozen, before)
    # the adapters learn: responses with a positive advantage became more likely
    assert _positive_mean(_lp(adapted, batch), batch) > _positive_mean(start, batch) + 0.05
    assert all(not torch.equal(a.B[p], torch.zeros_like(a.B[p])) for _, _, a in adapters for p in a.B)


def test_fused_qkv_and_gated_fc1_adapters_are_peft_per_projection_adapters(world_of_one):
    """The merged QKV weight is the base plus s·B_p·A_p of q, k and v, each placed on its rows of
    every query group (q heads of the group, then its k head, then its v head); fc1 is [gate; up]."""
    from armor_megatron.megatron.lora import adapters_of, merge_adapters

    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    actor = _actor(lora=_lora())
    _set_nonzero_b(actor)
    batch = make_batch()
    lp = _lp(actor, batch)
    params = dict(actor.model_chunks[0].named_parameters())
    qkv, fc1 = (
        params[f"decoder.layers.1.{n}.weight"].detach().clone() for n in ("self_attention.linear_qkv", "mlp.linear_fc1")
    )
    ad = {(a.layer, a.target): a for _, _, a in adapters_of(actor.model_chunks)}
    s, d, groups = 2.0, ARCH.head_dim, ARCH.num_key_value_heads
    per_group = ARCH.num_attention_heads // groups
    delta = {p: s * ad[1, "linear_qkv"].B[p] @ ad[1, "linear_qkv"].A[p] for p in ("q_proj", "k_proj", "v_proj")}
    expected_qkv = qkv.clone()
    for g in range(groups):
        row = g * (per_group + 2) * d
        expected_qkv[row : row + per_group * d] += delta["q_proj"][g * per_group * d : (g + 1) * per_group * d]
        expected_qkv[row + per_group * d : row + (per_group + 1) * d] += delta["k_proj"][g * d : (g + 1) * d]
        expected_qkv[row + (per_group + 1) * d : row + (per_group + 2) * d] += delta["v_proj"][g * d : (g + 1) * d]
    f = ARCH.ffn_hidden_size
    a = ad[1, "linear_fc1"]
    expected_fc1 = fc1 + s * torch.cat([a.B["gate_proj"] @ a.A["gate_proj"], a.B["up_proj"] @ a.A["up_proj"]])
    assert a.B["gate_proj"].shape == (f, 4)

    merge_adapters(actor.model_chunks, generation=1)
    torch.testing.assert_close(
        params["decoder.layers.1.self_attention.linear_qkv.weight"], expected_qkv, rtol=0, atol=1e-6
    )
    torch.testing.assert_close(params["decoder.layers.1.mlp.linear_fc1.weight"], expected_fc1, rtol=0, atol=1e-6)
    assert all(torch.equal(b, torch.zeros_like(b)) for _, _, x in adapters_of(actor.model_chunks) for b in x.B.values())
    torch.testing.assert_close(_lp(actor, batch), lp, rtol=0, atol=2e-5)  # merged base + B = 0 is the same policy


@pytest.mark.parametrize("dtype, atol", [("float32", 2e-6), ("bfloat16", 0.03)])  # measured: 4.8e-7, 5.0e-3
def test_reference_is_the_base_and_a_reset_makes_it_the_policy(world_of_one, dtype, atol):
    from armor_megatron.megatron.lora import LoRAReference

    batch = make_batch()
    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    base_lp = _lp(_actor(dtype=dtype), batch)
    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    actor = _actor(lora=_lora(), dtype=dtype)
    reference = LoRAReference(actor)
    _set_nonzero_b(actor)
    actor.optimizer.reload_model_params()
    actor.train_step(_train_batch(actor, batch))  # Adam state for the adapters
    policy = _lp(actor, batch)
    assert torch.equal(_lp(reference, batch), base_lp)  # adapters off: the base, bit for bit
    assert (policy - base_lp).abs().max() > 0.05

    reference.reset_from(actor)
    torch.testing.assert_close(_lp(actor, batch), policy, rtol=0, atol=atol)
    torch.testing.assert_close(_lp(reference, batch), policy, rtol=0, atol=atol)
    assert not actor.has_optimizer_state  # new adapters, new Adam moments
    actor.train_step(_train_batch(actor, batch))  # and they train
    assert (_lp(actor, batch) - _lp(reference, batch)).abs().max() > 0


# ----------------------------------------------------------------------------- TP=2, PP=2 parity
def _adapter_grads_and_values(actor) -> dict:
    """{(layer, target, A|B, proj): (full value, full grad)} of every adapter, gathered over TP and PP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from armor_megatron.megatron.lora import adapters_of

    local = {}
    for _, _, a in adapters_of(actor.model_chunks):
        for kind, params in (("A", a.A), ("B", a.B)):
            split = (kind == "B") == a.column
            for proj, p in params.items():
                pair = [p.detach(), p.main_grad.detach().to(p.dtype)]
                if split and a.tp_size > 1:
                    axis = 0 if a.column else 1
                    for i, t in enumerate(pair):
                        parts = [torch.empty_like(t) for _ in range(a.tp_size)]
                        dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
                        pair[i] = torch.cat(parts, dim=axis)
                local[(a.layer, a.target, kind, proj)] = tuple(pair)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {k: v for g in gathered for k, v in g.items()}


def parity_worker(rank, root):
    from armor_megatron.megatron.checkpoint import load_checkpoint, save_checkpoint
    from armor_megatron.megatron.weight_export import export_to_list

    mdist.initialize(ParallelConfig(), ARCH, seed=5)
    out = {}
    try:
        batch = make_batch()
        for name, layout in (("tp1", ParallelConfig()), ("tp2", ParallelConfig(tp=2)), ("pp2", ParallelConfig(pp=2))):
            mdist.set_model_parallel(layout, ARCH, seed=5)
            actor = _actor(layout, lora=_lora())
            if name == "tp1":
                save_checkpoint(f"{root}/base", 0, actor, None, {})  # one base for every layout
            else:
                actor.load_weights(f"{root}/base")
            _set_nonzero_b(actor)
            lp = _lp(actor, batch)
            merged = export_to_list(actor.model_chunks, ARCH)  # gathered on rank 0, merged on each shard's rank
            train = {**batch, "old_logprobs": lp.detach() - 0.05, "ref_logprobs": lp.detach()}
            actor.train_step(train)  # the step's gradients stay in main_grad
            out[name] = (lp, _adapter_grads_and_values(actor), merged)
            if name == "tp2":  # adapters and their Adam moments saved at TP=2 ...
                save_checkpoint(f"{root}/trained", 1, actor, None, {})
                out["tp2_after"] = _lp(actor, batch)
        # ... resume at PP=2 (TP=1): the same policy and the same next step
        resumed = _actor(ParallelConfig(pp=2), lora=_lora())
        load_checkpoint(f"{root}/trained", resumed, None)
        out["resumed"] = _lp(resumed, batch)
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_and_pp2_adapters_equal_the_unsharded_ones(tmp_path):
    out = run_ranks(parity_worker, 2, str(tmp_path), timeout=280)[0]
    lp1, ref, merged1 = out["tp1"]
    assert len(ref) == 2 * ARCH.num_layers * (3 + 1 + 2 + 1)
    for name in ("tp2", "pp2"):
        lp, got, merged = out[name]
        torch.testing.assert_close(lp, lp1, rtol=0, atol=1e-5)
        assert [n for n, _ in merged] != [] and dict(merged).keys() == dict(merged1).keys()
        for key, tensor in merged:
            torch.testing.assert_close(tensor, dict(merged1)[key], rtol=0, atol=1e-6, msg=f"{name} export {key}")
        assert got.keys() == ref.keys()
        for key, (value, grad) in got.items():
            # values after one Adam step from the same start: equal gradients give equal steps
            torch.testing.assert_close(grad, ref[key][1], rtol=1e-4, atol=1e-6, msg=f"{name} grad {key}")
            torch.testing.assert_close(value, ref[key][0], rtol=1e-4, atol=1e-5, msg=f"{name} value {key}")
    # a TP=2 checkpoint's adapters reshard: loaded at PP=2 they give the TP=2 policy
    assert (out["tp2_after"] - lp1).abs().max() > 1e-3
    torch.testing.assert_close(out["resumed"], out["tp2_after"], rtol=0, atol=1e-5)


def vpp_and_moe_worker(rank, root):
    """Per (model, layout): log-probs of B = 0 and of the base, then with non-zero B: log-probs,
    merged export, adapter values and gradients of one step, and log-probs before and after a reset."""
    from armor_megatron.megatron.checkpoint import save_checkpoint
    from armor_megatron.megatron.lora import LoRAReference
    from armor_megatron.megatron.weight_export import export_to_list

    attention = ("linear_qkv", "linear_proj")  # an MoE model's MLP is its experts: no adapters
    cases = (
        ("dense", DEEP, _lora(), (("tp1", ParallelConfig()), ("pp2vpp2", ParallelConfig(pp=2, vpp=2)))),
        ("moe", QWEN3_MOE, _lora(targets=attention), (("tp1", ParallelConfig()), ("ep2", ParallelConfig(ep=2)))),
    )
    mdist.initialize(ParallelConfig(), DEEP, seed=5)
    out = {}
    try:
        batch = make_batch()
        for model, arch, lora, layouts in cases:
            for name, layout in layouts:
                mdist.set_model_parallel(layout, arch, seed=5)
                actor = _actor(layout, lora=lora, arch=arch)
                if name == "tp1":
                    save_checkpoint(f"{root}/{model}", 0, actor, None, {})  # one base for every layout
                else:
                    actor.load_weights(f"{root}/{model}")
                reference = LoRAReference(actor)
                b_zero, base = _lp(actor, batch), _lp(reference, batch)
                _set_nonzero_b(actor)
                lp = _lp(actor, batch)
                merged = export_to_list(actor.model_chunks, arch)
                actor.train_step({**batch, "old_logprobs": lp - 0.05, "ref_logprobs": lp})
                trained = _lp(actor, batch)
                grads = _adapter_grads_and_values(actor)
                reference.reset_from(actor)
                after_reset = {"after_reset": _lp(actor, batch), "reference_after_reset": _lp(reference, batch)}
                out[model, name] = dict(b_zero=b_zero, base=base, lp=lp, merged=merged, grads=grads, trained=trained)
                out[model, name].update(after_reset)
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vpp_and_moe_attention_adapters(tmp_path):
    """VPP (pp=2, vpp=2: two model chunks per rank) and an MoE model's attention adapters (experts
    frozen, at ep=2): B = 0 is the base bit for bit, log-probs, merged exports and one step's adapter
    gradients equal TP=1's, and a reset merge keeps the policy."""
    out = run_ranks(vpp_and_moe_worker, 2, str(tmp_path), timeout=280)[0]
    for model, layout in (("dense", "pp2vpp2"), ("moe", "ep2")):
        one, got = out[model, "tp1"], out[model, layout]
        assert len(one["grads"]) == 2 * (DEEP.num_layers * 7 if model == "dense" else QWEN3_MOE.num_layers * 4)
        for case in (one, got):
            assert torch.equal(case["b_zero"], case["base"])
            assert (case["lp"] - case["base"]).abs().max() > 1e-3  # the adapters matter
            torch.testing.assert_close(case["after_reset"], case["trained"], rtol=0, atol=2e-6)
            torch.testing.assert_close(case["reference_after_reset"], case["trained"], rtol=0, atol=2e-6)
        torch.testing.assert_close(got["base"], one["base"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["lp"], one["lp"], rtol=0, atol=1e-5)
        assert dict(got["merged"]).keys() == dict(one["merged"]).keys()
        for key, tensor in got["merged"]:
            torch.testing.assert_close(tensor, dict(one["merged"])[key], rtol=0, atol=1e-6, msg=f"{model} export {key}")
        # gradients, not the values after the step: Adam's first step is ±lr wherever a gradient is
        # non-zero, so a near-zero entry whose rounding differs between layouts moves by up to 2·lr
        assert got["grads"].keys() == one["grads"].keys()
        for key, (_, grad) in got["grads"].items():
            torch.testing.assert_close(grad, one["grads"][key][1], rtol=1e-4, atol=1e-6, msg=f"{model} grad {key}")


# ----------------------------------------------------------------------------- export
def test_merged_and_peft_exports_give_the_policys_logprobs_and_the_reference_exports_the_base(
    world_of_one, tmp_path, capsys
):
    """The policy's export (W + s·B·A per weight) saved as safetensors loads in transformers with
    the trainer's log-probs, so does the PEFT adapter directory on the base; the reference's export
    is the base HF checkpoint bit for bit; the converter refuses the LoRA checkpoint."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    from armor_megatron.megatron.lora import LoRAReference, export_chunks
    from armor_megatron.megatron.weight_export import export_to_list
    from armor_megatron.models.arch import ModelArch
    from tests.convert.conftest import save_tiny_model
    from tests.megatron.test_weight_export import assert_exact, hf_tensors

    hf_dir = save_tiny_model("qwen2", str(tmp_path / "hf"))
    arch = ModelArch.from_hf_dir(hf_dir)
    mdist.set_model_parallel(ParallelConfig(), arch, seed=5)
    from armor_megatron.megatron.actor import MegatronActor

    actor = MegatronActor(settings(arch, ParallelConfig()), optimizer=OPTIM, loss=LOSS, total_steps=10, lora=_lora())
    actor.load_weights(hf_dir)
    _set_nonzero_b(actor)
    reference = LoRAReference(actor)

    assert_exact(export_to_list(export_chunks(reference), arch), hf_tensors(hf_dir))
    merged = dict(export_to_list(export_chunks(actor), arch))
    assert merged.keys() == hf_tensors(hf_dir).keys()
    out = tmp_path / "merged"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"))
    shutil.copy(tmp_path / "hf" / "config.json", out / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, arch.vocab_size, (3, 10), generator=g)
    lengths = torch.tensor([10, 10, 10])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    hf_lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    ours = actor.compute_logprobs(ids, lengths).logprobs[:, 1:]
    torch.testing.assert_close(ours, hf_lp, rtol=0, atol=1e-4)
    base_lp = reference.compute_logprobs(ids, lengths).logprobs[:, 1:]
    assert (ours - base_lp).abs().max() > 0.05  # the adapters matter: the merge is not the base

    # the adapters alone as an HF PEFT directory, on the base: the same policy
    import peft

    from armor_megatron.megatron.lora import save_peft_adapter

    save_peft_adapter(actor.model_chunks, _lora(), str(tmp_path / "adapter"), base=hf_dir)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
        peft_logits = peft_model(input_ids=ids).logits
    peft_lp = torch.log_softmax(peft_logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(peft_lp, ours, rtol=0, atol=1e-4)

    # the converter refuses a LoRA checkpoint in one line rather than write its base without the adapters
    from armor_megatron.cli.convert import main as convert
    from armor_megatron.megatron.checkpoint import save_checkpoint

    save_checkpoint(str(tmp_path / "ckpt"), 1, actor, reference, {})
    capsys.readouterr()  # what transformers printed above
    code = convert(
        ["mcore-to-hf", str(tmp_path / "ckpt" / "iter_0000001"), str(tmp_path / "converted"), "--hf-config", hf_dir]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "holds LoRA adapters" in err, err
    assert not (tmp_path / "converted").exists()

    # armor-convert lora-to-peft: the checkpoint's adapters as the same PEFT directory, from its files alone
    from safetensors.torch import load_file

    assert convert(["lora-to-peft", str(tmp_path / "ckpt"), str(tmp_path / "from_ckpt")]) == 0
    assert "for the base " + hf_dir in capsys.readouterr().out
    written, ours_dir = load_file(str(tmp_path / "from_ckpt" / "adapter_model.safetensors")), tmp_path / "adapter"
    assert_exact(list(written.items()), load_file(str(ours_dir / "adapter_model.safetensors")))
    config = json.loads((tmp_path / "from_ckpt" / "adapter_config.json").read_text())
    assert config == json.loads((ours_dir / "adapter_config.json").read_text())
    with torch.no_grad():
        base_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "from_ckpt")).eval()
        loaded_logits = loaded(input_ids=ids).logits
    loaded_lp = torch.log_softmax(loaded_logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(loaded_lp, ours, rtol=0, atol=1e-4)
    assert convert(["lora-to-peft", str(tmp_path / "ckpt"), str(tmp_path / "from_ckpt")]) == 2  # no overwrite
    assert "from_ckpt exists; pass --overwrite" in capsys.readouterr().err


# ----------------------------------------------------------------------------- checkpoints
def _stored_tensor_keys(path) -> set:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from armor_megatron.convert.dcp_safety import read_metadata

    stored = read_metadata(str(path)).state_dict_metadata
    return {k for k, v in stored.items() if isinstance(v, TensorStorageMetadata)}


def _bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_checkpoint_holds_the_base_only_once_a_reset_merged_into_it(world_of_one, tmp_path, capsys):
    """Before the first reset a checkpoint holds the adapters and their Adam state, and records the
    HF directory the base came from; loading it reads the base from there (into an actor built on
    other weights) and gives the same policy and the same next step, bit for bit. After a reset the
    checkpoint holds the merged base and loads as exactly. A changed or missing base is refused in
    one line, and so are converting either checkpoint and starting from the first."""
    import shutil

    from safetensors.torch import load_file, save_file

    from armor_megatron.cli.convert import main as convert
    from armor_megatron.errors import UserInputError
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.checkpoint import load_checkpoint, save_checkpoint
    from armor_megatron.megatron.lora import LoRAReference
    from armor_megatron.models.arch import ModelArch
    from tests.convert.conftest import save_tiny_model

    hf_dir = save_tiny_model("qwen2", str(tmp_path / "hf"))
    arch = ModelArch.from_hf_dir(hf_dir)

    def adapted(seed):  # the base is drawn from `seed` until weights are loaded
        mdist.set_model_parallel(ParallelConfig(), arch, seed=seed)
        one_micro_batch = settings(arch, ParallelConfig(), micro_batch_size=8)
        actor = MegatronActor(one_micro_batch, optimizer=OPTIM, loss=LOSS, total_steps=10, seed=seed, lora=_lora())
        return actor, LoRAReference(actor)

    batch = make_batch()
    actor, reference = adapted(5)
    actor.load_weights(hf_dir)
    actor.train_step(_train_batch(actor, batch))  # non-zero B and Adam moments
    root = tmp_path / "ckpt"
    adapters_only = save_checkpoint(str(root), 1, actor, reference, {"step": 1})
    stored = _stored_tensor_keys(adapters_only)
    assert stored and all(".lora." in k for k in stored), sorted(stored)[:5]

    resumed, resumed_reference = adapted(6)
    assert not torch.equal(_lp(resumed, batch), _lp(actor, batch))
    assert load_checkpoint(str(root), resumed, resumed_reference) == (1, {"step": 1})
    assert torch.equal(_lp(resumed, batch), _lp(actor, batch))
    assert torch.equal(_lp(resumed_reference, batch), _lp(reference, batch))  # the base, read from hf_dir
    train = _train_batch(actor, batch)
    for model in (actor, resumed):
        model.train_step(train)
    assert torch.equal(_lp(resumed, batch), _lp(actor, batch))  # Adam's moments came back too

    # after a reset the base is the merge: the checkpoint holds it, and needs nothing else
    reference.reset_from(actor)
    actor.train_step(_train_batch(actor, batch))
    with_base = save_checkpoint(str(root), 2, actor, reference, {"step": 2})
    assert "embedding.word_embeddings.weight" in _stored_tensor_keys(with_base)
    resumed.load_weights(hf_dir)  # the base it reads will not do: this checkpoint holds its own
    load_checkpoint(with_base, resumed, resumed_reference)
    assert torch.equal(_lp(resumed, batch), _lp(actor, batch))
    assert torch.equal(_lp(resumed_reference, batch), _lp(reference, batch))
    train = _train_batch(actor, batch)
    for model in (actor, resumed):
        model.train_step(train)
    assert torch.equal(_lp(resumed, batch), _lp(actor, batch))
    # the same state but for the base: the base's bytes (fp32) are what the first checkpoint left out
    base_bytes = 4 * sum(p.numel() for c in actor.model_chunks for p in c.parameters() if not p.requires_grad)
    sizes = (_bytes(root / "iter_0000001"), _bytes(root / "iter_0000002"))
    print(f"checkpoint bytes: adapters {sizes[0]}, with the base {sizes[1]}, the base's parameters {base_bytes}")
    assert base_bytes <= sizes[1] - sizes[0] < 1.25 * base_bytes  # and the metadata of its tensors

    # armor-convert refuses both in one line, saying what each holds
    capsys.readouterr()
    for path, says in ((adapters_only, "without their base"), (with_base, "which converting would drop")):
        code = convert(["mcore-to-hf", path, str(tmp_path / "converted"), "--hf-config", hf_dir])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "holds LoRA adapters" in err and says in err, err
    # and an adapter of the merged base, which no HF directory holds
    assert convert(["lora-to-peft", with_base, str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds the base a reference reset merged" in err and "save_hf" in err, err
    assert not (tmp_path / "peft").exists()

    # as starting weights (model.mcore_path) it has no base to give
    with pytest.raises(UserInputError, match="holds LoRA adapters without their base"):
        resumed.load_weights(adapters_only)

    # the base of the first checkpoint changed, then gone: refused in one line
    weights = load_file(f"{hf_dir}/model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    for says in ("model.safetensors changed since the checkpoint was written", f"{hf_dir} is gone"):
        with pytest.raises(UserInputError, match="holds LoRA adapters, not their base") as refused:
            load_checkpoint(adapters_only, resumed, resumed_reference)
        assert says in str(refused.value) and "\n" not in str(refused.value), refused.value
        shutil.rmtree(hf_dir, ignore_errors=True)
