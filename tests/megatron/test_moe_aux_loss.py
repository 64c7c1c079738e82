"""MoE load-balancing loss in the train step: c times its MEAN over micro-batches and
data-parallel ranks, whatever the token count (megatron's semantics for it).

With zero advantages the policy loss has zero gradient, so the router's gradient is the aux
loss's alone. The load-balancing loss of a batch is a mean over its tokens (expert load
fractions times mean router probabilities), so duplicating every row leaves it, and its
gradient, unchanged: in one micro-batch of twice the tokens, in two identical micro-batches,
or on two data-parallel ranks. Megatron's per-token scaling left unfinalized would multiply the
gradient by the token count (and sum over micro-batches), which these equalities catch.
"""

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.model import MoESettings
from tests.megatron.spawn import run_ranks
from tests.megatron.test_parallel_logprobs import QWEN3_MOE


def _router_grads(rows: int, micro_batch_size: int, coeff: float, balancing: str) -> list[torch.Tensor]:
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.trained_model import ModelSettings
    from tests.megatron.test_actor import make_batch

    moe = MoESettings(aux_loss_coeff=coeff, load_balancing_type=balancing)
    actor = MegatronActor(
        ModelSettings(QWEN3_MOE, ParallelConfig(), dtype="float32", micro_batch_size=micro_batch_size, moe=moe),
        optimizer=OptimizerConfig(lr=0.0),
        loss=PolicyLossConfig(alpha=1.0),
        total_steps=10,
        seed=5,
    )
    one = make_batch()
    batch = {k: torch.cat([v] * (rows // len(v))) for k, v in one.items()}
    batch["advantages"] = torch.zeros(rows)
    batch["old_logprobs"] = torch.zeros(batch["input_ids"].shape)
    actor.train_step(batch)
    return [p.main_grad.clone() for n, p in actor.ddp_chunks[0].module.named_parameters() if "router" in n]


def aux_worker(rank, world):
    mdist.initialize(ParallelConfig(), QWEN3_MOE, seed=5)
    try:
        out = {}
        for balancing in ("aux_loss", "seq_aux_loss"):
            if world == 1:
                out[balancing, "once"] = _router_grads(7, 7, 0.01, balancing)
                out[balancing, "twice the tokens"] = _router_grads(14, 14, 0.01, balancing)
                out[balancing, "two micro-batches"] = _router_grads(14, 7, 0.01, balancing)
                out[balancing, "double coefficient"] = _router_grads(7, 7, 0.02, balancing)
            else:  # each data-parallel rank gets one copy of the 7 rows
                out[balancing, "two ranks"] = _router_grads(14, 7, 0.01, balancing)
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_aux_loss_gradient_is_the_mean_over_micro_batches_and_ranks_whatever_the_tokens():
    (single,) = run_ranks(aux_worker, 1, 1, timeout=280)
    ranks = run_ranks(aux_worker, 2, 2, timeout=280)
    for balancing in ("aux_loss", "seq_aux_loss"):
        once = single[balancing, "once"]
        assert once and all(g.abs().sum() > 0 for g in once), balancing  # the aux loss alone moves the router
        for name in ("twice the tokens", "two micro-batches"):
            for a, b in zip(single[balancing, name], once):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9, msg=f"{balancing}: {name}")
        for a, b in zip(single[balancing, "double coefficient"], once):
            torch.testing.assert_close(a, 2 * b, rtol=1e-4, atol=1e-9)
        for out in ranks:
            for a, b in zip(out[balancing, "two ranks"], once):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9, msg=f"{balancing}: two ranks")
