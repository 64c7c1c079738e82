"""Checkpoint atomicity: saves SIGKILLed part-way leave the previous `latest` loadable; the
`latest` / prune / publish file logic on its own. (Resharding and bit-exact resume: test_actor.)"""

import os
import signal

import pytest
import torch

from armor_megatron.megatron import checkpoint as ckpt
from armor_megatron.megatron import dist as mdist
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import ARCH, TP1, _actor, _logprobs, make_batch


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def crash_worker(rank, root, phase):
    """Phase 1: save step 1, train, then die between writing step 2 and renaming it into place.
    Phase 2: load `latest` (step 1) and record what it holds, refuse to overwrite it, train,
    then die between renaming step 2 into place and updating `latest`."""
    mdist.initialize(TP1, ARCH, seed=5)
    actor, batch = _actor(TP1), make_batch()
    lp = _logprobs(actor, batch)
    batch.update(old_logprobs=lp, ref_logprobs=lp)
    if phase == 1:
        ckpt.save_checkpoint(root, 1, actor, None, {"cursor": 1})
        torch.save(_logprobs(actor, batch), os.path.join(root, "..", "lp_step1.pt"))
        actor.train_step(batch)
        ckpt._publish = _die
    else:
        step, extra = ckpt.load_checkpoint(root, actor, None)
        expected = torch.load(os.path.join(root, "..", "lp_step1.pt"))
        try:
            ckpt.save_checkpoint(root, 1, actor, None, {})
            refused = None
        except FileExistsError as e:
            refused = str(e)
        torch.save(
            (step, extra, torch.equal(_logprobs(actor, batch), expected), refused),
            os.path.join(root, "..", "phase2.pt"),
        )
        actor.train_step(batch)
        ckpt._write_latest = _die
    ckpt.save_checkpoint(root, 2, actor, None, {"cursor": 2})
    raise AssertionError("the save should have been killed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_saves_leave_the_previous_checkpoint_latest_and_loadable(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with pytest.raises(AssertionError, match="died with exit code -9"):
        run_ranks(crash_worker, 1, str(root), 1, timeout=140)
    assert (root / "latest").read_text() == "iter_0000001\n"
    leftovers = [n for n in os.listdir(root) if n.startswith("iter_0000002")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0]  # written, never renamed
    assert os.path.isfile(root / leftovers[0] / "metadata.json")

    with pytest.raises(AssertionError, match="died with exit code -9"):
        run_ranks(crash_worker, 1, str(root), 2, timeout=140)
    step, extra, same_logprobs, refused = torch.load(tmp_path / "phase2.pt")
    assert (step, extra, same_logprobs) == (1, {"cursor": 1}, True)
    assert refused.endswith("iter_0000001 is the checkpoint `latest` names; refusing to overwrite it")
    # step 2 is complete and in place, but `latest` was never switched to it
    assert (root / "latest").read_text() == "iter_0000001\n"
    assert ckpt.find_latest(str(root)) == str(root / "iter_0000001")
    assert os.path.isfile(root / "iter_0000002" / ckpt.EXTRA_FILE)


# ----------------------------------------------------------------------------- file logic only
def _fake_checkpoint(root, name):
    os.makedirs(root / name)
    (root / name / "metadata.json").write_text("{}")


def test_find_latest_and_resolve(tmp_path):
    assert ckpt.find_latest(str(tmp_path)) is None
    _fake_checkpoint(tmp_path, "iter_0000003")
    ckpt._write_latest(str(tmp_path), "iter_0000003")
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000003")
    assert ckpt.resolve_checkpoint_dir(str(tmp_path)) == str(tmp_path / "iter_0000003")
    assert ckpt.resolve_checkpoint_dir(str(tmp_path / "iter_0000003")) == str(tmp_path / "iter_0000003")
    assert [n for n in os.listdir(tmp_path) if n.startswith("latest")] == ["latest"]  # no temp file left
    with pytest.raises(FileNotFoundError, match="is neither a torch_dist checkpoint nor a root with a `latest` file"):
        ckpt.resolve_checkpoint_dir(str(tmp_path / "nowhere"))
    ckpt._write_latest(str(tmp_path), "iter_0000009")
    with pytest.raises(FileNotFoundError, match=r"latest names 'iter_0000009', which is not a directory"):
        ckpt.find_latest(str(tmp_path))


def test_publish_replaces_an_unnamed_leftover_of_the_same_step(tmp_path):
    _fake_checkpoint(tmp_path, "iter_0000002")  # renamed by a save killed before `latest` was written
    (tmp_path / "iter_0000002" / "stale").write_text("old")
    _fake_checkpoint(tmp_path, "iter_0000002.tmp-abc")
    ckpt._publish(str(tmp_path / "iter_0000002.tmp-abc"), str(tmp_path / "iter_0000002"))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002"]
    assert os.listdir(tmp_path / "iter_0000002") == ["metadata.json"]


def test_prune_keeps_the_newest_and_latest_and_removes_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, ckpt.checkpoint_name(step))
    _fake_checkpoint(tmp_path, "iter_0000005.tmp-dead")
    (tmp_path / "latest.tmp-dead").write_text("x")
    ckpt._write_latest(str(tmp_path), "iter_0000002")  # e.g. resumed from an older one
    removed = ckpt.prune_checkpoints(str(tmp_path), keep_last=2)
    assert sorted(os.path.basename(p) for p in removed) == ["iter_0000001", "iter_0000005.tmp-dead", "latest.tmp-dead"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000004", "latest"]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpt.prune_checkpoints(str(tmp_path), keep_last=0)


def test_resuming_an_earlier_checkpoint_makes_it_latest(tmp_path):
    """--resume .../iter_0000080 while `latest` names iter_0000100: the run's own save of step 100
    will then replace the abandoned one instead of being refused as the checkpoint `latest` names."""
    for step in (80, 100):
        _fake_checkpoint(tmp_path, ckpt.checkpoint_name(step))
    ckpt._write_latest(str(tmp_path), ckpt.checkpoint_name(100))
    ckpt.adopt_as_latest(str(tmp_path), str(tmp_path / "iter_0000080"))
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000080")
    elsewhere = tmp_path / "other_run"
    elsewhere.mkdir()
    _fake_checkpoint(elsewhere, ckpt.checkpoint_name(7))
    ckpt.adopt_as_latest(str(tmp_path), str(elsewhere / "iter_0000007"))  # not in this run's root: untouched
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000080")
