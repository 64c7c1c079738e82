"""Checkpoint atomicity: saves SIGKILLed part-way leave the previous `latest` loadable; the
`latest` / prune / publish file logic on its own. (Resharding and bit-exact resume: test_actor.)"""

import os
import signal

import psutil
import pytest
import torch

from armor_megatron.megatron import checkpoint as ckpt
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.checkpoint_manifest import (
    MANIFEST_FILE,
    DamagedCheckpointError,
    describe_files,
    list_files,
    read_manifest,
    write_manifest,
)
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import ARCH, TP1, _actor, _logprobs, make_batch
from tests.processes import kill_tree


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


def damaged_worker(rank, root):
    """Save steps 1 and 2 (2 ranks), truncate one file of step 2, then resume as ``--resume auto`` does."""
    import torch.distributed as dist

    mdist.initialize(TP1, ARCH, seed=5)
    actor = _actor(TP1)
    ckpt.save_checkpoint(root, 1, actor, None, {"cursor": 1})
    ckpt.save_checkpoint(root, 2, actor, None, {"cursor": 2})
    manifest = read_manifest(os.path.join(root, "iter_0000002"))
    victim = os.path.join(root, "iter_0000002", sorted(n for n in manifest if n.endswith(".distcp"))[-1])
    dist.barrier()
    if rank == 0:
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    dist.barrier()
    try:
        ckpt.load_checkpoint(os.path.join(root, "iter_0000002"), actor, None)
        refused = None
    except DamagedCheckpointError as e:
        refused = str(e)
    path = ckpt.find_latest(root)
    step, extra = ckpt.load_checkpoint(path, actor, None)
    return sorted(manifest), victim, refused, path, step, extra


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_truncated_shard_is_named_and_resume_falls_back_to_the_intact_checkpoint(tmp_path):
    results = run_ranks(damaged_worker, 2, str(tmp_path), timeout=240)
    files, victim, refused, path, step, extra = results[0]
    assert {"common.pt", "metadata.json", ckpt.EXTRA_FILE} <= set(files) and any(f.endswith(".distcp") for f in files)
    assert refused.startswith(f"{victim}: ") and "truncated or half-written" in refused
    assert (path, step, extra) == (str(tmp_path / "iter_0000001"), 1, {"cursor": 1})
    assert results[1][2:] == results[0][2:]  # every rank agrees
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2\n"


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
    # no temp file left; megatron's tracker holds the step
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("latest")) == [
        "latest",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    with pytest.raises(FileNotFoundError, match="is neither a torch_dist checkpoint nor a root with a `latest` file"):
        ckpt.resolve_checkpoint_dir(str(tmp_path / "nowhere"))
    ckpt._write_latest(str(tmp_path), "iter_0000009")
    with pytest.raises(FileNotFoundError, match=r"latest names 'iter_0000009', which is not a directory"):
        ckpt.resolve_checkpoint_dir(str(tmp_path))
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000003")  # resume falls back


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
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000002",
        "iter_0000003",
        "iter_0000004",
        "latest",
        "latest_checkpointed_iteration.txt",
    ]
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


# ----------------------------------------------------------------------------- damaged checkpoints
def _checkpoint_with_manifest(root, step, payload=b"weights" * 100):
    name = ckpt.checkpoint_name(step)
    _fake_checkpoint(root, name)
    (root / name / "__0_0.distcp").write_bytes(payload)
    torch.save({"step": step}, root / name / ckpt.EXTRA_FILE)
    path = str(root / name)
    write_manifest(path, describe_files(path, list_files(path)))
    ckpt._write_latest(str(root), name)
    return root / name


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "__0_0.distcp").write_bytes(b"weights" * 50), r"__0_0.distcp: 350 bytes, .* says 700"),
        (lambda d: (d / "__0_0.distcp").write_bytes(b"WEIGHTS" * 100), r"__0_0.distcp: checksum differs"),
        (lambda d: (d / ckpt.EXTRA_FILE).write_bytes(b""), r"trainer_state.pt: 0 bytes"),
        (lambda d: (d / "metadata.json").unlink(), r"metadata.json: missing"),
        (lambda d: (d / MANIFEST_FILE).write_text('{"files": '), r"unreadable checkpoint manifest"),
    ],
    ids=["truncated", "corrupted", "empty-trainer-state", "missing", "torn-manifest"],
)
def test_a_damaged_latest_is_named_in_one_line_and_resume_falls_back(tmp_path, capsys, damage, message):
    intact = _checkpoint_with_manifest(tmp_path, 2)
    damaged = _checkpoint_with_manifest(tmp_path, 4)
    (tmp_path / "iter_0000006.tmp-dead").mkdir()  # an interrupted save's leftover
    ckpt.verify_checkpoint(str(damaged))
    damage(damaged)
    ckpt._VERIFIED.clear()
    with pytest.raises(DamagedCheckpointError, match=message) as err:
        ckpt.verify_checkpoint(str(damaged))
    assert "\n" not in str(err.value)
    assert ckpt.find_latest(str(tmp_path)) == str(intact)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "skipping a damaged checkpoint" in warning and "iter_0000004" in warning
    assert not (tmp_path / "iter_0000006.tmp-dead").exists()  # cleaned on start-up


