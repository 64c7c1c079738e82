"""The step's collective contract (`trainer.collectives`, the phase table of `trainer.loop`): at
TP=2 × PP=2 every rank makes the same sequence of collective calls over a whole run with anchors,
a reference reset every step, evaluation every step and checkpoints; a rank that skipped one
would hang the job. Recorded in each rank with `collectives.recording`."""

import collections
import os

import pytest
import torch.distributed as dist

from armor_megatron.config import load_config
from armor_megatron.trainer import collectives
from armor_megatron.trainer.collectives import collective, recording
from tests.megatron.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _train_recorded(rank, overrides):
    from armor_megatron.trainer.run import train

    cfg = load_config(CONFIG, overrides)
    with recording() as events:
        metrics = train(cfg)
    return list(events), metrics


def loop_level(events):
    """The marked calls and the default group's collectives: the sequence every rank shares."""
    return [e for e in events if e[0] == "call" or (e[0] == "op" and e[2] == "world")]


def per_group(events):
    """{group key: this rank's sequence of collectives on that (non-default) group}."""
    groups = collections.defaultdict(list)
    for e in events:
        if e[0] == "op" and e[2] != "world":
            groups[e[2]].append(e[1])
    return groups


def first_divergence(sequences: dict) -> str | None:
    """Where the ranks' sequences first differ (rank, position, events), None if all are equal."""
    ranks = sorted(sequences)
    base = sequences[ranks[0]]
    for r in ranks[1:]:
        seq = sequences[r]
        for i in range(max(len(base), len(seq))):
            a = base[i] if i < len(base) else "<end>"
            b = seq[i] if i < len(seq) else "<end>"
            if a != b:
                return f"rank {r} differs from rank {ranks[0]} at call {i}: {b} instead of {a}"
    return None


def _point_to_point(events):
    """Counter of ("send" | "recv", peer) over this rank's point-to-point operations."""
    count = collections.Counter()
    for e in events:
        if e[0] != "p2p":
            continue
        ops = e[2] if e[1] == "batch_isend_irecv" else ((e[1], e[3], e[2]),)
        for name, peer, _ in ops:
            count["send" if "send" in name else "recv", peer] += 1
    return count


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_rank_makes_the_same_collectives_at_tp2_pp2(tiny, tmp_path):
    overrides = [
        *tiny,
        "parallelism.tp=2",
        "parallelism.pp=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "train.micro_batch_size=4",
        "train.steps=2",
        "eval.every_steps=1",
        "reference.reset=every",
        "reference.tau=1",
        "checkpoint.every_steps=2",
        f"checkpoint.dir={tmp_path}/ckpt",
        f"logging.dir={tmp_path}/runs",
        "name=contract",
    ]
    results = run_ranks(_train_recorded, 4, overrides, timeout=540)
    events = dict(enumerate(e for e, _ in results))
    final = results[0][1]
    # what the run did: anchors, evaluation and a reset at the last step, and the checkpoint
    assert "anchor/found_rate" in final and "eval/val/pass@1" in final
    assert final["reference/reset"] == 1.0
    assert os.path.exists(tmp_path / "ckpt" / "latest")

    sequences = {r: loop_level(e) for r, e in events.items()}
    assert first_divergence(sequences) is None, first_divergence(sequences)
    calls = [e[1] for e in sequences[0] if e[0] == "call"]
    step = [
        "ArmorTrainer._step",
        "broadcast_tensors",
        "broadcast_object",
        "ArmorTrainer._trainer_on_device",
        "barrier",
        "ArmorTrainer.update",
        "barrier",
        "ArmorTrainer.sync_weights",
        "broadcast_object",  # the step's metrics with the driver's evaluation
        "ArmorTrainer._trainer_on_device",
        "barrier",
        "ArmorTrainer.reset_reference",
    ]
    start = calls.index("ArmorTrainer.run")
    assert calls[start : start + 3] == ["ArmorTrainer.run", "ArmorTrainer._evaluate_start", "broadcast_object"]
    assert calls.count("ArmorTrainer._step") == 2 and calls.count("ArmorTrainer.reset_reference") == 2
    for at in (i for i, c in enumerate(calls) if c == "ArmorTrainer._step"):
        assert calls[at : at + len(step)] == step, calls[at:]
    # the last step saves, with the trainer on the device for its reset
    assert calls.count("checkpoint") == 1 and calls[calls.index("checkpoint") - 1] == "ArmorTrainer.reset_reference"
    assert calls.index("ArmorTrainer.start_engines") < start
    # the torch.distributed operations between the marks, not only the marks themselves
    ops = {e[1] for e in sequences[0] if e[0] == "op"}
    assert {"broadcast_object_list", "barrier", "all_reduce"} <= ops, ops

    # within each TP / PP / ... group, its members make the same collectives on it
    groups = {r: per_group(e) for r, e in events.items()}
    checked = 0
    for key in set().union(*groups.values()):
        members = key[1]
        if len(members) > 1:
            assert first_divergence({r: groups[r][key] for r in members}) is None, key
            checked += any(groups[r][key] for r in members)
    assert checked >= 2  # the model's TP all-reduces at least, on two TP groups
    # what a pipeline stage sends, its neighbour receives
    p2p = {r: _point_to_point(e) for r, e in events.items()}
    for r in p2p:
        for (kind, peer), n in p2p[r].items():
            if kind == "send":
                assert p2p[peer]["recv", r] == n, (r, peer, p2p)
    assert any(p2p.values())

    # a rank that skipped one collective (rank 2 without the first reset's barrier) is caught
    skipped = dict(sequences)
    at = skipped[2].index(("call", "ArmorTrainer.reset_reference")) - 1
    skipped[2] = skipped[2][:at] + skipped[2][at + 1 :]
    assert first_divergence(skipped).startswith(f"rank 2 differs from rank 0 at call {at}")


@collective
def _marked(x):
    return x + 1


def test_recording_lists_marked_calls_and_distributed_ops_once_each(tmp_path):
    original = dist.all_reduce
    assert _marked.collective == "_marked" and _marked(1) == 2  # unrecorded: no list anywhere
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        import torch

        with recording() as events:
            assert _marked(1) == 2
            assert collectives.broadcast_object({"a": 1}) == {"a": 1}  # world size 1: no operation
            dist.all_reduce(torch.ones(2))
            dist.broadcast_object_list([1], src=0)  # its inner broadcasts are not listed again
            with pytest.raises(RuntimeError, match="already being recorded"), recording():
                pass
        assert events == [
            ("call", "_marked"),
            ("call", "broadcast_object"),
            ("op", "all_reduce", "world"),
            ("op", "broadcast_object_list", "world"),
        ]
        assert dist.all_reduce is original and collectives._log is None
    finally:
        dist.destroy_process_group()


def test_the_loops_phase_table_names_exactly_the_marked_methods():
    from armor_megatron.trainer import loop

    table = loop.__doc__.split("checks that they are identical.")[1]
    named = {word.strip(",") for line in table.splitlines() for word in line.split()[:2]}
    marked = {name for name, f in vars(loop.ArmorTrainer).items() if hasattr(f, "collective")}
    assert marked == {name for name in named if hasattr(loop.ArmorTrainer, name)}
    helpers = {name for name, f in vars(collectives).items() if getattr(f, "collective", None) == name}
    assert {"any_rank", "barrier", "broadcast_object", "broadcast_tensors", "max_over_ranks"} == helpers
    assert helpers - {"barrier"} <= named  # the barriers: inside _trainer_on_device
