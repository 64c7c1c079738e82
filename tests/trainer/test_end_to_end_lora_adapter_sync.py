"""``lora.sync: adapter`` in the whole loop: ``armor-train`` with LoRA (TP=2) attached to one SGLang test-double
process started with ``--enable-lora`` (colocated, ``disk`` sync for full weights). Each step the engine gets
the adapters' A and B only; policy requests name the step's adapter and sample the trainer's adapted policy,
anchors (``anchor.source: swap``) name none and sample the base, which is π_ref, without a weight swap; a
reference reset merges the adapters, so the base goes through the weight sync once, then the fresh adapter."""

import json
import os

import pytest

from armor_megatron.config.schema import lora_peft_modules
from tests.trainer.test_end_to_end import _train
from tests.trainer.test_end_to_end_sglang import _get, launched_doubles, tiny_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANK = 4
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture
def server(tiny, tmp_path):
    """One test-double SGLang server on the tiny model, serving LoRA adapters as SGLang 0.5.23 does."""
    with launched_doubles(
        tiny,
        tmp_path,
        lora_rank=RANK,
        lora_target_modules=lora_peft_modules(TARGETS),
        # seeded sampling (with rollout.sglang.deterministic): unseeded, the samples depend on the order the
        # concurrent requests arrive in, and whether an anchor is found at steps 2-3 held for most orders only
        deterministic=True,
    ) as launcher:
        yield tiny_model_path(tiny), launcher.worker_urls[0]


def _adapter_bytes(model_path):
    """Bytes of A and B of every projection of every layer: r·(in + out) each, fp32."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    return RANK * per_layer * layers * 4


def test_adapter_sync_sends_a_and_b_each_step_and_the_base_after_a_reset(tiny, tmp_path, server):
    model, url = server
    metrics = _train(
        tiny,
        tmp_path,
        "rollout.engine=sglang",
        f"rollout.sglang.urls=[{url}]",
        "rollout.sglang.weight_sync=disk",
        "rollout.sglang.placement=colocated",
        "lora.enabled=true",
        f"lora.rank={RANK}",
        "lora.alpha=8",
        "lora.sync=adapter",
        "optimizer.lr=2e-3",
        "anchor.source=swap",
        "rollout.prompts_per_step=4",
        "rollout.max_response_len=8",
        "train.steps=3",
        "reference.tau=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "rollout.sglang.deterministic=true",  # every sample its own seed: the same run under any load
    )
    assert sorted(metrics) == [1, 2, 3]
    expected = float(_adapter_bytes(model))
    for step in (1, 2, 3):
        m = metrics[step]
        assert m["train/grad_norm"] > 0  # dynamic sampling kept groups with a signal: the adapters train
        # policy requests named the step's adapter: the engine sampled the trainer's adapted policy
        assert m["rollout/logprob_abs_diff"] < 1e-5, (step, m["rollout/logprob_abs_diff"])
        # anchors named none: the engine's base is π_ref (after the reset at step 2 too: the merged base)
        assert m.get("rollout/anchor_logprob_abs_diff", 0.0) < 1e-5, (step, m["rollout/anchor_logprob_abs_diff"])
        assert m["sync/adapter_bytes"] == expected
    assert metrics[2]["reference/reset"] == 1.0
    assert any("rollout/anchor_logprob_abs_diff" in metrics[step] for step in (2, 3))  # anchors were trained on
    # π_ref is the base: away from the policy once it trained, equal to it right after the merge
    assert metrics[2]["train/approx_kl_ref"] > 0 and metrics[3]["train/approx_kl_ref"] < 1e-9
    requests = _get(url + "/test_double/requests")
    # full weights twice (the start and the reset), adapters at the start, every step and after the reset
    assert requests["/update_weights_from_disk"] == 2, requests
    assert requests["/load_lora_adapter_from_tensors"] == 5, requests
    assert requests["/unload_lora_adapter"] == 4, requests  # each previous adapter, once the next is in
    assert "/update_weights_from_tensor" not in requests
    assert _get(url + "/model_info")["weight_version"] == "step-3"
