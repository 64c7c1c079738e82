"""The device-memory ledger (launch/device_ledger.py): what a GPU holds after each event."""

import pytest

from armor_megatron.launch.device_ledger import (
    GIB,
    DeviceLedger,
    DeviceSizes,
    EngineSizes,
    replay_colocated_step,
)

ENGINE = EngineSizes(weights=10 * GIB, kv_cache=20 * GIB, cuda_graph=2 * GIB)


def sizes(gpu=80, engines=("policy",)):
    return DeviceSizes(
        gpu=gpu * GIB,
        trainer={"weights": 5 * GIB, "gradients": 10 * GIB},
        logprobs=4 * GIB,
        update=20 * GIB,
        engines={role: ENGINE for role in engines},
        contexts=1 * GIB,
        bucket=0.5 * GIB,
    )


def totals(ledger):
    return [(p.label, p.total / GIB) for p in ledger.phases]


def test_each_event_charges_or_frees_its_bytes():
    ledger = DeviceLedger(sizes(), trainer_on_device=False)
    ledger.start("rollout")
    ledger.engine_released("policy", ("weights", "kv_cache", "cuda_graph"))
    ledger.trainer_to_device()
    ledger.compute("logprobs")
    ledger.compute("update")  # 4 GiB already cached by the log-prob pass: 16 more while it runs
    ledger.trainer_to_host(emptied_cache=False)
    ledger.engine_resumed("policy", ("weights",))
    ledger.weights_pushed("policy")
    assert totals(ledger) == [
        ("rollout", 33.0),
        ("policy engine released weights+kv_cache+cuda_graph", 1.0),
        ("trainer to the device", 16.0),
        ("logprobs", 20.0),
        ("update", 36.0),
        ("trainer to the host", 21.0),  # the allocator still holds the update's 20 GiB
        ("policy engine resumed weights", 31.0),
        ("weights pushed to the policy engine", 31.5),
    ]
    ledger.trainer_to_host(emptied_cache=True)
    assert ledger.phases[-1].total == 11 * GIB and ledger.phases[-1].label.endswith("+ empty_cache")


def test_a_gpu_hosts_the_heavier_role_and_problem_names_the_first_phase_over():
    ledger = DeviceLedger(sizes(gpu=50, engines=("policy", "reference")), trainer_on_device=False)
    replay_colocated_step(ledger)
    assert ledger.problem() is None and ledger.peak.label == "update" and ledger.peak.total == 46 * GIB
    assert ledger.peak.holdings["reference engine weights"] == 10 * GIB  # the frozen engine keeps them
    order = DeviceLedger(sizes(gpu=40), trainer_on_device=True)  # the trainer never leaves
    order.start("rollout")
    problem = order.problem("colocated step")
    assert problem == (
        "colocated step, phase 'rollout': 48.0 GiB > launch.gpu_memory_gib 40 (largest: policy engine kv_cache 20.0 GiB)"
    )


def test_policy_engines_that_keep_their_weights_hold_them_through_the_update():
    released = replay_colocated_step(DeviceLedger(sizes(gpu=50), trainer_on_device=False))
    kept = replay_colocated_step(DeviceLedger(sizes(gpu=50), trainer_on_device=False), policy_keeps_weights=True)
    [update_released] = [p for p in released.phases if p.label == "update"]
    [update_kept] = [p for p in kept.phases if p.label == "update"]
    assert "policy engine weights" not in update_released.holdings
    assert update_kept.total - update_released.total == update_kept.holdings["policy engine weights"] > 0
    assert not any(p.label == "policy engine resumed weights" for p in kept.phases)  # nothing was released


def test_an_unknown_tag_is_refused():
    with pytest.raises(ValueError, match="unknown engine memory tag 'kv'"):
        DeviceLedger(sizes()).engine_released("policy", ("kv",))
