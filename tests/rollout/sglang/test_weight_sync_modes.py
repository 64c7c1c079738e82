"""Weight-sync modes are `WeightSync` classes registered in ``WEIGHT_SYNC_MODES``: a mode registered
here is accepted by the run config (``rollout.sglang.weight_sync``), checked by `WeightSyncConfig`,
built by the trainer's engine factory and pushes weights into a server (the test double by
default, see conftest) with no other edit; a wrong mode fails in one line listing the registered
ones."""

import json
import os

import pytest

from armor_megatron.config import ConfigError, load_config
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.hf_checkpoint import write_hf_checkpoint
from armor_megatron.rollout.sglang.weight_sync import (
    WEIGHT_SYNC_MODES,
    DiskWeightSync,
    DistributedWeightSync,
    TensorWeightSync,
    WeightSync,
    WeightSyncConfig,
    make_weight_sync,
    register_weight_sync_mode,
)
from armor_megatron.rollout.testing.tiny_models import encode, tiny_weights
from armor_megatron.trainer.components import make_sglang_engines, release_engines_at_start

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class VersionDirSync(WeightSync):
    """A toy mode: every version an HF checkpoint of its own, ``<disk_dir>/<version>``, loaded from disk."""

    @classmethod
    def check_config(cls, config):
        if not config.disk_dir or config.hf_config is None:
            raise ValueError("weight sync mode 'test-version-dir' needs disk_dir and hf_config")

    def push(self, named_tensors, version):
        path = write_hf_checkpoint(os.path.join(self.config.disk_dir, version), named_tensors, self.config.hf_config)
        self.load_from_disk(path, version)


@pytest.fixture
def version_dir_mode():
    register_weight_sync_mode("test-version-dir")(VersionDirSync)
    try:
        yield
    finally:
        WEIGHT_SYNC_MODES.unregister("test-version-dir")


@pytest.mark.double_only  # the double and the tests share a file system; a real server may not
def test_a_registered_mode_runs_from_the_config_to_the_engines(server, tiny_ckpt, tmp_path, version_dir_mode):
    _, hf_cfg, tok = tiny_ckpt
    with pytest.raises(ValueError, match="'test-version-dir' needs disk_dir and hf_config"):
        WeightSyncConfig(mode="test-version-dir")
    overrides = [
        "rollout.engine=sglang",
        "rollout.sglang.urls=" + json.dumps([server.url]),
        "rollout.sglang.weight_sync=test-version-dir",
        f"rollout.sglang.disk_dir={tmp_path / 'engine_weights'}",
        "anchor.source=swap",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"logging.dir={tmp_path / 'runs'}",
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), overrides)
    release_engines_at_start(cfg)  # colocated (the default): as trainer/run.py, before the first push
    policy, _ = make_sglang_engines(cfg, hf_cfg)(
        tiny_weights(hf_cfg, seed=5, sharpen=8.0), None, policy_version="step-1", reference_version="r"
    )
    try:
        assert type(policy.sync) is VersionDirSync
        greedy = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        assert policy.generate([encode(tok, "3*3")], 1, greedy)[0][0].weight_version == "step-1"
        assert (tmp_path / "engine_weights" / "policy" / "step-1" / "config.json").exists()
    finally:
        policy.shutdown()


def test_the_built_in_modes_are_their_registered_classes():
    config = dict(disk_dir="unused", hf_config={})
    assert dict(WEIGHT_SYNC_MODES) == {
        "tensor": TensorWeightSync,
        "distributed": DistributedWeightSync,
        "disk": DiskWeightSync,
    }
    assert type(make_weight_sync([object()], WeightSyncConfig(mode="disk", **config))) is DiskWeightSync
    with pytest.raises(ValueError, match="^weight sync mode 'disk' needs disk_dir$"):
        WeightSyncConfig(mode="disk")


def test_an_unknown_mode_fails_in_one_line_listing_the_registered_ones():
    with pytest.raises(ValueError) as err:
        WeightSyncConfig(mode="tensr")
    assert (
        str(err.value) == "unknown weight sync mode 'tensr' (did you mean 'tensor'?); known: tensor, distributed, disk"
    )
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["rollout.sglang.weight_sync=tensr"])
    assert str(err.value) == (
        "rollout.sglang.weight_sync: unknown weight sync mode 'tensr'; known: tensor, distributed, disk"
    )


def test_the_config_names_the_built_in_modes_where_they_live():
    for mode in ("tensor", "distributed", "disk"):
        target = WEIGHT_SYNC_MODES.entry(mode, load=False).target
        module, _, attribute = target.partition(":")
        assert module == "armor_megatron.rollout.sglang.weight_sync" and WEIGHT_SYNC_MODES[mode].__name__ == attribute
