import math

import pytest
import torch

from armor_megatron.megatron.logprobs import vocab_parallel_logprobs


def naive(logits, labels, vocab_size, temperature=1.0):
    z = logits[..., :vocab_size].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def test_hand_computed_two_token_vocab():
    # logits (0, log 3): p = (1/4, 3/4); log p(1) = log 0.75; H = -(.25 log .25 + .75 log .75)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    lp, ent = vocab_parallel_logprobs(logits, torch.tensor([1]), with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1, 40, 10**6])  # one row, 3 rows, everything per chunk
def test_chunked_values_and_gradients_match_naive(temperature, chunk_elements):
    torch.manual_seed(0)
    vocab, columns = 11, 13  # two padding columns that must not count
    logits = (3 * torch.randn(2, 5, columns, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab, (2, 5))
    w_lp, w_ent = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)

    lp, ent = vocab_parallel_logprobs(
        logits.float(),
        labels,
        vocab_size=vocab,
        temperature=temperature,
        with_entropy=True,
        chunk_elements=chunk_elements,
    )
    ref_lp, ref_ent = naive(logits, labels, vocab, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)

    (grad,) = torch.autograd.grad((lp.double() * w_lp + ent.double() * w_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)
    assert grad[..., vocab:].abs().max() == 0


def test_logprob_only_gradient_and_input_untouched():
    torch.manual_seed(1)
    logits = torch.randn(7, 9, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, 9, (7,))
    lp, ent = vocab_parallel_logprobs(logits, labels, chunk_elements=18)
    assert ent is None
    lp.sum().backward()
    ref = logits.detach().clone().requires_grad_()
    torch.log_softmax(ref, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-6, rtol=0)
    assert torch.equal(logits.detach(), before)


def test_bf16_logits_give_fp32_results():
    torch.manual_seed(2)
    logits = torch.randn(4, 16).bfloat16()
    lp, _ = vocab_parallel_logprobs(logits, torch.arange(4))
    assert lp.dtype == torch.float32
    ref, _ = naive(logits.float(), torch.arange(4), 16)
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(labels=torch.tensor([0, 12])), r"labels must lie in \[0, 12\)"),
        (dict(labels=torch.tensor([0, 1]), vocab_size=13), "vocab_size=13 does not fit 1 shards of 12 columns"),
        (dict(labels=torch.tensor([0])), "disagree on the token dims"),
        (dict(labels=torch.tensor([0, 1]), temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vocab_parallel_logprobs(torch.zeros(2, 12), **kwargs)


def tp_split_worker(rank, logits, labels, weights, vocab):
    """Rank r holds columns [r·V/2, (r+1)·V/2) of the logits; returns values and its grad shard."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        width = logits.shape[-1] // 2
        shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(
            shard,
            labels,
            vocab_size=vocab,
            temperature=0.9,
            with_entropy=True,
            chunk_elements=2 * width,
            group=dist.group.WORLD,
        )
        (lp * weights[0] + ent * weights[1]).sum().backward()
        return lp.detach(), ent.detach(), shard.grad
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_parallel_split_matches_naive():
    from tests.megatron.spawn import run_ranks

    torch.manual_seed(3)
    vocab = 13  # 16 columns over 2 ranks: rank 1 holds 5 real columns and 3 of padding
    logits = 2 * torch.randn(3, 4, 16, dtype=torch.float64)
    labels = torch.randint(0, vocab, (3, 4))
    labels[0, :2] = torch.tensor([0, 12])  # first and last real token
    weights = torch.randn(2, 3, 4)
    results = run_ranks(tp_split_worker, 2, logits.float(), labels, weights, vocab, timeout=100)

    ref = logits.clone().requires_grad_()
    ref_lp, ref_ent = naive(ref, labels, vocab, temperature=0.9)
    (ref_lp * weights[0] + ref_ent * weights[1]).sum().backward()
    for lp, ent, _ in results:
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    grad = torch.cat([g for _, _, g in results], dim=-1)
    torch.testing.assert_close(grad.double(), ref.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_masked_logits_give_finite_entropy_and_gradients(entropy_weight):
    """Logits of -inf (a masked vocabulary entry) contribute 0·(-inf) := 0 to the entropy; an
    entropy that only feeds metrics (weight 0: unused in the loss) gets no backward pass at all."""
    torch.manual_seed(1)
    logits = torch.randn(3, 6, dtype=torch.float64)
    logits[:, 5] = -math.inf
    labels = torch.tensor([0, 1, 2])
    ours = logits.clone().float().requires_grad_()
    lp, ent = vocab_parallel_logprobs(ours, labels, with_entropy=True, temperature=0.8)
    loss = lp.sum() + (entropy_weight * ent.sum() if entropy_weight else 0.0)
    loss.backward()

    ref = logits[:, :5].clone().requires_grad_()  # the distribution without its impossible entry
    logp = torch.log_softmax(ref / 0.8, dim=-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (logp.gather(-1, labels[:, None]).sum() + entropy_weight * ref_ent.sum()).backward()
    assert torch.isfinite(ent).all() and torch.allclose(ent.double(), ref_ent.detach(), atol=1e-5)
    assert torch.isfinite(ours.grad).all() and (ours.grad[:, 5] == 0).all()
    assert torch.allclose(ours.grad[:, :5].double(), ref.grad, atol=1e-5)
