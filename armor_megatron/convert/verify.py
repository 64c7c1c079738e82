"""Check a conversion, the converter's side: round trip bit-for-bit, transformers' logits.

* Round trip: the torch_dist checkpoint converted back to HF must hold every source tensor
  with identical bytes (``round_trip``, ``compare_tensors``).
* Logits: ``hf_logits`` of fixed ``prompts``; `armor_megatron.megatron.verify` compares them with
  the Megatron model's and writes the ``VerifyReport``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.rules import is_mtp_tensor
from armor_megatron.convert.to_hf import convert_mcore_to_hf
from armor_megatron.models import ModelArch

DEFAULT_ATOL = 1e-4


@dataclasses.dataclass
class VerifyReport:
    """The outcome of a round-trip check: tensors compared, mismatches, logit difference."""

    tensors_compared: int
    mismatched: list[str]
    max_logit_diff: float | None
    atol: float

    @property
    def ok(self) -> bool:
        """Whether every tensor matched and the logits (if compared) are within ``atol``."""
        return not self.mismatched and (self.max_logit_diff is None or self.max_logit_diff <= self.atol)

    def lines(self) -> list[str]:
        """The report as printable lines."""
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
    """Compare every tensor of two checkpoints bitwise.

    Bitwise comparison of every tensor of ``expected`` (tied lm_head copies and the tensors the
    converter leaves out -- rotary caches, DeepSeek-V3's multi-token-prediction layers -- excepted).
    """
    arch = expected.arch
    names = [
        n
        for n in expected.tensors
        if not (arch.tie_word_embeddings and n == "lm_head.weight")
        and not n.endswith("rotary_emb.inv_freq")
        and not is_mtp_tensor(arch, n)
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


def check_same_model(hf_dir: str, mcore_dir: str) -> None:
    """Refuse to compare checkpoints of different models.

    Family or shapes, in one line, when the torch_dist checkpoint carries its HF config (this
    converter's outputs do).
    """
    from armor_megatron.convert.output import HF_FILES_DIR

    config_dir = os.path.join(mcore_dir, HF_FILES_DIR)
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        return
    ours, theirs = HFCheckpoint(hf_dir).arch, ModelArch.from_hf_dir(config_dir)
    differ = [f.name for f in dataclasses.fields(ModelArch) if getattr(ours, f.name) != getattr(theirs, f.name)]
    if differ:
        name = differ[0]
        raise CheckpointError(
            f"{mcore_dir} holds another model than {hf_dir}: {name} is {getattr(theirs, name)!r} there, "
            f"{getattr(ours, name)!r} here"
        )


def round_trip(hf_dir: str, mcore_dir: str) -> tuple[int, list[str]]:
    """Convert ``mcore_dir`` back to HF and compare it with ``hf_dir``: (tensors compared, mismatched names)."""
    check_same_model(hf_dir, mcore_dir)
    with tempfile.TemporaryDirectory(prefix="armor_verify_", dir=os.path.dirname(os.path.abspath(mcore_dir))) as tmp:
        out = os.path.join(tmp, "hf")
        convert_mcore_to_hf(mcore_dir, out, progress_stream=None)
        return compare_tensors(HFCheckpoint(hf_dir), HFCheckpoint(out))


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Transformers' logits [b, s, V] in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()
