"""The engine interface: every engine takes the memory calls as the trainer makes them."""

import inspect

import pytest

from armor_megatron.launch.device_ledger import KV_AND_GRAPHS, POLICY_RELEASE, REFERENCE_RELEASE
from armor_megatron.rollout.engine import MEMORY_TAGS, RolloutEngine
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.testing import sglang_test_server
from tests.trainer.test_colocated_memory import LedgerEngine


def _engines(cls=RolloutEngine):
    for sub in cls.__subclasses__():
        yield sub
        yield from _engines(sub)


@pytest.mark.parametrize("method", ["release_memory", "resume_memory"])
def test_every_engine_takes_the_memory_calls_of_the_interface(method):
    engines = set(_engines())
    assert {LocalEngine, SGLangEngine, LedgerEngine} <= engines
    interface = inspect.signature(getattr(RolloutEngine, method)).parameters
    assert list(interface) == ["self", "timeout", "tags"] and interface["tags"].default == MEMORY_TAGS
    for engine in engines:
        params = inspect.signature(getattr(engine, method)).parameters
        assert [(p.name, p.default) for p in params.values()] == [(p.name, p.default) for p in interface.values()], (
            engine
        )


def test_the_tags_the_trainer_releases_are_the_ones_sglang_knows():
    assert MEMORY_TAGS == sglang_test_server.MEMORY_TAGS
    assert set(POLICY_RELEASE) | set(REFERENCE_RELEASE) | set(KV_AND_GRAPHS) <= set(MEMORY_TAGS)


def test_the_local_engine_takes_the_trainers_calls_and_refuses_unknown_tags(tiny_ckpt):
    engine = LocalEngine.from_pretrained(tiny_ckpt[0])
    engine.release_memory(tags=REFERENCE_RELEASE)
    engine.resume_memory(tags=REFERENCE_RELEASE)
    engine.release_memory()
    engine.resume_memory(timeout=1.0, tags=("weights",))
    for bad in (("weights", "kv"), "weights"):
        with pytest.raises(ValueError, match="memory tags must be a sequence of"):
            engine.release_memory(tags=bad)
        with pytest.raises(ValueError, match="memory tags must be a sequence of"):
            engine.resume_memory(tags=bad)
