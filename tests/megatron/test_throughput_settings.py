"""``throughput.*`` and ``moe.*`` reach megatron: the TransformerConfig and DDP config carry them,
CPU processes refuse GPU-only kernels in one line, and a tiny MoE model trains at EP=2 with a
capacity factor and with either dispatcher (one 2-rank gloo job).

The dispatcher check feeds rows of one length, so every micro-batch has one shape on both
expert-parallel ranks: allgather needs that (the trainer pads each micro-batch to its own
length, which is why ``--check`` refuses allgather at ep > 1).
"""

import dataclasses

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.config.load import load_config
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.model import MoESettings, Throughput, transformer_config_from_arch
from armor_megatron.models.families.deepseek import LatentAttention
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import settings
from tests.megatron.test_parallel_logprobs import QWEN3, QWEN3_MOE

TINY_MLA = LatentAttention(q_lora_rank=0, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8)

LOSS = PolicyLossConfig(alpha=0.9, eps_low=0.2, eps_high=0.28)
OPTIM = OptimizerConfig(lr=5e-3, weight_decay=0.01, clip_grad=1.0, skip_grad_norm_ratio=10.0)


def test_transformer_config_carries_the_moe_settings():
    moe = MoESettings(
        load_balancing_type="global_aux_loss",
        token_dispatcher_type="alltoall",
        router_dtype="fp64",
        expert_capacity_factor=1.5,
        token_drop_policy="position",
        pad_expert_input_to_capacity=True,
    )
    config = transformer_config_from_arch(QWEN3_MOE, use_te=False, moe=moe)
    assert config.moe_router_load_balancing_type == "global_aux_loss" and config.moe_aux_loss_coeff == 0.0
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_router_dtype == "fp64"
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_token_drop_policy == "position"
    assert config.moe_pad_expert_input_to_capacity and config.variable_seq_lengths
    allgather = transformer_config_from_arch(
        QWEN3_MOE, use_te=False, moe=MoESettings(token_dispatcher_type="allgather")
    )
    assert allgather.moe_token_dispatcher_type == "allgather" and not allgather.variable_seq_lengths
    default = transformer_config_from_arch(QWEN3_MOE, use_te=False)
    assert default.moe_router_dtype == "fp32" and default.moe_expert_capacity_factor is None
    assert default.moe_router_load_balancing_type == "none"
    dense = transformer_config_from_arch(QWEN3, use_te=False, moe=MoESettings(token_dispatcher_type="allgather"))
    assert dense.num_moe_experts is None and dense.variable_seq_lengths  # no experts: nothing to dispatch


def test_family_default_balancing_and_the_run_config_path():
    deepseek = dataclasses.replace(QWEN3_MOE, family="deepseek", mla=TINY_MLA)
    assert MoESettings(aux_loss_coeff=0.01).balancing_type(deepseek) == "seq_aux_loss"
    assert MoESettings(aux_loss_coeff=0.01).balancing_type(QWEN3_MOE) == "aux_loss"
    assert MoESettings().balancing_type(QWEN3_MOE) == "none"
    assert MoESettings(aux_loss_coeff=0.01, load_balancing_type="none").balancing_type(deepseek) == "none"
    cfg = load_config("configs/qwen3_30b_a3b_moe_armor.yaml", ["moe.expert_capacity_factor=2.0"])
    assert MoESettings.of(cfg.moe) == MoESettings(expert_capacity_factor=2.0)
    assert Throughput.of(cfg.throughput) == Throughput(overlap_grad_reduce=True)


def test_the_trainer_refuses_sinkhorn():
    aux = MoESettings(aux_loss_coeff=1e-3)
    assert transformer_config_from_arch(QWEN3_MOE, use_te=False, moe=aux).moe_aux_loss_coeff == 1e-3
    with pytest.raises(ValueError, match=r"^moe\.load_balancing_type sinkhorn routes differently"):
        transformer_config_from_arch(
            QWEN3_MOE, use_te=False, moe=MoESettings(load_balancing_type="sinkhorn"), calculate_per_token_loss=True
        )


