"""In-process rollout engine on a transformers model: for CPU runs, tests and the SGLang test double.

Sampling, per step, from the last position's logits z (fp32, shape [B, V]):

* ``temperature == 0``: greedy, ``argmax z``;
* else ``z / temperature``, then top-k (keep the k largest), then top-p (keep the smallest
  set of most likely tokens whose probability reaches ``top_p``), then a draw from the
  renormalised softmax with a seeded ``torch.Generator``.

Log-probs: ``logprobs[t] = log_softmax(z_t / temperature)[token_t]`` of the **unfiltered** logits
at the sampling temperature (temperature 1 when sampling greedily), before top-k / top-p: the
quantity the trainer recomputes by teacher forcing at ``rollout.temperature`` (equal to it up to
float rounding), and what SGLang reports for a sampled token unless its server runs with
``SGLANG_RETURN_ORIGINAL_LOGPROB`` set. ``original_logprobs = True`` (the SGLang test double sets
it under that variable) reports ``log_softmax(z_t)`` instead, as such a server does.

Prompts are left-padded into batches of at most ``max_batch_size`` rows and decoded with
the model's KV cache; position ids count real tokens only, so padding does not shift them.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from armor_megatron.models.arch import load_hf_config
from armor_megatron.models.tokenizer import load_tokenizer
from armor_megatron.rollout import hf_checkpoint
from armor_megatron.rollout.engine import (
    RolloutEngine,
    Sample,
    SamplingParams,
    WeightSource,
    WeightUpdateError,
    check_prompts,
    check_versions,
)

if TYPE_CHECKING:
    import torch


def sample_next_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token per row of ``logits`` [B, V] (fp32) as described in the module docstring."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    z = logits / sampling.temperature
    if 0 < sampling.top_k < z.shape[-1]:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p.
        drop = (probs.cumsum(dim=-1) - probs) >= sampling.top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    probs = torch.softmax(z, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class LocalEngine(RolloutEngine):
    """A transformers causal LM in this process.

    ``hf_config``: the HF ``config.json`` as a dict; ``weights``: HF-named tensors or an HF
    checkpoint directory; ``tokenizer``: optional (``text`` is empty without it). ``seed``
    seeds the generator of every call that has no ``SamplingParams.seed``: call i uses
    ``seed + i``, so a run is reproducible call by call (on one device: a GPU draws other
    numbers than the CPU from the same seed). ``device``: where the model runs and samples.
    """

    original_logprobs = False  # True: temperature-1 log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB), see the module doc

    def __init__(
        self,
        hf_config: Mapping[str, Any],
        weights: WeightSource,
        tokenizer: Any = None,
        weight_version: str = "0",
        seed: int = 0,
        max_batch_size: int = 64,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        import torch

        self.hf_config = dict(hf_config)
        self.device = torch.device(device)
        self.model = hf_checkpoint.build_causal_lm(self.hf_config, dtype=dtype or torch.float32).to(self.device)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._seed = seed
        self._calls = itertools.count()
        self._lock = threading.RLock()
        self.eos_token_ids = _eos_ids(self.hf_config, tokenizer)
        self.pad_token_id = _pad_id(self.hf_config, tokenizer)
        self.update_weights(weights, weight_version)

    @classmethod
    def from_pretrained(cls, path: str, weight_version: str = "0", **kwargs: Any) -> LocalEngine:
        """Load ``config.json``, the safetensors and (if present) the tokenizer from ``path``."""
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = load_tokenizer(path)
        return cls(load_hf_config(path), path, tokenizer=tokenizer, weight_version=weight_version, **kwargs)

    # ---- weights -----------------------------------------------------------------------

    def load_weights(self, weights: WeightSource, strict: bool = True) -> int:
        """Copy weights in without touching ``weight_version`` (``strict=False`` for one bucket of many).

        Checkpoint names the in-memory model lacks (transformers 5 fuses MoE experts) go
        through transformers' own loader, which needs the full set (``strict``).
        """
        if isinstance(weights, (str, os.PathLike)):
            weights = os.fspath(weights)
            names = [n for n, _ in hf_checkpoint.read_hf_checkpoint(weights, keys_only=True)]
        else:
            weights = list(weights)
            names = [n for n, _ in weights]
        with self._lock:
            try:
                if strict and not set(names) <= set(self.model.state_dict()):
                    return hf_checkpoint.load_through_transformers(self.model, weights, self.hf_config)
                if isinstance(weights, str):
                    weights = hf_checkpoint.read_hf_checkpoint(weights)
                return hf_checkpoint.load_named_tensors(self.model, weights, strict=strict)
            except (KeyError, ValueError, FileNotFoundError) as e:
                raise WeightUpdateError(str(e.args[0] if isinstance(e, KeyError) and e.args else e)) from e

    def reseed(self, seed: int) -> None:
        """Make the following samples reproducible from ``seed``."""
        with self._lock:
            self._seed = int(seed)
            self._calls = itertools.count()

    def update_weights(self, weights: WeightSource, version: str, timeout: float | None = None) -> None:
        """Load new weights (every one required) and take ``version``."""
        with self._lock:
            self.load_weights(weights, strict=True)
            self.weight_version = str(version)

    # ---- generation --------------------------------------------------------------------

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
        return_logprob: bool = True,
    ) -> list[list[Sample]]:
        """``n`` samples per prompt from the local transformers model."""
        import torch

        check_prompts(prompts_token_ids, n)
        if self.model is None:
            raise RuntimeError("LocalEngine.generate after shutdown()")
        deadline = None if timeout is None else time.monotonic() + timeout
        rows = [(i, list(map(int, p))) for i, p in enumerate(prompts_token_ids) for _ in range(n)]
        seed = sampling.seed if sampling.seed is not None else self._seed + next(self._calls)
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        groups: list[list[tuple[list[int], str, list[float], str]]] = [[] for _ in prompts_token_ids]
        with self._lock:
            version = self.weight_version
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                for (idx, _), sample in zip(chunk, self._generate_batch(chunk, sampling, generator, deadline)):
                    groups[idx].append(sample)
        out = [
            [
                Sample(i, tuple(t), text, tuple(lp) if return_logprob else None, reason, version)
                for (t, text, lp, reason) in group
            ]
            for i, group in enumerate(groups)
        ]
        check_versions(out, self.weight_version)
        return out

    def _generate_batch(
        self,
        rows: Sequence[tuple[Any, Sequence[int]]],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        deadline: float | None,
    ) -> list[tuple[Any, ...]]:
        """Decode one left-padded batch; returns ``(token_ids, text, logprobs, finish_reason)`` per row."""
        import torch

        prompts = [p for _, p in rows]
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = set() if sampling.ignore_eos else set(sampling.stop_token_ids) | set(self.eos_token_ids)

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        reasons: list[str | None] = [None] * batch
        stop_at: list[int | None] = [None] * batch  # character offset of a matched stop string
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
            for _ in range(sampling.max_new_tokens):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"local generation passed its timeout with {batch} sequences in flight")
                logits = out.logits[:, -1, :].float()
                nxt = sample_next_tokens(logits, sampling, generator)
                at_t = sampling.temperature > 0 and not self.original_logprobs
                scaled = logits / sampling.temperature if at_t else logits
                lps = torch.log_softmax(scaled, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)
                step_tokens, step_logprobs = nxt.tolist(), lps.tolist()  # one device-to-host copy
                for r in range(batch):
                    if reasons[r] is not None:
                        continue
                    tok = step_tokens[r]
                    tokens[r].append(tok)
                    logprobs[r].append(step_logprobs[r])
                    if tok in stop_ids:
                        reasons[r] = "stop"
                    elif sampling.stop:
                        stop_at[r] = _find_stop(self._decode(tokens[r]), sampling.stop)
                        if stop_at[r] is not None:
                            reasons[r] = "stop"
                if all(r is not None for r in reasons):
                    break
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long, device=self.device)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(
                    input_ids=nxt[:, None],
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    **_cache_kwargs(out),
                )
        results = []
        for r in range(batch):
            reason = reasons[r] or "length"
            ended_on_stop_token = reason == "stop" and stop_at[r] is None
            text = self._decode(tokens[r][:-1] if ended_on_stop_token else tokens[r])
            if stop_at[r] is not None:
                text = text[: stop_at[r]]
            results.append((tokens[r], text, logprobs[r], reason))
        return results

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # ---- lifecycle ---------------------------------------------------------------------

    def health(self, timeout: float | None = None) -> bool:
        """Whether the model is loaded."""
        return self.model is not None

    def shutdown(self, timeout: float | None = None) -> None:
        """Drop the model."""
        self.model = None


def _cache_kwargs(out: Any) -> dict[str, Any]:
    """The KV cache of ``out`` as the next forward's keyword (``cache`` in transformers 5.2x, else ``past_key_values``)."""
    if "cache" in out:
        return {"cache": out["cache"]}
    return {"past_key_values": out["past_key_values"]}


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _eos_ids(hf_config: Mapping[str, Any], tokenizer: Any) -> tuple[int, ...]:
    eos = hf_config.get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _pad_id(hf_config: Mapping[str, Any], tokenizer: Any) -> int:
    for pad in (hf_config.get("pad_token_id"), getattr(tokenizer, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return 0
