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


# ----------------------------------------------------------------------------- no host reads of device data
# On a GPU, a host read of device data (.item(), int(), bool(), .tolist(), .cpu(), nonzero(), boolean-mask
# indexing, repeat_interleave without output_size) waits until the device has run everything queued before
# it. Meta tensors have shapes and no data, and torch refuses each of those reads on them; the per-micro-batch
# code run on meta tensors therefore fails on any such read, as torch.cuda.set_sync_debug_mode("error")
# would on a GPU. Host tensors (the micro-batch's tokens, lengths, segment bounds) may be read freely.
META = torch.device("meta")


def test_meta_tensors_refuse_every_host_read_of_device_data():
    t = torch.ones(4, dtype=torch.long, device=META)
    reads = {
        "item": lambda: t.max().item(),
        "int": lambda: int(t.min()),
        "bool": lambda: bool(t.any()),
        "tolist": t.tolist,
        "cpu": t.cpu,
        "nonzero": t.nonzero,
        "mask index": lambda: t[t > 0],
        "repeat_interleave": lambda: t.repeat_interleave(t),
    }
    for name, read in reads.items():
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()
            pytest.fail(name)


@pytest.mark.parametrize("with_entropy, temperature", [(True, 0.7), (False, 1.0)])
@pytest.mark.parametrize("chunk_elements", [1, 40, 10**6])
def test_log_probs_and_their_gradient_never_read_device_data(with_entropy, temperature, chunk_elements):
    logits = torch.empty(3, 5, 13, device=META, requires_grad=True)
    labels = torch.empty(3, 5, dtype=torch.long, device=META)
    lp, ent = vocab_parallel_logprobs(
        logits, labels, vocab_size=11, temperature=temperature, with_entropy=with_entropy, chunk_elements=chunk_elements
    )
    (lp.sum() + (ent.sum() if with_entropy else 0.0)).backward()
    assert lp.shape == (3, 5) and logits.grad.shape == logits.shape and logits.grad.device == META


def test_device_labels_out_of_range_give_nan_without_a_host_read():
    """Host labels are checked with a one-line error (`test_bad_input`); checking device labels
    would need a host read, so an out-of-range one gets a NaN log-prob instead (the step's loss
    turns NaN and the stability guard skips the step)."""
    from armor_megatron.megatron.logprobs import out_of_range_to_nan

    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    marked = out_of_range_to_nan(lp, torch.tensor([0, 4, -1, 3]), vocab_size=4)
    assert marked[0] == -1.0 and marked[3] == -4.0 and marked[1:3].isnan().all()
    on_device = vocab_parallel_logprobs(
        torch.zeros(4, 4, device=META), torch.tensor([0, 4, -1, 3]).to(META), vocab_size=4
    )[0]
    assert on_device.device == META  # the check ran on the device, without reading the labels


def _micro_batches():
    from armor_megatron.megatron.microbatch import packed_microbatch, split_microbatches

    ids, lengths = torch.randint(0, 11, (3, 6)), torch.tensor([6, 2, 4])
    padded = split_microbatches(ids, lengths, 3)[0]
    packed = packed_microbatch(ids, lengths, torch.tensor([1, 0, 2]), multiple_of=8)  # 12 tokens + a pad segment
    return {"padded": padded, "packed": packed}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_micro_batchs_forward_and_loss_never_read_device_data(layout, monkeypatch):
    """What runs per micro-batch on the device: the model's inputs (`model_forward`), log-probs and
    entropy of its logits (`token_logprobs`), the loss rows moved over and the ARMOR loss with its
    backward (as `MegatronActor.train_step`'s ``loss_of``)."""
    from megatron.core import parallel_state

    from armor_megatron.algo.loss import PolicyLossConfig, get_policy_loss
    from armor_megatron.megatron.logprobs import model_forward, token_logprobs
    from armor_megatron.megatron.microbatch import to_device

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: None)
    mb = _micro_batches()[layout]

    class Model(torch.nn.Module):  # a last stage on the device: logits [b, s, V] from its inputs
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(1, 13, device=META))

        def forward(self, tokens, positions, mask, packed_seq_params=None):
            assert tokens.device == positions.device == META and positions.shape == tokens.shape
            if packed_seq_params is not None:
                assert packed_seq_params.cu_seqlens_q.device == META
                assert packed_seq_params.max_seqlen_q == 6  # read from the host copy of the bounds
            return (tokens + positions)[..., None].float() * self.weight

    logits = model_forward(Model(), mb)
    lp, ent = token_logprobs(logits, mb, vocab_size=11, temperature=0.7, with_entropy=True)
    width = mb.width
    rows = {
        "old_logprobs": torch.zeros(len(mb.index), width),
        "ref_logprobs": torch.zeros(len(mb.index), width),
        "advantages": torch.ones(len(mb.index)),
        "response_mask": torch.ones(len(mb.index), width, dtype=torch.bool),
    }
    rows = {k: to_device(v, lp.device) for k, v in rows.items()}
    loss, metrics = get_policy_loss("armor")(
        lp,
        rows["old_logprobs"],
        rows["ref_logprobs"],
        rows["advantages"],
        rows["response_mask"],
        PolicyLossConfig(alpha=0.9),
        normalizer=to_device(torch.tensor(7.0), lp.device),
        entropy=ent,
    )
    loss.backward()
    assert lp.shape == (len(mb.index), width) and loss.device == META
