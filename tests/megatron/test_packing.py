"""Token-budget micro-batches with sequence packing (THD): layout, and the same log-probs, values,
losses and gradients as padded row micro-batches across TP, PP, VPP, EP, MLA and the critic.

The packed path runs megatron's own THD machinery (``PackedSeqParams``: RoPE restarted at every
``cu_seqlens`` bound, the dummy batch dimension squeezed) and, on the local spec, our per-segment
core attention where Transformer Engine would run its varlen kernel.
"""

import dataclasses

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.algo.value_loss import ValueLossConfig
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.microbatch import TokenBudget, filler_microbatch, packed_microbatch
from armor_megatron.models.arch import ModelArch
from tests.megatron.spawn import run_ranks
from tests.megatron.test_parallel_logprobs import QWEN3, QWEN3_MOE

# ----------------------------------------------------------------------------- layout


def test_packed_layout_positions_and_unpacking():
    ids = torch.arange(1, 31).view(3, 10)
    lengths = torch.tensor([4, 10, 3])
    mb = packed_microbatch(ids, lengths, torch.tensor([2, 0]), multiple_of=4)
    assert mb.tokens.tolist() == [[21, 22, 23, 1, 2, 3, 4, 0]]  # rows 2 and 0, then padding to 8
    assert mb.cu_seqlens.tolist() == [0, 3, 7, 8] and mb.cu_seqlens.dtype == torch.int32
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert mb.width == 4 and mb.packed
    x = torch.arange(8.0)[None] * 10  # one value per packed position
    rows = mb.unpack(x)
    assert rows.shape == (2, 4)
    assert rows[0, :3].tolist() == [0, 10, 20] and rows[1].tolist() == [30, 40, 50, 60]
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q.dtype == torch.int32  # what Transformer Engine's varlen kernels take


def test_fixed_width_and_filler_packs():
    ids, lengths = torch.ones(2, 6, dtype=torch.long), torch.tensor([6, 5])
    mb = packed_microbatch(ids, lengths, torch.tensor([0, 1]), multiple_of=2, width=16)
    assert mb.tokens.shape == (1, 16) and mb.cu_seqlens.tolist() == [0, 6, 11, 16]
    with pytest.raises(ValueError, match="11 packed tokens exceed the micro-batch width 8"):
        packed_microbatch(ids, lengths, torch.tensor([0, 1]), width=8)
    filler = filler_microbatch(ids, 4, packed=True)
    assert (
        len(filler.index) == 0 and filler.tokens.tolist() == [[0, 0, 0, 0]] and filler.cu_seqlens.tolist() == [0, 1, 4]
    )
    assert filler.unpack(torch.zeros(1, 4)).shape == (1, 1)


def test_padded_micro_batches_are_untouched():
    from armor_megatron.megatron.microbatch import split_microbatches

    (mb,) = split_microbatches(torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 3]), 2)
    assert not mb.packed and mb.packed_seq_params() is None and mb.width == 5
    x = torch.randn(2, 5)
    assert mb.unpack(x) is x


def test_token_budget_from_config_and_bad_values():
    train = type("T", (), {"max_tokens_per_micro_batch": 4096, "forward_max_tokens_per_micro_batch": None})
    assert TokenBudget.of(train) == TokenBudget(4096, 4096)
    with pytest.raises(ValueError, match="token budget train must be >= 1"):
        TokenBudget(0)


# ----------------------------------------------------------------------------- parity across layouts
OPTIM = OptimizerConfig(lr=5e-3, weight_decay=0.01, clip_grad=1.0)
ROWS, PACKED = TokenBudget(), TokenBudget(train=24, forward=32)


def _mla_arch() -> ModelArch:
    from transformers import DeepseekV2Config

    from tests.convert.conftest import DEEPSEEK_V2_LITE_TINY, SMALL

    hf = DeepseekV2Config(**{**SMALL, **DEEPSEEK_V2_LITE_TINY, "vocab_size": 125}).to_dict()
    return ModelArch.from_hf_config(hf)


LAYOUTS = {  # 4 ranks each
    "tp2_dp2": ("qwen3", ParallelConfig(tp=2)),
    "pp2_vpp2_dp2": ("qwen3", ParallelConfig(pp=2, vpp=2)),
    "tp2_pp2": ("qwen3", ParallelConfig(tp=2, pp=2)),
    "moe_ep2_dp4": ("qwen3_moe", ParallelConfig(ep=2)),
    "mla_dp4": ("mla", ParallelConfig()),
}


