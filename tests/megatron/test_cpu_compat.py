import types

import pytest
import torch

from armor_megatron.megatron import cpu_compat
from tests.megatron.spawn import run_ranks


def test_missing_patch_target_is_a_clear_error():
    module = types.ModuleType("megatron.core.fake")
    with pytest.raises(
        RuntimeError, match=r"^cpu_compat: megatron.core.fake.gone not found; megatron-core internals changed$"
    ):
        cpu_compat._replace(module, "gone", lambda old: old)


def test_rng_tracker_fork_has_cuda_tracker_semantics():
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 5)
    with pytest.raises(RuntimeError, match="seed 5 already exists"):
        tracker.add("other", 5)
    torch.manual_seed(0)
    outer_expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(3)
    # the default stream is untouched by the fork ...
    assert torch.equal(torch.rand(3), outer_expected)
    # ... the forked stream starts at seed 5 and continues where it stopped
    stream = torch.Generator().manual_seed(5)
    assert torch.equal(first, torch.rand(3, generator=stream))
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(second, torch.rand(3, generator=stream))
    with pytest.raises(RuntimeError, match="rng state nope is not added"):
        with tracker.fork("nope"):
            pass


def patched_worker(rank):
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random

    assert cpu_compat.apply() and cpu_compat.apply()  # idempotent
    mask = fused_softmax.get_default_causal_mask(3)
    random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with random.get_cuda_rng_tracker().fork():
        forked = torch.rand(2)
    torch.cuda.synchronize()
    return torch.cuda.current_device(), mask, forked


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_apply_makes_cuda_assumptions_run_on_cpu():
    device, mask, forked = run_ranks(patched_worker, 1, timeout=100)[0]
    assert device == torch.device("cpu")
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    # model-parallel stream: seed + 2718 + tp_rank (megatron's rule)
    assert torch.equal(forked, torch.rand(2, generator=torch.Generator().manual_seed(123 + 2718)))


def test_optimizer_work_around_reports_cuda_type_names_once():
    t = torch.zeros(2)
    with cpu_compat._optimizer_cuda_assumptions_on_cpu():
        with cpu_compat._optimizer_cuda_assumptions_on_cpu():  # nested, as a wrapped __init__ calling super's
            # the torch-function mode re-enters Tensor.type: the name must still be rewritten only once
            assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert t.type(torch.float64).dtype == torch.float64  # a conversion is untouched
    assert t.type() == "torch.FloatTensor"
