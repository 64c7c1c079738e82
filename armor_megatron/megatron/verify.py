"""Check a conversion end to end: the converter's round trip, and Megatron logits against transformers'.

The torch_dist checkpoint is loaded into the project's Megatron ``GPTModel`` (local spec, fp32,
any TP/PP/EP of the running process group) and must give the logits transformers gives for the
HF checkpoint (fp32) on a few prompts, within ``atol``. Logits run the whole model on this
machine: meant for tiny and mid-sized models on CPU.

Public interface::

    with single_process_megatron():                # world size 1, when not run under torchrun
        report = verify(hf_dir, mcore_dir, logits=True, atol=1e-4)   # -> convert.verify.VerifyReport
    model = load_megatron_model(arch, mcore_dir)      # this rank's stage, fp32, local spec
    logits = megatron_logits(model, arch, tokens)     # [b, s, V] on the last stage, else None
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.verify import DEFAULT_ATOL, VerifyReport, hf_logits, prompts, round_trip
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.models import ModelArch


def load_megatron_model(arch: ModelArch, mcore_dir: str, parallel: ParallelConfig | None = None) -> Any:
    """Load a checkpoint's weights into this rank's fp32 local-spec GPTModel stage.

    This rank's fp32 local-spec GPTModel stage with the checkpoint's model weights loaded (after
    ``dist.initialize``): a converter output or a training checkpoint (whose other state is left).
    """
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.model_state import load_model_weights

    model = build_gpt_model(arch, parallel or ParallelConfig(), dtype=torch.float32, use_te=False)
    load_model_weights([model], mcore_dir)
    return model


def megatron_logits(model: Any, arch: ModelArch, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] on the last pipeline stage (None on other stages).

    Stages pass hidden states [s, b, h] point to point; TP ranks gather the vocab-parallel logits.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, arch.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        logits: torch.Tensor = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size].float()
        return logits


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """Megatron at world size 1 (gloo, file rendezvous: no port to collide on), torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from armor_megatron.megatron import dist as mdist

    with tempfile.TemporaryDirectory(prefix="armor_verify_pg_") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            mdist.initialize(mdist.ParallelConfig())
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def verify(hf_dir: str, mcore_dir: str, *, logits: bool = True, atol: float = DEFAULT_ATOL) -> VerifyReport:
    """Round trip + (optionally) logits parity at TP=PP=EP=1.

    With ``logits`` Megatron must be initialised at world size 1 (:func:`single_process_megatron`).
    """
    hf = HFCheckpoint(hf_dir)
    compared, mismatched = round_trip(hf_dir, mcore_dir)
    diff = None
    if logits:
        tokens = prompts(hf.arch)
        expected = hf_logits(hf_dir, tokens)
        actual = megatron_logits(load_megatron_model(hf.arch, mcore_dir), hf.arch, tokens)
        if actual is not None:  # the last pipeline stage
            diff = (actual - expected).abs().max().item()
    return VerifyReport(compared, mismatched, diff, atol)