def _arch(name):
    return {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}.get(name) or _mla_arch()


def _run_actor(arch, parallel, budget, batch):
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.trained_model import ModelSettings

    actor = MegatronActor(
        ModelSettings(arch, parallel, dtype="float32", micro_batch_size=2, token_budget=budget),
        optimizer=OPTIM,
        loss=PolicyLossConfig(alpha=0.9, loss_agg="seq-mean-token-mean"),
        total_steps=10,
        seed=5,
    )
    lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"], with_entropy=True)
    metrics = actor.train_step({**batch, "old_logprobs": lp.logprobs - 0.05, "ref_logprobs": lp.logprobs})
    return dict(
        logprobs=lp.logprobs,
        entropy=lp.entropy,
        loss=metrics["loss"],
        grad_norm=metrics["grad_norm"],
        num_tokens=metrics["num_tokens"],
        grads=[p.main_grad.clone() for c in actor.ddp_chunks for p in c.module.parameters()],
    )


def _run_critic(parallel, budget, batch):
    from armor_megatron.megatron.critic import MegatronCritic
    from armor_megatron.megatron.trained_model import ModelSettings

    critic = MegatronCritic(
        ModelSettings(QWEN3, parallel, dtype="float32", micro_batch_size=2, token_budget=budget),
        optimizer=OPTIM,
        loss=ValueLossConfig(clip_eps=0.5),
        total_steps=10,
        seed=5,
        value_head_init_std=0.1,
    )
    values = critic.compute_values(batch["input_ids"], batch["lengths"])
    metrics = critic.train_step({**batch, "old_values": values, "returns": values + batch["advantages"][:, None]})
    return dict(values=values, loss=metrics["loss"], grad_norm=metrics["grad_norm"])


def parity_worker(rank):
    from tests.megatron.test_actor import make_batch

    out = {}
    mdist.initialize(ParallelConfig(), QWEN3, seed=5)
    try:
        for layout, (arch_name, parallel) in LAYOUTS.items():
            arch = _arch(arch_name)
            mdist.set_model_parallel(parallel, arch, seed=5)
            batch = make_batch()
            for name, budget in (("rows", ROWS), ("packed", PACKED)):
                out[layout, name] = _run_actor(arch, parallel, budget, batch)
        mdist.set_model_parallel(ParallelConfig(tp=2), QWEN3, seed=5)
        for name, budget in (("rows", ROWS), ("packed", PACKED)):
            out["critic_tp2", name] = _run_critic(ParallelConfig(tp=2), budget, make_batch())
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_packed_micro_batches_match_padded_rows_in_every_layout():
    for out in run_ranks(parity_worker, 4, timeout=460):
        layouts = {layout for layout, _ in out}
        assert layouts == {*LAYOUTS, "critic_tp2"}
        for layout in layouts:
            rows, packed = out[layout, "rows"], out[layout, "packed"]
            for key in ("logprobs", "entropy", "values"):
                if key in rows:
                    torch.testing.assert_close(packed[key], rows[key], atol=2e-5, rtol=1e-5, msg=f"{layout} {key}")
                    assert (packed[key] != 0).sum() > 40, (layout, key)  # real values, not all zeros
            assert packed["loss"] == pytest.approx(rows["loss"], rel=1e-5, abs=1e-7), layout
            assert packed["grad_norm"] == pytest.approx(rows["grad_norm"], rel=1e-5), layout
            assert packed.get("num_tokens") == rows.get("num_tokens"), layout
            for a, b in zip(packed.get("grads", []), rows.get("grads", [])):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4, msg=layout)


def budget_too_small_worker(rank):
    from tests.megatron.test_actor import make_batch

    mdist.initialize(ParallelConfig(), QWEN3, seed=5)
    try:
        batch = make_batch()
        return _run_actor(QWEN3, ParallelConfig(), dataclasses.replace(PACKED, forward=13), batch)
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_row_longer_than_the_budget_fails_with_one_line():
    with pytest.raises(AssertionError, match="a 14-token sequence exceeds max_tokens_per_micro_batch=13"):
        run_ranks(budget_too_small_worker, 1, timeout=180)
