"""Activation recomputation (``train.recompute``): the same loss, gradients and update as without it,
at TP=2×PP=2, PP=2×VPP=2 and EP=2 (one 4-rank gloo job), and measurably fewer kept activations.

Kept activations are measured with `SavedActivations`: autograd's saved-tensor hooks count every
distinct storage a forward keeps for backward (parameters excluded) from the moment it is saved
until its graph node lets it go; the peak over forward and backward is the activation memory,
including the layers a full recompute runs again during backward.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig
from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.model import Recompute, transformer_config_from_arch
from armor_megatron.models.arch import ModelArch
from tests.megatron.spawn import run_ranks
from tests.megatron.test_parallel_logprobs import QWEN3, QWEN3_MOE

MODES = {
    "none": Recompute(),
    "selective": Recompute("selective"),
    "full_uniform": Recompute("full", "uniform", 1),
    "full_block": Recompute("full", "block", 1),
}
LAYOUTS = {
    "tp2pp2": (QWEN3, ParallelConfig(tp=2, pp=2)),
    "pp2vpp2": (QWEN3, ParallelConfig(pp=2, vpp=2)),
    "ep2": (QWEN3_MOE, ParallelConfig(ep=2)),
}


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Bytes of the distinct storages autograd keeps for backward: ``current`` and ``peak``."""

    def __init__(self, parameters):
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.live: dict[int, list[int]] = {}
        self.current = self.peak = 0

    def pack(self, tensor):
        held = _Held(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.excluded or storage.nbytes() == 0:
            return held
        if ptr not in self.live:
            self.live[ptr] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.live[ptr][1] += 1
        weakref.finalize(held, self._release, ptr)
        return held

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    @staticmethod
    def unpack(held):
        return held.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def track(self, *modules):
        """Count only what `modules` save (their forwards, and re-runs of them during backward)."""
        handles = []
        for module in modules:
            stack = []

            def enter(_module, _args, stack=stack):
                context = self.hooks()
                context.__enter__()
                stack.append(context)

            def leave(_module, _args, _output, stack=stack):
                stack.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        return handles


def measure_decoder(arch: ModelArch, recompute: Recompute, *, dtype="float32", seq_len=128, batch=2) -> dict:
    """Peak bytes the decoder (its layers and final norm) keeps for backward in one training
    forward + backward of a TP=1 model (call inside an initialised world of one rank)."""
    from megatron.core import tensor_parallel

    from armor_megatron.megatron.model import build_gpt_model

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = build_gpt_model(arch, ParallelConfig(), dtype=dtype, use_te=False, recompute=recompute)
    model.train()
    tracker = SavedActivations(model.parameters())
    handles = tracker.track(model.decoder, *model.decoder.layers)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_len)[None].expand(batch, seq_len)
    logits = model(tokens, positions, None)
    after_forward = tracker.current
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    for h in handles:
        h.remove()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return dict(peak=tracker.peak, after_forward=after_forward, loss=loss.item(), grads=grads)


def test_recompute_maps_onto_megatron_config_fields():
    config = transformer_config_from_arch(QWEN3, recompute=Recompute("full", "block", 2))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    config = transformer_config_from_arch(QWEN3, recompute=Recompute("selective"))
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["core_attn"])
    assert transformer_config_from_arch(QWEN3).recompute_granularity is None
    with pytest.raises(ValueError, match="recompute_num_layers=3 does not divide the 4 layers of a pipeline chunk"):
        transformer_config_from_arch(QWEN3, recompute=Recompute("full", "uniform", 3))


def memory_worker(rank):
    mdist.initialize(ParallelConfig(), QWEN3, seed=1)
    try:
        return {name: measure_decoder(QWEN3, mode) for name, mode in MODES.items()}
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_recompute_keeps_fewer_activations_and_the_same_gradients():
    out = run_ranks(memory_worker, 1, timeout=180)[0]
    base = out["none"]
    for name, m in out.items():
        assert m["loss"] == base["loss"], name
        assert all(torch.equal(a, b) for a, b in zip(m["grads"], base["grads"])), name
    peak = {name: m["peak"] for name, m in out.items()}
    # selective drops the [b, heads, s, s] scores; full keeps each layer's input and, at its
    # peak, one layer being recomputed; block recomputes only the first layer of the chunk
    assert peak["full_uniform"] < peak["selective"] < peak["none"], peak
    assert peak["full_uniform"] < peak["full_block"] < peak["none"], peak
    assert peak["full_uniform"] < 0.5 * peak["none"], peak


def _actor(arch, parallel, recompute):
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.trained_model import ModelSettings

    return MegatronActor(
        ModelSettings(arch, parallel, dtype="float32", micro_batch_size=2, recompute=recompute),
        optimizer=OptimizerConfig(lr=5e-3, weight_decay=0.01, clip_grad=1.0),
        loss=PolicyLossConfig(alpha=0.9),
        total_steps=10,
        seed=5,
    )


def layouts_worker(rank):
    """Per layout and recompute mode: one train step from the same weights on the same batch;
    the loss, grad norm, the reduced gradients and the updated parameters of this rank."""
    from tests.megatron.test_actor import make_batch

    out = {}
    mdist.initialize(ParallelConfig(), QWEN3, seed=5)
    try:
        for layout, (arch, parallel) in LAYOUTS.items():
            mdist.set_model_parallel(parallel, arch, seed=5)
            for name, mode in MODES.items():
                actor = _actor(arch, parallel, mode)
                batch = make_batch()
                lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs
                metrics = actor.train_step({**batch, "old_logprobs": lp - 0.05, "ref_logprobs": lp})
                out[layout, name] = dict(
                    loss=metrics["loss"],
                    grad_norm=metrics["grad_norm"],
                    grads=[p.main_grad.clone() for c in actor.ddp_chunks for p in c.module.parameters()],
                    params=[p.detach().clone() for c in actor.model_chunks for p in c.parameters()],
                    granularity=actor.model_chunks[0].config.recompute_granularity,
                )
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_loss_gradients_and_update_are_identical_with_recompute_at_tp2pp2_vpp_and_ep2():
    for out in run_ranks(layouts_worker, 4, timeout=400):
        for (layout, name), m in out.items():
            base = out[layout, "none"]
            assert m["granularity"] == {"none": None, "selective": "selective"}.get(name, "full")
            assert (m["loss"], m["grad_norm"]) == (base["loss"], base["grad_norm"]), (layout, name)
            assert all(torch.equal(a, b) for a, b in zip(m["grads"], base["grads"])), (layout, name)
            assert all(torch.equal(a, b) for a, b in zip(m["params"], base["params"])), (layout, name)
