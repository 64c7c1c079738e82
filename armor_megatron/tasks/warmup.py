"""Supervised warm-up of a tiny HF causal LM on a synthetic task.

So that its reference policy solves part of the task before RL starts (the tiny CPU main job).

Loss: next-token cross-entropy on the response tokens only (prompt tokens are masked with
-100), responses end with EOS. Greedy accuracy is measured with the same verifier RL uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def encode_examples(tokenizer, prompts: Sequence[str], responses: Sequence[str]):
    """Right-padded ``input_ids`` [B, L], ``labels`` [B, L] (-100 on prompt and padding), ``attention_mask``."""
    rows, labels = [], []
    for prompt, response in zip(prompts, responses):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return input_ids, label_ids, mask


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """AdamW on random mini-batches for ``steps`` steps (0: the model is left as built); returns the loss of each step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(steps, 1)))
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(prompts), (batch_size,), generator=gen).tolist()
        input_ids, labels, mask = encode_examples(tokenizer, [prompts[i] for i in idx], [responses[i] for i in idx])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step + 1) % max(1, steps // 5) == 0:
            log(f"warm-up step {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return losses
