"""Weight-sync modes are `WeightSync` classes registered in ``WEIGHT_SYNC_MODES``: a mode registered
here is checked by `WeightSyncConfig`, built by the engine and pushes weights into a server (the
test double by default, see conftest) with no other edit; a wrong mode fails in one line listing
the registered ones.

The run config names a mode in ``rollout.sglang.weight_sync``, whose accepted values the config
layer declares itself (it sits below rollout/ and cannot read this registry): a new mode's config
is its name there, and the schema and the registry must list the same modes."""

import os
import typing

import pytest

from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.schema import SGLangConfig
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.hf_checkpoint import write_hf_checkpoint
from armor_megatron.rollout.sglang.engine import SGLangEngine
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

from .conftest import FAST_RETRY

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
def test_a_registered_mode_is_built_by_the_engine_and_pushes_weights(server, tiny_ckpt, tmp_path, version_dir_mode):
    _, cfg, tok = tiny_ckpt
    with pytest.raises(ValueError, match="'test-version-dir' needs disk_dir and hf_config"):
        WeightSyncConfig(mode="test-version-dir")
    sync = WeightSyncConfig(mode="test-version-dir", disk_dir=str(tmp_path), hf_config=cfg)
    engine = SGLangEngine([server.url], weight_sync=sync, retry=FAST_RETRY, request_timeout=60.0)
    try:
        assert type(engine.sync) is VersionDirSync
        engine.update_weights(tiny_weights(cfg, seed=5, sharpen=8.0), version="step-1")
        greedy = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        assert engine.generate([encode(tok, "3*3")], 1, greedy)[0][0].weight_version == "step-1"
        assert (tmp_path / "step-1" / "config.json").exists()
    finally:
        engine.shutdown()


def test_the_built_in_modes_are_their_registered_classes():
    config = dict(disk_dir="unused", hf_config={})
    assert dict(WEIGHT_SYNC_MODES) == {
        "tensor": TensorWeightSync,
        "disk": DiskWeightSync,
        "distributed": DistributedWeightSync,
    }
    assert type(make_weight_sync([object()], WeightSyncConfig(mode="disk", **config))) is DiskWeightSync
    with pytest.raises(ValueError, match="^weight sync mode 'disk' needs disk_dir$"):
        WeightSyncConfig(mode="disk")


def test_an_unknown_mode_fails_in_one_line_listing_the_registered_ones():
    with pytest.raises(ValueError) as err:
        WeightSyncConfig(mode="tensr")
    assert (
        str(err.value) == "unknown weight sync mode 'tensr' (did you mean 'tensor'?); known: tensor, disk, distributed"
    )
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["rollout.sglang.weight_sync=tensr"])
    assert str(err.value).startswith("rollout.sglang.weight_sync: 'tensr' is not one of") and "\n" not in str(err.value)


def test_the_config_accepts_exactly_the_registered_modes():
    declared = typing.get_args(typing.get_type_hints(SGLangConfig)["weight_sync"])
    assert sorted(declared) == sorted(WEIGHT_SYNC_MODES)
