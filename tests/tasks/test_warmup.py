import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from armor_megatron.tasks.arithmetic import build_tokenizer, make_problems, solution
from armor_megatron.tasks.warmup import encode_examples, supervised_warmup


def test_labels_mask_prompt_and_padding():
    tok = build_tokenizer()
    ids, labels, mask = encode_examples(tok, ["1+2=", "10+20="], ["\\boxed{3}", "\\boxed{30}"])
    # "1+2=" is 4 prompt tokens; the response "\boxed{", "3", "}", EOS is 4 label tokens, then 2 pads
    assert labels[0].tolist()[:4] == [-100] * 4 and labels[0].tolist()[-2:] == [-100, -100]
    assert labels[0].tolist()[4:8] == ids[0].tolist()[4:8] and ids[0, 7].item() == tok.eos_token_id
    assert mask.sum(1).tolist() == [8, 11]


def _tiny_model():
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def test_warmup_lowers_the_loss():
    tok = build_tokenizer()
    model = _tiny_model()
    rows = make_problems(64, seed=0, max_operand=9)
    losses = supervised_warmup(
        model, tok, [r["prompt"] for r in rows], [solution(r) for r in rows], steps=40, batch_size=16
    )
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert not model.training


def test_zero_steps_leave_the_model_as_built():
    model = _tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = make_problems(8, seed=0, max_operand=9)
    assert (
        supervised_warmup(model, build_tokenizer(), [r["prompt"] for r in rows], [solution(r) for r in rows], steps=0)
        == []
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