def test_every_checkpoint_damaged_is_one_error_and_none_without_latest(tmp_path):
    assert ckpt.find_latest(str(tmp_path)) is None
    only = _checkpoint_with_manifest(tmp_path, 1)
    (only / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(DamagedCheckpointError, match="every checkpoint is damaged"):
        ckpt.find_latest(str(tmp_path))


def test_a_latest_naming_a_missing_folder_falls_back_to_the_newest_intact(tmp_path):
    intact = _checkpoint_with_manifest(tmp_path, 3)
    ckpt._write_latest(str(tmp_path), "iter_0000009")
    assert ckpt.find_latest(str(tmp_path)) == str(intact)


@pytest.mark.parametrize("latest", [b"", b"\n", b"\xff\xfe iter", b"../elsewhere", None], ids=str)
def test_an_empty_garbled_or_missing_latest_beside_checkpoints_resumes_the_newest_intact(tmp_path, capsys, latest):
    _checkpoint_with_manifest(tmp_path, 2)
    newest = _checkpoint_with_manifest(tmp_path, 4)
    if latest is None:  # a save that died between publishing iter_4 and naming it
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_bytes(latest)
    assert ckpt.find_latest(str(tmp_path)) == str(newest)  # never a fresh start over them
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and ("no `latest` file" in warning or "latest" in warning)


def test_a_checkpoint_without_a_manifest_that_cannot_be_read_is_one_line(tmp_path):
    # converter outputs and older checkpoints carry no manifest: what reading them raises is named
    path = tmp_path / "iter_0000002"
    _fake_checkpoint(tmp_path, "iter_0000002")
    (path / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
        '"common_backend_version": 1}'
    )
    (path / "common.pt").write_bytes(b"")
    with pytest.raises(DamagedCheckpointError, match=r"iter_0000002: cannot be loaded \(EOFError\)$") as err:
        ckpt.load_checkpoint(str(path), None, None)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="our own"):  # our ValueErrors keep their words
        with ckpt.read_as_checkpoint(str(path)):
            raise ValueError("our own")


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_trainer_state_is_unpickled_safely(tmp_path):
    """A trainer_state.pt from elsewhere cannot run code: a pickled callable is refused in one line,
    the real trainer state (containers, numbers, strings, python RNG state) loads."""
    import random

    state = {"step": 3, "loader": {"epoch": 0}, "rng": random.Random(1).getstate(), "none": None, "t": torch.ones(2)}
    torch.save(state, tmp_path / ckpt.EXTRA_FILE)
    loaded = ckpt.load_trainer_state(str(tmp_path))
    assert loaded["rng"] == state["rng"] and torch.equal(loaded["t"], state["t"])
    torch.save({"evil": _Payload()}, tmp_path / ckpt.EXTRA_FILE)
    with pytest.raises(DamagedCheckpointError, match=r"trainer_state.pt: cannot be loaded safely") as err:
        ckpt.load_trainer_state(str(tmp_path))
    assert "\n" not in str(err.value)


