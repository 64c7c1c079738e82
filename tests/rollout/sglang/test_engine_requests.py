"""How SGLangEngine asks SGLang for samples (over HTTP, against the SGLang TEST DOUBLE): one request
with ``n`` per prompt and no seed by default; per-sample seeds in deterministic mode, for servers
run with ``--enable-deterministic-inference``."""

import pytest

from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.sglang.engine import SGLangEngine, sglang_sampling_params
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode

from .conftest import FAST_RETRY

pytestmark = pytest.mark.timeout(120)
SAMPLING = SamplingParams(max_new_tokens=6, ignore_eos=True)


def test_sampling_params_of_one_prompt():
    sampling = SamplingParams(max_new_tokens=4, top_k=0, seed=5)
    plain = sglang_sampling_params(sampling, 3)
    # SGLang ignores sampling_seed without deterministic inference: never sent
    assert plain["n"] == 3 and plain["top_k"] == -1 and "sampling_seed" not in plain
    seeded = sglang_sampling_params(sampling, 3, seed=10)
    assert [p["sampling_seed"] for p in seeded] == [10, 11, 12] and {p["n"] for p in seeded} == {1}


@pytest.fixture
def sent(monkeypatch):
    """The ``sampling_params`` of every /generate request the client sends."""
    calls = []
    real = SGLangClient.generate

    def spy(self, input_ids, sampling_params, *args, **kwargs):
        calls.append(sampling_params)
        return real(self, input_ids, sampling_params, *args, **kwargs)

    monkeypatch.setattr(SGLangClient, "generate", spy)
    return calls


def _double(tiny_ckpt, **kwargs):
    path, _, _ = tiny_ckpt
    return SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path, **kwargs)


def test_one_request_with_n_per_prompt_by_default(tiny_ckpt, sent):
    _, _, tok = tiny_ckpt
    prompts = [encode(tok, p) for p in ("1+", "22", "3-1")]
    with _double(tiny_ckpt) as server:
        engine = SGLangEngine([server.url], retry=FAST_RETRY)
        engine.reseed(7)  # recorded, not sent: SGLang would ignore the seeds
        groups = engine.generate(prompts, 4, SAMPLING)
        seeded = engine.generate(prompts, 4, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=3))
        assert server.requests["/generate"] == 2 * len(prompts)
    assert all(isinstance(p, dict) and p["n"] == 4 and "sampling_seed" not in p for p in sent)
    for group in groups + seeded:
        assert len(group) == 4 and len({s.token_ids for s in group}) > 1


def test_deterministic_mode_seeds_every_sample_and_repeats_after_reseed(tiny_ckpt, sent):
    _, _, tok = tiny_ckpt
    prompts = [encode(tok, p) for p in ("1+", "22")]
    with _double(tiny_ckpt, deterministic=True) as server:
        engine = SGLangEngine([server.url], retry=FAST_RETRY, deterministic=True)
        draws = []
        for _ in range(2):
            engine.reseed(123)
            draws.append([[s.token_ids for s in g] for g in engine.generate(prompts, 3, SAMPLING)])
        assert server.requests["/generate"] == 2 * len(prompts)  # a batch of n copies per prompt, to one engine
        # seeds 123 + k·n + j: request k of the step, sample j
        assert [[p["sampling_seed"] for p in params] for params in sent[:2]] == [[123, 124, 125], [126, 127, 128]]
        assert draws[0] == draws[1] and all(len(set(g)) == 3 for g in draws[0])
        # what goes wrong when the two sides disagree: a plain n request to a deterministic server
        # seeds every copy with 42, all n samples alike
        plain = SGLangEngine([server.url], retry=FAST_RETRY).generate(prompts, 3, SAMPLING)
        assert all(len({s.token_ids for s in g}) == 1 for g in plain)


def test_the_trainer_factory_makes_deterministic_engines_when_asked(tiny_ckpt, tmp_path, sent):
    import json
    import os

    from armor_megatron.config import load_config
    from armor_megatron.rollout.testing.tiny_models import tiny_weights
    from armor_megatron.trainer.components import make_sglang_engines, release_engines_at_start

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _, hf_cfg, tok = tiny_ckpt
    with _double(tiny_ckpt, deterministic=True) as server:
        overrides = [
            "rollout.engine=sglang",
            "rollout.sglang.urls=" + json.dumps([server.url]),
            "rollout.sglang.deterministic=true",
            "anchor.source=swap",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'runs'}",
        ]
        cfg = load_config(os.path.join(root, "configs", "tiny_cpu.yaml"), overrides)
        release_engines_at_start(cfg)  # colocated (the default): as trainer/run.py, before the first push
        policy, reference = make_sglang_engines(cfg, hf_cfg)(
            tiny_weights(hf_cfg, seed=3), None, policy_version="p1", reference_version="r1"
        )
        try:
            assert policy.deterministic and reference is None
            policy.reseed(11)
            group = policy.generate([encode(tok, "1+")], 3, SAMPLING)[0]
        finally:
            policy.shutdown()
    assert [p["sampling_seed"] for p in sent[-1]] == [11, 12, 13] and len({s.token_ids for s in group}) == 3
