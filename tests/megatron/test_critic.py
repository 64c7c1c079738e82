"""The PPO critic across layouts, its training, and its place in training checkpoints.

One 2-rank gloo job (process start dominates the cost):

1. TP=1 (DP=2): an actor's initial weights are saved; a critic (value head drawn with std 0.1 so
   values are not all zero) loads its backbone from them, computes the old values of a fixed
   7-row batch and takes 4 value-loss steps towards fixed returns.
2. TP=2, PP=2 and PP=2×VPP=2 (each DP=1): the same backbone and head, values and 4 steps.
3. TP=2: after 2 steps a checkpoint (actor + critic); a fresh actor and critic resumed from it
   give the same values and repeat steps 3 and 4 bit for bit.
4. A critic with the default zero head predicts 0 everywhere.
"""

import pytest
import torch

from armor_megatron.algo.value_loss import ValueLossConfig
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import OPTIM as ACTOR_OPTIM
from tests.megatron.test_actor import make_batch, settings
from tests.megatron.test_parallel_logprobs import QWEN3 as ARCH

STEPS = 4
TP1, TP2, PP2, PP2VPP2 = ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(pp=2), ParallelConfig(pp=2, vpp=2)
OPTIM = OptimizerConfig(lr=2e-3, weight_decay=0.0, clip_grad=1.0)
LOSS = ValueLossConfig(clip_eps=0.5)


def _critic(parallel, init_std=0.1):
    from armor_megatron.megatron.critic import MegatronCritic

    return MegatronCritic(
        settings(ARCH, parallel), optimizer=OPTIM, loss=LOSS, total_steps=10, seed=7, value_head_init_std=init_std
    )


def _actor(parallel):
    from armor_megatron.algo.loss import PolicyLossConfig
    from armor_megatron.megatron.actor import MegatronActor

    return MegatronActor(
        settings(ARCH, parallel), optimizer=ACTOR_OPTIM, loss=PolicyLossConfig(), total_steps=10, seed=5
    )


def _value_batch(critic):
    """The actor test's batch with returns = the row's advantage on every response token."""
    batch = make_batch()
    old = critic.compute_values(batch["input_ids"], batch["lengths"])
    returns = batch["advantages"][:, None] * batch["response_mask"]
    return {k: batch[k] for k in ("input_ids", "lengths", "response_mask")} | {"old_values": old, "returns": returns}


def _train(critic, batch, steps):
    return [critic.train_step(batch) for _ in range(steps)]


