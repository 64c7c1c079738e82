import pytest
import torch

from armor_megatron.rollout.engine import SamplingParams, StaleWeightsError, WeightUpdateError
from armor_megatron.rollout.local import LocalEngine, sample_next_tokens
from armor_megatron.rollout.testing.tiny_models import encode, tiny_weights


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    path, _, _ = tiny_ckpt
    return LocalEngine.from_pretrained(path, weight_version="v0")


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    # Token t of the response is predicted at position len(prompt) - 1 + t.
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return lp[pos, torch.tensor(response)]


def test_logprobs_equal_teacher_forced_forward(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    # Different prompt lengths so that the batch is left-padded.
    prompts = [encode(tok, "12+7="), encode(tok, "a"), encode(tok, "what is 3-1?")]
    groups = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=6, seed=3, ignore_eos=True))
    assert [len(g) for g in groups] == [2, 2, 2]
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert len(s.token_ids) == 6 and s.finish_reason == "length"
            expected = teacher_forced_logprobs(engine.model, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_seeded_generation_is_reproducible_and_seed_sensitive(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompts = [encode(tok, "1+1=")]
    a = engine.generate(prompts, 4, SamplingParams(max_new_tokens=5, seed=11, temperature=2.0, ignore_eos=True))
    b = engine.generate(prompts, 4, SamplingParams(max_new_tokens=5, seed=11, temperature=2.0, ignore_eos=True))
    c = engine.generate(prompts, 4, SamplingParams(max_new_tokens=5, seed=12, temperature=2.0, ignore_eos=True))
    assert a == b
    assert [s.token_ids for s in a[0]] != [s.token_ids for s in c[0]]


def test_stop_token_is_kept_in_ids_but_not_in_text(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "9-4=")
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    free = engine.generate([prompt], 1, greedy)[0][0]
    stop_tok = free.token_ids[1]  # greedy decoding hits this token at step 2
    stopped = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=(stop_tok,)))
    s = stopped[0][0]
    assert s.finish_reason == "stop"
    assert s.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    assert s.text == tok.decode(list(s.token_ids[:-1]), skip_special_tokens=True)
    # ignore_eos disables stop_token_ids too (SGLang 0.5.x semantics).
    ignored = engine.generate(
        [prompt], 1, SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=(stop_tok,), ignore_eos=True)
    )
    assert ignored[0][0].finish_reason == "length" and ignored[0][0].token_ids == free.token_ids


def test_stop_string_cuts_text(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "zz")
    free = engine.generate([prompt], 1, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0][0]
    stop = free.text[2]  # a character greedy decoding produces third
    s = engine.generate([prompt], 1, SamplingParams(max_new_tokens=6, temperature=0, stop=(stop,), ignore_eos=True))[0][
        0
    ]
    assert s.finish_reason == "stop"
    assert s.text == free.text[: free.text.index(stop)]


def test_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        assert sample_next_tokens(logits, SamplingParams(top_k=1), g).tolist() == [1, 0]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs ~ [0.66, 0.24, 0.09, 0.01]: with top_p=0.7 the first two tokens are kept
    # (0.66 < 0.7 so the second is still needed), never the last two.
    logits = torch.log(torch.tensor([[0.66, 0.24, 0.09, 0.01]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next_tokens(logits, SamplingParams(top_p=0.7), g)) for _ in range(200)}
    assert drawn == {0, 1}


def test_update_weights_changes_outputs_and_version(tiny_ckpt):
    path, cfg, tok = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="v0")
    prompt = [encode(tok, "5+5=")]
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    before = engine.generate(prompt, 1, greedy)[0][0]
    new = tiny_weights(cfg, seed=1, sharpen=8.0)
    engine.update_weights(new, version="v1")
    after = engine.generate(prompt, 1, greedy)[0][0]
    params = dict(engine.model.named_parameters())
    for name, tensor in new:  # every pushed tensor landed, bit for bit
        assert torch.equal(params[name].detach(), tensor.to(params[name].dtype)), name
    # and the engine samples what an engine built from those weights samples
    fresh = LocalEngine(cfg, new, tokenizer=tok, weight_version="v1").generate(prompt, 1, greedy)[0][0]
    assert after == fresh and after.weight_version == "v1"
    assert after.logprobs != before.logprobs
    with pytest.raises(WeightUpdateError, match="missing"):
        engine.update_weights(tiny_weights(cfg, seed=2)[:-1], version="v2")
    # All or nothing: the refused update changed no weight.
    assert engine.generate(prompt, 1, greedy)[0][0] == after
    with pytest.raises(WeightUpdateError, match="does not exist"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version="v2")


