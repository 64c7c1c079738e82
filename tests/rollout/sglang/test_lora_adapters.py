"""LoRA adapters loaded into a running server (``lora.sync: adapter``), against the SGLang TEST DOUBLE.

The double serves ``--enable-lora`` as SGLang 0.5.23 does (armor_megatron/rollout/testing/lora_serving.py):
a policy request names the adapter and samples with it, a request without ``lora_path`` samples the
base. What an adapter does to the model is checked against HF PEFT applying the same adapter.
"""

import pytest
import torch

from armor_megatron.rollout.engine import SamplingParams, WeightUpdateError
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangHTTPError
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.lora_adapters import adapter_bytes, load_adapter, unload_adapter
from armor_megatron.rollout.testing.lora_serving import LoRAServing
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _config(rank=RANK, modules=MODULES):
    return {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": modules, "bias": "none"}


def _adapter(hf_config, seed, rank=RANK):
    """A PEFT adapter with B ≠ 0 on every projection of every layer, as HF PEFT names it."""
    g = torch.Generator().manual_seed(seed)
    h, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads, kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    d = h // heads
    shapes = {
        "self_attn.q_proj": (h, heads * d),
        "self_attn.k_proj": (h, kv * d),
        "self_attn.v_proj": (h, kv * d),
        "self_attn.o_proj": (heads * d, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    out = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.3
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3
    return out


@pytest.fixture
def lora_server(tiny_ckpt):
    path, _, _ = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="step-0")
    with SGLangTestServer(engine, model_path=path, lora=LoRAServing(RANK, MODULES)) as server:
        yield server


def _peft_model(path, adapter=None, config=None):
    """The transformers model at ``path``, with HF PEFT applying ``adapter`` when given."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    if adapter is None:
        return model
    cfg = peft.LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"])
    model = peft.get_peft_model(model, cfg)
    state = {k.replace(".weight", ".default.weight"): v for k, v in adapter.items()}
    assert set(state) <= set(model.state_dict()), sorted(set(state) - set(model.state_dict()))[:3]
    peft.set_peft_model_state_dict(model, state)
    return model


def _logprobs(model, prompt, sample):
    """log π(response | prompt) per response token."""
    ids = torch.tensor([prompt + list(sample.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]


def test_a_policy_request_samples_with_the_adapter_and_one_without_samples_the_base(lora_server, tiny_ckpt):
    path, hf_config, _ = tiny_ckpt
    adapter, config = _adapter(hf_config, seed=1), _config()
    engine = SGLangEngine([lora_server.url], weight_version="step-0")
    sent = engine.load_adapter("policy-step-1-ref-0", config, adapter, "step-1")
    assert sent == adapter_bytes(adapter) == sum(t.numel() * 4 for t in adapter.values())
    assert engine.adapter == "policy-step-1-ref-0" and lora_server.engine.weight_version == "step-1"
    policy = engine.generate(PROMPTS, 2, SAMPLING)
    base = engine.generate(PROMPTS, 2, SAMPLING, base=True)
    adapted, plain = _peft_model(path, adapter, config), _peft_model(path)
    for prompt, group in zip(PROMPTS, policy):
        for s in group:
            assert s.weight_version == "step-1"
            assert torch.allclose(torch.tensor(s.logprobs), _logprobs(adapted, prompt, s), atol=1e-4)
    for prompt, group in zip(PROMPTS, base):
        for s in group:
            assert torch.allclose(torch.tensor(s.logprobs), _logprobs(plain, prompt, s), atol=1e-4)
    # the adapter moves the log-probs: the adapted model's differ from the base's on the base's tokens
    s = base[0][0]
    assert not torch.allclose(_logprobs(adapted, PROMPTS[0], s), torch.tensor(s.logprobs), atol=1e-2)
    engine.shutdown()


def test_the_next_adapter_replaces_the_previous_and_a_repeated_name_loads_again(lora_server, tiny_ckpt):
    _, hf_config, _ = tiny_ckpt
    engine = SGLangEngine([lora_server.url], weight_version="step-0")
    engine.load_adapter("policy-step-1-ref-0", _config(), _adapter(hf_config, 1), "step-1")
    engine.load_adapter("policy-step-2-ref-0", _config(), _adapter(hf_config, 2), "step-2")
    assert lora_server.lora.loaded() == {"policy-step-2-ref-0": "__tensor__"}  # the previous one unloaded
    # a client that knows nothing (a resumed trainer) repeats a step: the name is unloaded and loaded again
    again = SGLangEngine([lora_server.url], weight_version="step-2")
    third = _adapter(hf_config, 3)
    again.load_adapter("policy-step-2-ref-0", _config(), third, "step-2")
    held = lora_server.lora.adapters["policy-step-2-ref-0"][1]
    assert all(torch.equal(held[name], t) for name, t in third.items())  # the new tensors, not the old
    assert again.generate(PROMPTS[:1], 1, SAMPLING)[0][0].weight_version == "step-2"
    engine.shutdown()
    again.shutdown()


def test_what_sglang_refuses_is_refused(lora_server, tiny_ckpt):
    path, hf_config, _ = tiny_ckpt
    client = SGLangEngine([lora_server.url], weight_version="step-0").workers[0]
    adapter = _adapter(hf_config, 1)
    with pytest.raises(WeightUpdateError, match="incompatible with the current LoRA memory pool"):
        load_adapter(client, "too-wide", _config(rank=RANK * 2), _adapter(hf_config, 1, rank=RANK * 2), 1)
    with pytest.raises(WeightUpdateError, match="incompatible"):
        load_adapter(client, "other-modules", _config(modules=["lm_head"]), adapter, 1)
    load_adapter(client, "a", _config(), adapter, 1)
    with pytest.raises(WeightUpdateError, match="already loaded"):
        load_adapter(client, "a", _config(), adapter, 1)
    with pytest.raises(WeightUpdateError, match="does not exist"):
        unload_adapter(client, "b")
    with pytest.raises(SGLangHTTPError, match="never been loaded"):
        client.generate(PROMPTS[0], {"max_new_tokens": 2}, lora_path="b")
    # a server started without --enable-lora
    engine = LocalEngine.from_pretrained(path, weight_version="step-0")
    with SGLangTestServer(engine, model_path=path) as plain:
        bare = SGLangEngine([plain.url], weight_version="step-0")
        with pytest.raises(WeightUpdateError, match="LoRA is not enabled"):
            bare.load_adapter("policy-step-1-ref-0", _config(), adapter, "step-1")
        with pytest.raises(SGLangHTTPError, match="LoRA is not enabled"):
            bare.workers[0].generate(PROMPTS[0], {"max_new_tokens": 2}, lora_path="a")


def test_an_adapter_applies_to_the_base_the_server_holds_now(lora_server, tiny_ckpt, tmp_path):
    """A reference reset pushes a new base: requests naming an adapter loaded before apply it to the new base."""
    from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint

    _, hf_config, _ = tiny_ckpt
    other = str(tmp_path / "other")
    make_tiny_checkpoint(other, seed=7, sharpen=8.0)
    adapter, config = _adapter(hf_config, seed=1), _config()
    engine = SGLangEngine([lora_server.url], weight_version="step-0")
    engine.load_adapter("policy-step-1-ref-0", config, adapter, "step-1")
    engine.generate(PROMPTS[:1], 1, SAMPLING)  # the adapter applied to the first base
    engine.update_weights(other, "step-1")
    [[s]] = engine.generate(PROMPTS[:1], 1, SAMPLING)
    want = _logprobs(_peft_model(other, adapter, config), PROMPTS[0], s)
    assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)
    engine.shutdown()
