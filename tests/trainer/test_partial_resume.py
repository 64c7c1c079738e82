"""Partial rollouts in the whole loop, in this process: ``trainer.run.train`` at world size 1 with
``rollout.partial`` on, against an SGLang TEST DOUBLE in this process that decodes one token per
0.5 s under deterministic inference (seeds honoured); the trainer sends a ``sampling_seed`` per
request (``rollout.sglang.deterministic``). Each step keeps twice the groups it needs in flight
(over-provision 2), at most 2 policy versions per response (rule ``finish``)."""

import os
import signal
import threading
import time

import pytest
from transformers import AutoTokenizer

from armor_megatron.config import load_config
from armor_megatron.megatron.checkpoint import load_trainer_state
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.trainer.metrics_log import read_metrics
from armor_megatron.trainer.preemption import Preempted
from tests.trainer.test_loop_in_process import _train as train_here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SECONDS_PER_TOKEN = 0.5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RESPONSES: list[list[tuple[str, str, float]]] = []  # (prompt, response, score) of every step's trained rows


def record_responses(samples):
    """logging.sample_metrics: keeps the step's trained responses (their text: one character per token id)."""
    RESPONSES.append([(s["prompt"], s["response"], s["score"]) for s in samples])
    return {}


def _model(tiny):
    return next(o.split("=", 1)[1] for o in tiny if o.startswith("model.path="))


@pytest.fixture
def double(tiny, world_of_one):
    """The deterministic, slowly decoding SGLang test double on the tiny model, in this process."""
    model = _model(tiny)
    engine = LocalEngine.from_pretrained(model, weight_version="step-0")
    with SGLangTestServer(engine, model_path=model, deterministic=True, seconds_per_token=SECONDS_PER_TOKEN) as server:
        yield server


def _train(tiny, run_dir, server, *overrides, resume=None):
    """``train`` of the partial run in ``run_dir`` (one thread): {step: metrics} as logged, and the trained responses of each step."""
    cfg = load_config(
        CONFIG,
        [
            *tiny,
            "parallelism.tp=1",
            "train.deterministic=false",  # torch's global switch would outlive the test
            f"checkpoint.dir={run_dir}/ckpt",
            f"logging.dir={run_dir}/runs",
            "name=run",
            "rollout.engine=sglang",
            f"rollout.sglang.urls=[{server.url}]",
            "rollout.sglang.deterministic=true",
            "rollout.sglang.weight_sync=disk",
            "anchor.enabled=false",
            "rollout.partial.enabled=true",
            "rollout.partial.over_provision=2",
            "rollout.partial.max_versions=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_response_len=12",
            "algorithm.dynamic_sampling.enabled=false",
            "algorithm.tis.enabled=true",
            "train.micro_batch_size=8",
            "train.mini_batches_per_step=1",
            "eval.every_steps=0",
            f"logging.sample_metrics={__name__}:record_responses",
            *overrides,
        ],
    )
    RESPONSES.clear()
    try:
        metrics = train_here(cfg, resume)
    finally:
        assert not [
            t.name for t in threading.enumerate() if t.name.startswith("partial-rollout")
        ]  # closed with the run
    return metrics, list(RESPONSES)


def _partial_state(run_dir, step):
    return load_trainer_state(str(run_dir / "ckpt" / f"iter_{step:07d}"))["partial_rollouts"]["generator"]