@pytest.mark.parametrize(
    "moe, message",
    [
        (MoESettings(token_dispatcher_type="flex"), r"^moe\.token_dispatcher_type flex needs DeepEP"),
        (MoESettings(expert_capacity_factor=0.0), r"^moe\.expert_capacity_factor 0\.0 must be > 0"),
        (MoESettings(pad_expert_input_to_capacity=True), r"^moe\.pad_expert_input_to_capacity needs"),
        (MoESettings(router_dtype="bf16"), r"^moe\.router_dtype 'bf16' is not fp32, fp64 or None$"),
        (MoESettings(aux_loss_coeff=-1.0), r"^moe\.aux_loss_coeff -1\.0 must be >= 0$"),
        (
            MoESettings(load_balancing_type="sinkhorn", expert_capacity_factor=1.0),
            r"^moe\.expert_capacity_factor does not work with load_balancing_type sinkhorn$",
        ),
    ],
)
def test_bad_moe_settings_raise_one_line(moe, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_from_arch(QWEN3_MOE, use_te=False, moe=moe)


def test_fusions_follow_the_spec_and_cpu_refuses_gpu_kernels():
    local = transformer_config_from_arch(QWEN3, use_te=False)
    assert not (local.apply_rope_fusion or local.bias_activation_fusion or local.bias_dropout_fusion)
    assert not local.gradient_accumulation_fusion
    # what the TE spec gets (TransformerConfig's own checks of TE's presence are not reached here)
    assert Throughput().config_kwargs(QWEN3, use_te=True, on_gpu=True) == dict(
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=True,
        bias_activation_fusion=True,
        bias_dropout_fusion=False,
    )
    off = Throughput(apply_rope_fusion=False, bias_dropout_fusion=True).config_kwargs(QWEN3, use_te=True, on_gpu=True)
    assert not off["apply_rope_fusion"] and off["bias_dropout_fusion"] and off["bias_activation_fusion"]
    mla = dataclasses.replace(QWEN3_MOE, family="deepseek", mla=TINY_MLA)
    assert mla.is_mla and not Throughput().config_kwargs(mla, use_te=True, on_gpu=True)["apply_rope_fusion"]
    with pytest.raises(ValueError, match=r"^throughput\.gradient_accumulation_fusion needs CUDA; this process has no"):
        transformer_config_from_arch(QWEN3, use_te=False, throughput=Throughput(gradient_accumulation_fusion=True))
    with pytest.raises(ValueError, match=r"^throughput\.gradient_accumulation_fusion needs APEX"):
        Throughput(gradient_accumulation_fusion=True).config_kwargs(QWEN3, use_te=True, on_gpu=True)
    for key in ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion"):
        with pytest.raises(ValueError, match=rf"^throughput\.{key} needs the Transformer Engine spec"):
            transformer_config_from_arch(QWEN3, use_te=False, throughput=Throughput(**{key: True}))


# ----------------------------------------------------------------------------- 2-rank job
def _batch(arch, rows=8, length=12):
    """`rows` rows of one `length`: a 4-token prompt, then the response."""
    g = torch.Generator().manual_seed(11)
    t = torch.arange(length)[None]
    lengths = torch.full((rows,), length)
    return dict(
        input_ids=torch.randint(0, arch.vocab_size, (rows, length), generator=g),
        lengths=lengths,
        response_mask=(t >= 4) & (t < lengths[:, None]),
        advantages=torch.linspace(-1.0, 1.0, rows),
    )


def _actor(arch, parallel, **kwargs):
    from armor_megatron.megatron.actor import MegatronActor

    return MegatronActor(settings(arch, parallel, **kwargs), optimizer=OPTIM, loss=LOSS, total_steps=10, seed=5)


def _on_policy_step(actor, batch):
    lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs
    metrics = actor.train_step({**batch, "old_logprobs": lp, "ref_logprobs": lp})
    params = torch.cat([p.detach().flatten() for c in actor.model_chunks for p in c.parameters()])
    return metrics["loss"], metrics["grad_norm"], params


def worker(rank, root):
    out = {}
    ep2 = ParallelConfig(ep=2)
    mdist.initialize(ep2, QWEN3_MOE, seed=5)
    try:
        from armor_megatron.megatron.checkpoint import save_checkpoint

        batch = _batch(QWEN3_MOE)
        first = _actor(QWEN3_MOE, ep2)
        save_checkpoint(f"{root}/moe", 0, first, None, {})  # one set of weights for every variant
        for name, moe in {
            "dropless": MoESettings(),
            "alltoall": MoESettings(expert_capacity_factor=0.5),
            "allgather": MoESettings(token_dispatcher_type="allgather", expert_capacity_factor=0.5),
        }.items():
            actor = _actor(QWEN3_MOE, ep2, moe=moe)
            actor.load_weights(f"{root}/moe")
            config = actor.model_chunks[0].config
            out[f"{name}_config"] = (config.moe_token_dispatcher_type, config.moe_expert_capacity_factor)
            out[name] = _on_policy_step(actor, batch)

        # overlap_grad_reduce at DP=2 (dense): same update as reducing after backward
        dp2 = ParallelConfig()
        mdist.set_model_parallel(dp2, QWEN3, seed=5)
        batch = _batch(QWEN3)
        for name, th in {"reduce_after": Throughput(), "overlap": Throughput(overlap_grad_reduce=True)}.items():
            actor = _actor(QWEN3, dp2, throughput=th)
            out[f"{name}_ddp"] = tuple(
                (c.ddp_config.overlap_grad_reduce, c.ddp_config.overlap_param_gather) for c in actor.ddp_chunks
            )
            out[name] = _on_policy_step(actor, batch)
        return out
    finally:
        mdist.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("throughput")), timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_capacity_factor_trains_at_ep2_and_both_dispatchers_give_the_same_step(job):
    for out in job:
        assert out["alltoall_config"] == ("alltoall", 0.5) and out["allgather_config"] == ("allgather", 0.5)
        (loss_a, norm_a, params_a), (loss_g, norm_g, params_g) = out["alltoall"], out["allgather"]
        assert abs(loss_a - loss_g) < 1e-6 and abs(norm_a - norm_g) < 1e-5, out
        assert torch.allclose(params_a, params_g, atol=1e-6)
        # a capacity of half the tokens drops some: the step differs from the dropless one
        assert abs(norm_a - out["dropless"][1]) > 1e-4, out
    assert job[0]["alltoall"][0] == job[1]["alltoall"][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlap_grad_reduce_reaches_ddp_and_gives_the_same_update(job):
    for out in job:
        assert out["overlap_ddp"] == ((True, False),) and out["reduce_after_ddp"] == ((False, False),)
        (loss_o, norm_o, params_o), (loss_r, norm_r, params_r) = out["overlap"], out["reduce_after"]
        assert abs(loss_o - loss_r) < 1e-6 and abs(norm_o - norm_r) < 1e-6
        assert torch.allclose(params_o, params_r, atol=1e-7)


def test_megatrons_compiled_fusions_run_eagerly_unless_torch_compile():
    """throughput.torch_compile false (the default): megatron's jit_fuser (torch.compile) SwiGLU runs
    eagerly once a model config is built: no dynamo frame, the same values, and its autograd function
    keeps only its input for backward (the TE-spec activation the memory planner counts)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from torch._dynamo.utils import counters

    transformer_config_from_arch(QWEN3, use_te=False)  # sets the process's compile stance
    y = torch.randn(6, 2, 16, requires_grad=True)
    saved = []
    captured = dict(counters["stats"])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = bias_swiglu_impl(y, None)
    assert dict(counters["stats"]) == captured  # dynamo captured no frame: nothing compiled
    a, b = y.chunk(2, -1)
    torch.testing.assert_close(out, torch.nn.functional.silu(a) * b, rtol=0, atol=0)
    assert [t.numel() for t in saved] == [y.numel()]  # [tokens, 2f] only; silu's output is recomputed
    out.sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all()
    assert torch.compiler.is_compiling() is False
