"""A torch_dist checkpoint from elsewhere runs no code: a crafted ``.metadata`` or stored object is
refused in one line by the converter and by DCP's load through the safe reader, and nothing it asks
for runs; the files ``.metadata`` names stay inside the checkpoint; genuine checkpoints load."""

import os
import pickle
import shutil

import pytest
import torch

from armor_megatron.cli.convert import main
from armor_megatron.errors import UserInputError
from tests.payloads import ExecPayload, SystemPayload

METADATA_FILE = ".metadata"


def craft_metadata(ckpt_dir, payload_cls, marker):
    """Replace ``.metadata`` by the genuine metadata with a payload hidden inside one of its entries."""
    with open(os.path.join(ckpt_dir, METADATA_FILE), "rb") as f:
        metadata = pickle.load(f)  # the test's own genuine file
    metadata.storage_meta = payload_cls(marker)
    with open(os.path.join(ckpt_dir, METADATA_FILE), "wb") as f:
        pickle.dump(metadata, f)


@pytest.fixture
def mcore(tmp_path, tiny_models, capsys):
    out = tmp_path / "mcore"
    assert main(["hf-to-mcore", tiny_models["llama"], str(out), "--quiet"]) == 0
    capsys.readouterr()
    return out


@pytest.mark.parametrize(
    "payload, refused", [(SystemPayload, "posix.system"), (ExecPayload, "builtins.exec")], ids=["os.system", "exec"]
)
def test_a_crafted_metadata_is_refused_by_mcore_to_hf_and_runs_nothing(capsys, tmp_path, mcore, payload, refused):
    marker = tmp_path / "pwned"
    craft_metadata(mcore, payload, marker)
    code = main(["mcore-to-hf", str(mcore), str(tmp_path / "hf"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{mcore}/.metadata: refers to {refused}, which is not checkpoint metadata" in err
    assert not marker.exists() and not (tmp_path / "hf").exists()
    from armor_megatron.convert.dcp_safety import UnsafeCheckpointError, read_metadata

    with pytest.raises(UnsafeCheckpointError) as e:
        read_metadata(str(mcore))
    assert isinstance(e.value, UserInputError) and not marker.exists()


def test_a_genuine_checkpoint_still_converts(capsys, tmp_path, mcore, tiny_models):
    from safetensors.torch import load_file

    assert main(["mcore-to-hf", str(mcore), str(tmp_path / "hf"), "--quiet"]) == 0
    exported, original = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(f"{tiny_models['llama']}/model.safetensors"),
    )
    assert all(torch.equal(exported[n], t) for n, t in original.items())


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/passwd", "link.distcp"])
def test_a_data_file_outside_the_checkpoint_is_refused(capsys, tmp_path, mcore, where):
    from armor_megatron.confined import PathEscapeError
    from armor_megatron.convert.dcp_safety import read_metadata

    with open(mcore / METADATA_FILE, "rb") as f:
        metadata = pickle.load(f)
    shutil.copy(mcore / "__0_0.distcp", tmp_path / "outside.distcp")
    os.symlink(tmp_path / "outside.distcp", mcore / "link.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = where
    with open(mcore / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(PathEscapeError, match=f"{mcore}/.metadata: names '{where}'"):
        read_metadata(str(mcore))
    assert main(["mcore-to-hf", str(mcore), str(tmp_path / "hf"), "--quiet"]) == 2
    assert "which is not" not in capsys.readouterr().err


def test_a_stored_object_is_loaded_without_running_code(tmp_path):
    """DCP stores non-tensor values (megatron's RNG states, ``_extra_state``) as pickles and its own
    planner loads them with ``weights_only=False``; through the safe reader only data comes back."""
    import random

    import numpy as np
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    from armor_megatron.convert.dcp_safety import safe_reader_class

    def save(state, path):  # each top-level value one item, as megatron stores its objects
        dcp_save(state, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)

    def load(state, path):  # what was loaded: DCP's load fills a copy of ``state``
        planner = DefaultLoadPlanner(flatten_state_dict=False)
        dcp_load(state, storage_reader=safe_reader_class()(path), planner=planner, no_dist=True)
        return planner.state_dict

    marker = tmp_path / "pwned"
    rng = {"random": random.Random(1).getstate(), "numpy": np.random.RandomState(2).get_state(), "t": torch.ones(2)}
    save({"rng": rng, "w": torch.arange(4.0)}, str(tmp_path / "good"))
    state = load({"rng": None, "w": torch.empty(4)}, str(tmp_path / "good"))
    assert state["rng"]["random"] == rng["random"] and torch.equal(state["w"], torch.arange(4.0))
    assert all(np.array_equal(a, b) for a, b in zip(state["rng"]["numpy"], rng["numpy"]))

    save({"rng": SystemPayload(marker)}, str(tmp_path / "bad"))
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error
        load({"rng": None}, str(tmp_path / "bad"))
    refusal = (
        f"{tmp_path / 'bad'}: rng: refused to load a stored object (Trying to load unsupported GLOBAL posix.system"
    )
    assert refusal in str(e.value) and not marker.exists()


def test_a_garbled_or_missing_metadata_is_one_line(tmp_path):
    from armor_megatron.convert.dcp_safety import read_metadata

    (tmp_path / METADATA_FILE).write_bytes(b"\x80\x04garbage")
    with pytest.raises(UserInputError, match="unreadable checkpoint metadata"):
        read_metadata(str(tmp_path))
    (tmp_path / METADATA_FILE).write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UserInputError, match="holds a dict, not checkpoint metadata"):
        read_metadata(str(tmp_path))
    os.remove(tmp_path / METADATA_FILE)
    with pytest.raises(UserInputError, match=r"unreadable checkpoint metadata \(no .metadata\)"):
        read_metadata(str(tmp_path))