def test_a_run_resumed_with_responses_buffered_continues_them_bit_for_bit(tiny, tmp_path, double):
    """What a resume repeats bit for bit (deterministic inference, a seed per request): the
    checkpoint's buffer, groups in progress and rows drawn; every continuation of the buffered
    responses, whose seed comes from the run's seed, the group, the response and how often it was
    continued, not from time; so the carried groups' responses (with max_versions 2 and rule
    finish all of them end in step 2, trained or held complete for step 3). Not repeated: which
    groups complete first, which time decides (on a real engine too): this model answers in
    responses of equal lengths, so two new groups of step 2 complete in the same token time and
    either may train; where step 2 cuts its own surplus; hence step 2's update and what follows.
    """
    straight, trained = _train(tiny, tmp_path, double, "train.steps=2", "checkpoint.every_steps=1")
    saved = _partial_state(tmp_path, 1)
    buffered = saved["buffer"]["items"]
    assert buffered and straight[1]["partial/buffered"] == len(buffered)  # step 1 cut responses and kept them
    tokenizer = AutoTokenizer.from_pretrained(_model(tiny))
    carried = {tokenizer.decode(g["prompt_ids"]): g["key"] for g in saved["groups"]}
    keys = set(carried.values())

    def carried_responses(final, rows):
        """The carried groups' responses after step 2 by prompt: trained (``rows``), or held complete in ``final``."""
        held = {g["key"]: [g["done"][str(k)]["text"] for k in range(4)] for g in final["groups"] if g["key"] in keys}
        return {prompt: [r for p, r, _ in rows if p == prompt] or held.get(key) for prompt, key in carried.items()}

    first = carried_responses(_partial_state(tmp_path, 2), trained[1])
    assert any(len(set(texts)) > 1 for texts in first.values())  # a seed each (unseeded, the server draws alike)
    resumed, retrained = _train(
        tiny,
        tmp_path,
        double,
        "train.steps=2",
        "checkpoint.every_steps=1",
        f"logging.dir={tmp_path}/resumed",
        resume=str(tmp_path / "ckpt" / "iter_0000001"),
    )
    # every buffered response is continued in step 2, to its end, to the same tokens
    assert resumed[2]["partial/continued"] == straight[2]["partial/continued"] == len(buffered)
    assert resumed[2]["partial/tokens_carried"] == sum(len(b["token_ids"]) for b in buffered)
    again = carried_responses(_partial_state(tmp_path, 2), retrained[0])
    assert all(len(texts) == 4 for texts in first.values()) and again == first


def test_a_preemption_during_generation_aborts_the_requests_and_checkpoints_their_tokens(tiny, tmp_path, double):
    """SIGTERM while step 2's requests decode: they are aborted (the rule finish's too), their tokens
    go to the buffer of the checkpoint the signal writes (checkpoints are not due otherwise), with
    the groups complete by then; the resumed run continues every buffered response."""
    log = tmp_path / "runs" / "run" / "metrics.jsonl"

    def signal_while_step_2_decodes():
        while not (log.exists() and read_metrics(str(log))):  # step 1 trained; its requests all ended
            time.sleep(0.01)
        while not double.decoding():
            time.sleep(0.01)
        time.sleep(2 * SECONDS_PER_TOKEN)  # a few tokens into them
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_while_step_2_decodes, daemon=True).start()
    with pytest.raises(Preempted, match="during step 2"):
        _train(tiny, tmp_path, double, "train.steps=3", "checkpoint.every_steps=0")
    assert double.decoding() == []  # nothing left decoding
    saved = _partial_state(tmp_path, 1)
    buffered = saved["buffer"]["items"]
    cut = {b["key"]: b for b in buffered}
    for group in saved["groups"]:  # every response of every group drawn: complete, or cut and kept
        kept = {int(k) for k in group["done"]}
        kept |= {int(k.rsplit("/", 1)[1]) for k in cut if k.rsplit("/", 1)[0] == group["key"]}
        assert kept == set(range(4)), group
    assert {k.rsplit("/", 1)[0] for k in cut} <= {g["key"] for g in saved["groups"]}
    assert any(s[0] == "step-1" for b in buffered for s in b["spans"])  # tokens of the stopped step, kept
    resumed, _ = _train(tiny, tmp_path, double, "train.steps=2", f"logging.dir={tmp_path}/resumed")
    assert resumed[2]["partial/continued"] == len(buffered) and resumed[2]["partial/wasted_tokens"] == 0
    assert resumed[2]["partial/tokens_carried"] == sum(len(b["token_ids"]) for b in buffered)
