"""One torch and one NCCL on both sides of a weight sync: two fake interpreters (scripts that print
the versions a real one's wheels would report) stand in for the trainer's and the servers'."""

import json
import os
import stat

import pytest

from armor_megatron.config import ConfigError, load_config, needs
from armor_megatron.config.comm_versions import (
    CommVersions,
    ProbeError,
    interpreter_versions,
    local_versions,
    sync_problem,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")


def fake_python(tmp_path, name, torch, nccl):
    """An executable that answers the probe (``python -c CODE``) as an interpreter with these wheels would."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{json.dumps({'torch': torch, 'nccl': nccl})}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_two_nccl_versions_in_one_update_group_are_refused_naming_both_and_the_fix(tmp_path):
    trainer = interpreter_versions(fake_python(tmp_path, "trainer", "2.11.0", "2.28.9"))
    servers_path = fake_python(tmp_path, "servers", "2.14.1", "2.30.7")
    servers = interpreter_versions(servers_path)
    assert servers == CommVersions(torch="2.14.1", nccl="2.30.7")
    problem = sync_problem("distributed", trainer, servers, servers_path)
    assert problem == (
        f"weight_sync distributed: the trainer has NCCL 2.28.9, the engines' {servers_path} has NCCL 2.30.7 "
        "(one NCCL communicator holds trainer and engine ranks, and NCCL refuses mixed versions); install the same "
        "torch (and so its nvidia-nccl wheel) in both environments: tools/envs/*.lock share them, or use weight_sync disk"
    )
    assert "the trainer has torch 2.11.0, the engines'" in sync_problem("tensor", trainer, servers, servers_path)
    assert sync_problem("disk", trainer, servers, servers_path) is None  # files only


def test_one_nccl_and_one_torch_pass(tmp_path):
    same = [interpreter_versions(fake_python(tmp_path, n, "2.14.1", "2.30.7")) for n in ("a", "b")]
    for mode in ("distributed", "tensor", "disk"):
        assert sync_problem(mode, *same, "b") is None
    # NCCL agrees while torch differs: distributed is fine, tensor is not
    other_torch = CommVersions(torch="2.14.0", nccl="2.30.7")
    assert sync_problem("distributed", same[0], other_torch, "b") is None
    assert sync_problem("tensor", same[0], other_torch, "b") is not None


def test_an_interpreter_that_cannot_answer_is_one_line(tmp_path):
    with pytest.raises(ProbeError, match="no such interpreter"):
        interpreter_versions(str(tmp_path / "missing"))
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ProbeError, match=r"could not tell its torch and NCCL versions \(exit 3: boom\)"):
        interpreter_versions(str(broken))


def test_this_interpreter_is_read_from_its_wheels_without_importing_torch():
    import importlib.metadata

    assert local_versions().torch == importlib.metadata.version("torch")


def test_check_and_every_start_refuse_a_mix(tmp_path):
    """``needs.check`` runs in ``--check`` and at the start of every job (config.files.check_files)."""
    here = local_versions()
    other = fake_python(tmp_path, "servers", "2.14.1", "2.30.7")
    cfg = load_config(SEVEN_B, [f"rollout.sglang.python={other}", 'rollout.sglang.urls=["http://h:30000"]'])
    with pytest.raises(ConfigError) as err:
        needs.check(cfg)
    message = str(err.value)
    assert message.startswith("rollout.sglang.weight_sync: needs one torch for trainer and engines, but here ")
    assert f"the trainer has torch {here.torch}, the engines' {other} has torch 2.14.1" in message
    assert "\n" not in message
    same = fake_python(tmp_path, "same", here.torch, here.nccl)
    needs.check(load_config(SEVEN_B, [f"rollout.sglang.python={same}", 'rollout.sglang.urls=["http://h:30000"]']))
    disk = [
        "rollout.sglang.weight_sync=disk",
        f"rollout.sglang.python={other}",
        'rollout.sglang.urls=["http://h:30000"]',
    ]
    needs.check(load_config(SEVEN_B, disk))