def crafted_metadata_worker(rank, root):
    """Save a checkpoint, hide a payload that would create ``root/../pwned`` in its ``.metadata``
    and rewrite its manifest (whoever crafts a checkpoint can), then resume from it and load its
    weights as ``model.mcore_path`` / ``reference.init_from`` do; the genuine one still loads."""
    import pickle

    from tests.payloads import SystemPayload

    mdist.initialize(TP1, ARCH, seed=5)
    actor = _actor(TP1)
    path = ckpt.save_checkpoint(root, 1, actor, None, {"cursor": 1})
    genuine = open(os.path.join(path, ".metadata"), "rb").read()
    metadata = pickle.loads(genuine)
    metadata.storage_meta = SystemPayload(os.path.join(root, "..", "pwned"))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(path, describe_files(path, list_files(path)))
    refusals = []
    for load in (lambda: ckpt.load_checkpoint(path, actor, None), lambda: actor.load_weights(path)):
        try:
            load()
            refusals.append(None)
        except ValueError as e:
            refusals.append((type(e).__name__, str(e)))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(genuine)
    write_manifest(path, describe_files(path, list_files(path)))
    ckpt._VERIFIED.clear()
    step, extra = ckpt.load_checkpoint(path, actor, None)
    return refusals, step, extra


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crafted_metadata_runs_no_code_on_resume_or_weight_load(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    refusals, step, extra = run_ranks(crafted_metadata_worker, 1, str(root), timeout=240)[0]
    line = f"{root}/iter_0000001/.metadata: refers to posix.system, which is not checkpoint metadata"
    assert [r[0] for r in refusals] == ["UnsafeCheckpointError"] * 2, refusals
    assert all(r[1].startswith(line) and "\n" not in r[1] for r in refusals), refusals
    assert not (tmp_path / "pwned").exists()
    assert (step, extra) == (1, {"cursor": 1})


WRITER_SERVER_SCRIPT = """
import os, sys, time
from armor_megatron.megatron import checkpoint
with checkpoint.preemption_signals_held():  # as a save starts it
    pass
from megatron.core.dist_checkpointing.strategies import filesystem_async
queue = filesystem_async._results_queue
queue.put("served")
print(checkpoint._writer_results_server._process.pid, queue.get(), flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_checkpoint_writers_results_server_holds_signals_and_dies_with_the_trainer():
    """megatron keeps a Manager process for its writers' results for the whole run; it must
    ignore a group SIGTERM during a save, yet never outlive a killed trainer nor hold its output."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = subprocess.Popen(
        [sys.executable, "-c", WRITER_SERVER_SCRIPT], stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=root)
    )
    server = None
    try:
        pid, served = trainer.stdout.readline().split()
        pid = int(pid)
        server = psutil.Process(pid)
        assert served == b"served"
        with open(f"/proc/{pid}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        assert blocked & (1 << (signal.SIGTERM - 1)) and blocked & (1 << (signal.SIGUSR1 - 1))
        trainer.kill()
        trainer.communicate(timeout=30)  # end of output: the server does not hold the trainer's stdout
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the writers' results server outlived the killed trainer"
    finally:  # the trainer (and the server while it is its child), and a server that outlived it
        kill_tree(trainer)
        if server is not None and server.is_running():
            server.kill()


def full_disk_worker(rank, root):
    """Save step 1, then save step 2 under a file-size limit smaller than its data files (as a full
    disk fails a write); afterwards, without the limit, resume as ``--resume auto`` does."""
    import resource

    mdist.initialize(TP1, ARCH, seed=5)
    actor = _actor(TP1)
    ckpt.save_checkpoint(root, 1, actor, None, {"cursor": 1})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        ckpt.save_checkpoint(root, 2, actor, None, {"cursor": 2})
        refused = None
    except ValueError as e:
        refused = (type(e).__name__, str(e))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    left = sorted(os.listdir(root))
    path = ckpt.find_latest(root)
    step, extra = ckpt.load_checkpoint(path, actor, None)
    return refused, left, path, step, extra


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_stays_latest(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    refused, left, path, step, extra = run_ranks(full_disk_worker, 1, str(root), timeout=240, fresh=True)[0]
    assert refused is not None and refused[0] == "CheckpointSpaceError", refused
    assert refused[1] == (
        f"checkpoint of step 2 not written: no space left on {root} (File too large); the partial save was "
        f"removed; the previous checkpoint {root}/iter_0000001 is intact and `latest` still names it"
    )
    assert left == ["iter_0000001", "latest", "latest_checkpointed_iteration.txt"]  # no half-written step 2
    assert (path, step, extra) == (str(root / "iter_0000001"), 1, {"cursor": 1})


@pytest.mark.parametrize(
    "error, reason",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (RuntimeError("Worker failure: [Errno 122] Disk quota exceeded"), "Disk quota exceeded"),
        (
            RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598"),
            "a write came up short",
        ),
        (RuntimeError("something else"), None),
    ],
)
def test_what_counts_as_a_full_disk(error, reason):
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert ckpt._space_problem(outer) == reason
