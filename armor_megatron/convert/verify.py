"""Check a conversion: round trip bit-for-bit, and Megatron logits against transformers'.

* Round trip: the torch_dist checkpoint converted back to HF must hold every source tensor
  with identical bytes.
* Logits: the checkpoint loaded into the project's Megatron ``GPTModel`` (local spec, fp32,
  any TP/PP/EP of the running process group) and the HF model loaded by transformers (fp32)
  must give the same logits on a few prompts, within ``atol``.

Logits run the whole model on this machine: meant for tiny and mid-sized models on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator

import torch

from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.to_hf import convert_mcore_to_hf
from armor_megatron.models import ModelArch

DEFAULT_ATOL = 1e-4


@dataclasses.dataclass
class VerifyReport:
    tensors_compared: int
    mismatched: list[str]
    max_logit_diff: float | None
    atol: float

    @property
    def ok(self) -> bool:
        return not self.mismatched and (self.max_logit_diff is None or self.max_logit_diff <= self.atol)

    def lines(self) -> list[str]:
        out = [
            f"round trip: {self.tensors_compared - len(self.mismatched)}/{self.tensors_compared} tensors "
            f"bit-identical" + (f"; first mismatch {self.mismatched[0]}" if self.mismatched else "")
        ]
        if self.max_logit_diff is not None:
            out.append(f"logits: max |megatron - transformers| = {self.max_logit_diff:.3g} (atol {self.atol:g})")
        out.append("verify: OK" if self.ok else "verify: FAILED")
        return out


def prompts(arch: ModelArch, batch: int = 3, length: int = 16, seed: int = 0) -> torch.Tensor:
    """Fixed pseudo-random token ids [batch, length] (tokenizer-independent prompts)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, arch.vocab_size, (batch, length), generator=gen)


def compare_tensors(expected: HFCheckpoint, actual: HFCheckpoint) -> tuple[int, list[str]]:
    """Bitwise comparison of every tensor of ``expected`` (tied lm_head copies excepted)."""
    names = [
        n
        for n in expected.tensors
        if not (expected.arch.tie_word_embeddings and n == "lm_head.weight") and not n.endswith("rotary_emb.inv_freq")
    ]
    mismatched = []
    for name in names:
        if name not in actual.tensors:
            mismatched.append(f"{name} (missing)")
            continue
        a, b = expected.read(name), actual.read(name)
        if (
            a.dtype != b.dtype
            or a.shape != b.shape
            or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        ):
            mismatched.append(name)
    return len(names), mismatched


def round_trip(hf_dir: str, mcore_dir: str) -> tuple[int, list[str]]:
    with tempfile.TemporaryDirectory(prefix="armor_verify_", dir=os.path.dirname(os.path.abspath(mcore_dir))) as tmp:
        out = os.path.join(tmp, "hf")
        convert_mcore_to_hf(mcore_dir, out, progress_stream=None)
        return compare_tensors(HFCheckpoint(hf_dir), HFCheckpoint(out))


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits [b, s, V] in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def load_megatron_model(arch: ModelArch, mcore_dir: str, parallel=None):
    """This rank's fp32 local-spec GPTModel stage with the checkpoint loaded (after ``dist.initialize``)."""
    from megatron.core import dist_checkpointing

    from armor_megatron.megatron.dist import ParallelConfig
    from armor_megatron.megatron.model import build_gpt_model

    model = build_gpt_model(arch, parallel or ParallelConfig(), dtype=torch.float32, use_te=False)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), mcore_dir))
    return model


def megatron_logits(model, arch: ModelArch, tokens: torch.Tensor) -> torch.Tensor | None:
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
        return gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size].float()


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
        diff = (actual - expected).abs().max().item()
    return VerifyReport(compared, mismatched, diff, atol)