def test_stale_version_is_caught(engine, tiny_ckpt, monkeypatch):
    _, _, tok = tiny_ckpt
    # A sample stamped with another version than the engine holds must not pass silently.
    monkeypatch.setattr(engine, "weight_version", "v0")  # restored after the test, even when it fails
    real = engine._generate_batch

    def swap_weights_midway(*args, **kwargs):
        out = real(*args, **kwargs)
        engine.weight_version = "v9"
        return out

    monkeypatch.setattr(engine, "_generate_batch", swap_weights_midway)
    with pytest.raises(StaleWeightsError, match="'v0'.*expected 'v9'"):
        engine.generate([encode(tok, "1")], 1, SamplingParams(max_new_tokens=2))


def test_bad_input_is_one_clear_error(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[3], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_generation_past_its_timeout_raises(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    with pytest.raises(TimeoutError, match="passed its timeout"):
        engine.generate([encode(tok, "1")], 2, SamplingParams(max_new_tokens=64, ignore_eos=True), timeout=0.0)


def tiny_moe():
    """A 1-layer Qwen3-MoE (2 experts) as HF checkpoint tensors: experts named per expert."""
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    shapes = {
        "model.embed_tokens.weight": (40, 32),
        "lm_head.weight": (40, 32),
        "model.norm.weight": (32,),
        "model.layers.0.input_layernorm.weight": (32,),
        "model.layers.0.post_attention_layernorm.weight": (32,),
        "model.layers.0.self_attn.q_proj.weight": (32, 32),
        "model.layers.0.self_attn.k_proj.weight": (16, 32),
        "model.layers.0.self_attn.v_proj.weight": (16, 32),
        "model.layers.0.self_attn.o_proj.weight": (32, 32),
        "model.layers.0.self_attn.q_norm.weight": (8,),
        "model.layers.0.self_attn.k_norm.weight": (8,),
        "model.layers.0.mlp.gate.weight": (2, 32),
    }
    for e in range(2):
        shapes[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = (16, 32)
        shapes[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = (16, 32)
        shapes[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = (32, 16)
    g = torch.Generator().manual_seed(0)
    return cfg, [(n, torch.randn(s, generator=g) * 0.1) for n, s in shapes.items()]


def test_moe_checkpoint_names_load_through_transformers():
    # transformers 5 holds experts fused ([E, 2f, h] gate_up_proj); checkpoints name them per expert.
    cfg, named = tiny_moe()
    engine = LocalEngine(cfg, named, weight_version="moe-0")
    fused = engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    given = dict(named)
    assert torch.equal(fused[1, :16], given["model.layers.0.mlp.experts.1.gate_proj.weight"])
    assert torch.equal(fused[1, 16:], given["model.layers.0.mlp.experts.1.up_proj.weight"])
    s = engine.generate([[3, 4, 5]], 1, SamplingParams(max_new_tokens=3, ignore_eos=True))[0][0]
    torch.testing.assert_close(
        torch.tensor(s.logprobs), teacher_forced_logprobs(engine.model, [3, 4, 5], s.token_ids), atol=1e-5, rtol=0
    )
    with pytest.raises(WeightUpdateError, match="could not load the update"):
        engine.update_weights(named[:-1], version="moe-1")  # expert 1 lacks down_proj
    assert engine.weight_version == "moe-0"


def test_reseed_restarts_the_sample_sequence():
    from armor_megatron.rollout.engine import SamplingParams
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, encode, tiny_config, tiny_weights

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    engine = LocalEngine(cfg, tiny_weights(cfg, seed=0), tokenizer=tok, seed=5)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = [encode(tok, "1+2=")]

    def draw():
        return [engine.generate(prompt, n=2, sampling=sampling)[0][0].token_ids for _ in range(2)]

    engine.reseed(11)
    first = draw()
    assert first[0] != first[1]  # consecutive requests get fresh seeds
    engine.reseed(11)
    assert draw() == first