def critic_worker(rank, root):
    from armor_megatron.megatron.checkpoint import load_checkpoint, save_checkpoint

    mdist.initialize(TP1, ARCH, seed=5)
    out = {"values": {}, "losses": {}}
    try:
        # 1. TP=1 (DP=2)
        actor = _actor(TP1)
        save_checkpoint(f"{root}/init", 0, actor, None, {})
        critic = _critic(TP1)
        critic.load_weights(f"{root}/init")
        actor_embedding = actor.model_chunks[0].embedding.word_embeddings.weight
        out["backbone_equal"] = torch.equal(critic.model_chunks[0].embedding.word_embeddings.weight, actor_embedding)
        batch = _value_batch(critic)
        out["values"]["tp1"] = batch["old_values"]
        steps = _train(critic, batch, STEPS)
        out["losses"]["tp1"] = [m["loss"] for m in steps]
        out["metrics"] = steps

        # 2. TP=2, PP=2 and PP=2×VPP=2 (interleaved schedule, padded micro-batches), all DP=1
        for name, layout in (("tp2", TP2), ("pp2", PP2), ("pp2vpp2", PP2VPP2)):
            mdist.set_model_parallel(layout, ARCH, seed=5)
            critic = _critic(layout)
            critic.load_weights(f"{root}/init")
            out["values"][name] = critic.compute_values(batch["input_ids"], batch["lengths"])
            out["losses"][name] = [m["loss"] for m in _train(critic, batch, STEPS)]

        # 3. checkpoint round trip at TP=2
        mdist.set_model_parallel(TP2, ARCH, seed=5)
        actor, critic = _actor(TP2), _critic(TP2)
        actor.load_weights(f"{root}/init")
        critic.load_weights(f"{root}/init")
        _train(critic, batch, 2)
        save_checkpoint(f"{root}/run", 2, actor, None, {"step": 2}, critic=critic)
        saved_values = critic.compute_values(batch["input_ids"], batch["lengths"])
        out["straight"] = [m["loss"] for m in _train(critic, batch, 2)]
        resumed_actor, resumed = _actor(TP2), _critic(TP2, init_std=0.0)
        out["resumed_step"] = load_checkpoint(f"{root}/run", resumed_actor, None, critic=resumed)[0]
        out["resumed_values_equal"] = torch.equal(
            resumed.compute_values(batch["input_ids"], batch["lengths"]), saved_values
        )
        out["resumed_lr_steps"] = resumed.scheduler.num_steps
        out["resumed"] = [m["loss"] for m in _train(resumed, batch, 2)]
        try:
            load_checkpoint(f"{root}/init", _actor(TP2), None, critic=_critic(TP2))
        except ValueError as err:
            out["no_critic_error"] = str(err)

        # 4. zero-initialised head
        zero_head = _critic(TP2, init_std=0.0)
        out["zero_head_max"] = zero_head.compute_values(batch["input_ids"], batch["lengths"]).abs().max().item()
        return out
    finally:
        mdist.shutdown()


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    return run_ranks(critic_worker, 2, str(tmp_path_factory.mktemp("critic")), timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_critic_values_match_across_tp_and_pp(story):
    r = story[0]
    assert r["backbone_equal"]
    mask = make_batch()["response_mask"]
    tp1 = r["values"]["tp1"]
    assert tp1[mask].abs().min() > 0  # a random head: real, non-zero values at every response token
    for name in ("tp2", "pp2", "pp2vpp2"):
        assert (r["values"][name] - tp1).abs().max() < 1e-5, name
    # 0 outside 1 <= t < length (position 0 predicts nothing)
    lengths = make_batch()["lengths"]
    outside = torch.arange(tp1.shape[1])[None] >= lengths[:, None]
    assert (tp1[outside] == 0).all() and (tp1[:, 0] == 0).all()
    assert all(torch.equal(rank["values"]["tp2"], r["values"]["tp2"]) for rank in story)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_critic_train_steps_lower_the_value_loss_identically_in_every_layout(story):
    r = story[0]
    losses = r["losses"]
    assert losses["tp1"][-1] < 0.8 * losses["tp1"][0], losses["tp1"]
    for name in ("tp2", "pp2", "pp2vpp2"):
        for k in range(STEPS):
            assert abs(losses[name][k] - losses["tp1"][k]) < 1e-5, (name, k, losses)
    first, last = r["metrics"][0], r["metrics"][-1]
    assert {
        "grad_norm",
        "lr",
        "skipped",
        "value_clip_frac",
        "value_mean",
        "return_mean",
        "explained_var",
        "num_tokens",
    } <= set(first)
    assert first["skipped"] == 0.0 and last["explained_var"] > first["explained_var"]
    assert story[1]["metrics"] == r["metrics"]  # identical on every rank


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_checkpoint_restores_the_critic_and_its_optimizer_bitwise(story):
    r = story[0]
    assert r["resumed_step"] == 2 and r["resumed_values_equal"] and r["resumed_lr_steps"] == 2
    assert r["resumed"] == r["straight"]  # Adam moments restored: the next two steps repeat exactly
    assert "holds no critic" in r["no_critic_error"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zero_initialised_value_head_predicts_zero(story):
    assert story[0]["zero_head_max"] == 0.0


def test_bad_critic_batches_fail_with_one_clear_line():
    from armor_megatron.megatron.trained_model import checked_rows

    batch = make_batch()
    rows = {k: batch[k] for k in ("input_ids", "lengths", "response_mask")}
    with pytest.raises(KeyError, match="train batch lacks old_values, returns"):
        checked_rows(rows, ("old_values", "returns"), ("old_values", "returns"))
    with pytest.raises(ValueError, match=r"returns has shape \(7,\), expected \(7, 14\) like input_ids"):
        checked_rows(
            {**rows, "old_values": torch.zeros(7, 14), "returns": torch.zeros(7)},
            ("old_values", "returns"),
            ("old_values", "returns"),
        )
