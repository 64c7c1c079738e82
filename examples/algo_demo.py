"""ARMOR vs DAPO on a tiny verifiable task, in pure torch on CPU (well under a minute).

The task: prompts "a+b" (a, b in 0..9); a response is the decimal digits of the sum followed
by EOS, at most MAX_LEN tokens; the verifier gives reward 1 for exactly the right answer.
The policy is a small autoregressive MLP. A short supervised warm-up on all 100 sums makes
the "base model" (about a quarter right). RL trains on 70 of the sums; both runs start from
the base model with the same seed:

  dapo   G on-policy samples per prompt, group-normalised advantages, clip-higher surrogate
         with token-mean, dynamic sampling, soft overlong punishment.
  armor  the same, plus one anchor per group drawn from the reference policy by rejection
         sampling (4 tries, reward 1 only), the mixed ratio with α, and θ_ref ← θ every τ steps.

Every algorithmic piece comes from ``armor_megatron.algo`` and ``armor_megatron.data``; this
file only holds the toy model, the sampler and the loop that glues them.

    python examples/algo_demo.py [--steps 80] [--alpha 0.9375] [--tau 20] [--seed 0]

Columns: train@8 / val@8 are avg@8 accuracies on the 70 training sums and the 30 held-out
ones (the base model saw all 100 in its warm-up, so val@8 shows what RL on the training
sums does to skills it does not train); clip_lo / clip_hi, entropy and kl_ref (k3 estimate
of KL(π_θ‖π_ref); for dapo π_ref is the base model, used for this metric only) are from the
step's last update; anchor is the anchor found rate; anc_A=0 the share of anchors with zero
advantage (QAE's zero mask: try --estimator qae); kept the dynamic-sampling keep rate.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from armor_megatron.algo import (
    DynamicSampler,
    PolicyLossConfig,
    anchor_zero_advantage_rate,
    apply_overlong_shaping,
    assemble_anchor_groups,
    build_reset_schedule,
    compute_advantages,
    loss_normalizer,
    policy_loss,
    reduce_loss_metrics,
)
from armor_megatron.data import RolloutBatch

EOS, BOS, VOCAB = 10, 11, 11  # tokens 0-9 are digits; BOS only ever appears as input
MAX_LEN, OVERLONG_BUFFER = 6, 3  # responses longer than 3 tokens are softly penalised


# ----- the toy policy -------------------------------------------------------------------------
class TinyPolicy(torch.nn.Module):
    """p(y_t | a, b, t, y_{t-1}): an MLP over one-hot features, evaluated at all positions at once."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(10 + 10 + MAX_LEN + 12, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, VOCAB)
        )

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """prompts [N, 2], tokens [N, T] (T ≤ MAX_LEN) -> logits [N, T, VOCAB] for each position."""
        n, t = tokens.shape
        prev = torch.cat([torch.full((n, 1), BOS), tokens[:, :-1]], dim=1)
        feats = torch.cat(
            [
                F.one_hot(prompts[:, 0], 10)[:, None].expand(n, t, 10),
                F.one_hot(prompts[:, 1], 10)[:, None].expand(n, t, 10),
                F.one_hot(torch.arange(t), MAX_LEN)[None].expand(n, t, MAX_LEN),
                F.one_hot(prev, 12),
            ],
            dim=-1,
        ).float()
        return self.net(feats)

    def logprobs(self, prompts, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(y_t) and entropy, both [N, T]."""
        logp_all = torch.log_softmax(self(prompts, tokens), dim=-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, tokens[..., None]).squeeze(-1), entropy

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Autoregressive sampling -> tokens [N, MAX_LEN] (EOS-padded), mask [N, MAX_LEN]."""
        n = prompts.shape[0]
        tokens = torch.full((n, MAX_LEN), EOS)
        alive = torch.ones(n, dtype=torch.bool)
        mask = torch.zeros(n, MAX_LEN, dtype=torch.bool)
        for t in range(MAX_LEN):
            probs = torch.softmax(self(prompts, tokens[:, : t + 1])[:, t], dim=-1)
            tokens[:, t] = torch.where(alive, torch.multinomial(probs, 1, generator=gen).squeeze(-1), EOS)
            mask[:, t] = alive
            alive &= tokens[:, t] != EOS
        return tokens, mask


def verify(prompts: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward 1 when the response is exactly the digits of a+b followed by EOS, else 0."""
    out = []
    for (a, b), toks, m in zip(prompts.tolist(), tokens.tolist(), mask.tolist()):
        resp = [tok for tok, valid in zip(toks, m) if valid]
        out.append(float(resp == [int(c) for c in str(a + b)] + [EOS]))
    return torch.tensor(out)


def rollout(policy: TinyPolicy, prompts: torch.Tensor, n: int, gen: torch.Generator, source: str) -> RolloutBatch:
    """n samples per prompt, prompt-major, as a RolloutBatch with rewards and lengths."""
    rep = prompts.repeat_interleave(n, dim=0)
    tokens, mask = policy.sample(rep, gen)
    return RolloutBatch(
        {"prompts": rep, "tokens": tokens, "mask": mask, "reward": verify(rep, tokens, mask), "length": mask.sum(-1)},
        {"source": [source] * len(rep)},
    )


# ----- one RL step ------------------------------------------------------------------------------
def collect_groups(policy, reference, prompts, args, gen) -> tuple[RolloutBatch, dict[str, float]]:
    """G on-policy samples per prompt (the G-th is used only when no anchor is found) and, for
    ARMOR, max_tries reference tries; assembled into groups of G with shaped rewards."""
    num, g = len(prompts), args.group_size
    pool = rollout(policy, prompts, g, gen, "policy")
    tries = rollout(reference, prompts, args.max_tries, gen, "anchor") if args.armor else None
    first: list[int | None] = [None] * num  # rejection sampling: a prompt's first verified-correct try
    if tries:
        first = [
            next((j for j, r in enumerate(row) if r >= 1.0), None) for row in tries["reward"].view(num, -1).tolist()
        ]
    groups = assemble_anchor_groups(
        pool["reward"].view(num, g).tolist(), [None if j is None else 1.0 for j in first] if tries else None, g
    )
    # Map each row to its place in [policy samples; reference tries] and gather the rows.
    policy_idx = [[p * g + i for i in range(g)] for p in range(num)]
    anchor_idx = [None if j is None else num * g + p * args.max_tries + j for p, j in enumerate(first)]
    both = RolloutBatch.concat([pool, tries]) if tries else pool
    batch = both.index(groups.gather(policy_idx, anchor_idx))
    batch["is_anchor"] = groups.is_anchor.reshape(-1)
    batch["shaped_reward"] = apply_overlong_shaping(batch["reward"], batch["length"], MAX_LEN, OVERLONG_BUFFER)
    return batch, {"anchor_found_rate": sum(groups.found) / num}


def rl_step(policy, reference, optimizer, train_prompts, loss_cfg, args, gen) -> dict[str, float]:
    sampler = DynamicSampler(target_groups=args.prompts_per_step, max_rounds=args.max_rounds)
    anchor_stats: list[dict[str, float]] = []
    while not sampler.done and sampler.rounds < args.max_rounds:
        prompts = train_prompts[torch.randint(len(train_prompts), (args.prompts_per_step,), generator=gen)]
        batch, stats = collect_groups(policy, reference, prompts, args, gen)
        anchor_stats.append(stats)
        sampler.add(batch, batch["reward"].view(-1, args.group_size))  # DAPO filters on accuracy
    batch = sampler.take(allow_partial=True)
    metrics = {"anchor_found": sum(s["anchor_found_rate"] for s in anchor_stats) / len(anchor_stats), **sampler.stats()}
    if batch is None:  # every group had equal rewards: nothing to learn from this step
        return metrics

    adv = compute_advantages(args.estimator, rewards=batch["shaped_reward"].view(-1, args.group_size)).reshape(-1)
    metrics["anchor_zero_adv"] = float(anchor_zero_advantage_rate(adv, batch["is_anchor"]))
    with torch.no_grad():
        old_logp, _ = policy.logprobs(batch["prompts"], batch["tokens"])  # π_old, recomputed by the "trainer"
        ref_logp, _ = reference.logprobs(batch["prompts"], batch["tokens"])
    normalizer = loss_normalizer(batch["mask"], loss_cfg.loss_agg)  # global token count of the step
    for _ in range(args.updates_per_step):  # several updates on one batch: off-policy, clipping matters
        optimizer.zero_grad()
        calls = []
        for idx in torch.randperm(len(batch), generator=gen).chunk(args.micro_batches):
            mb = batch.index(idx)
            logp, entropy = policy.logprobs(mb["prompts"], mb["tokens"])
            loss, m = policy_loss(
                logp,
                old_logp[idx],
                ref_logp[idx],
                adv[idx],
                mb["mask"],
                loss_cfg,
                normalizer=normalizer,
                entropy=entropy,
            )
            loss.backward()
            calls.append(m)
        optimizer.step()
    return {**metrics, **reduce_loss_metrics(calls)}  # the last update's metrics


@torch.no_grad()
def accuracy(policy, prompts, gen, k: int = 8) -> float:
    """avg@k: the mean verifier reward of k samples per prompt."""
    return float(rollout(policy, prompts, k, gen, "eval")["reward"].mean())


def warm_up(policy, prompts, steps: int, lr: float) -> None:
    """Supervised warm-up on correct answers: the 'pretrained base model' of the demo."""
    targets = [[int(c) for c in str(a + b)] + [EOS] for a, b in prompts.tolist()]
    tokens = torch.tensor([t + [EOS] * (MAX_LEN - len(t)) for t in targets])
    mask = torch.tensor([[i < len(t) for i in range(MAX_LEN)] for t in targets])
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(steps):
        logp, _ = policy.logprobs(prompts, tokens)
        opt.zero_grad()
        (-(logp * mask).sum() / mask.sum()).backward()
        opt.step()


def train(name: str, base: TinyPolicy, train_prompts, val_prompts, args) -> dict[str, float]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    policy, reference = copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    loss_cfg = PolicyLossConfig(
        alpha=args.alpha if args.armor else 1.0, eps_low=0.2, eps_high=0.28, loss_agg="token-mean"
    )
    reset = build_reset_schedule("every", tau=args.tau) if args.armor else build_reset_schedule("never")
    eval_gen = torch.Generator().manual_seed(args.seed + 2)
    print(
        f"\n{name}: alpha={loss_cfg.alpha} anchors={'on' if args.armor else 'off'} "
        f"reset={f'every {args.tau}' if args.armor else 'never'}"
    )
    print(
        f"{'step':>5} {'train@8':>8} {'val@8':>7} {'entropy':>8} {'clip_lo':>8} {'clip_hi':>8} "
        f"{'kl_ref':>7} {'anchor':>7} {'anc_A=0':>7} {'kept':>5} {'reset':>5}"
    )
    for step in range(1, args.steps + 1):
        m = rl_step(policy, reference, optimizer, train_prompts, loss_cfg, args, gen)
        did_reset = reset.should_reset(step, m)
        if did_reset:
            reference.load_state_dict(policy.state_dict())  # θ_ref ← θ: the anchor sampler follows too
        if step % args.log_every == 0 or step == args.steps:
            m["train_acc"] = accuracy(policy, train_prompts, eval_gen)
            m["val_acc"] = accuracy(policy, val_prompts, eval_gen)
            print(
                f"{step:>5} {m['train_acc']:>8.3f} {m['val_acc']:>7.3f} {m.get('entropy', 0):>8.3f} "
                f"{m.get('clip_frac_low', 0):>8.4f} {m.get('clip_frac_high', 0):>8.4f} "
                f"{m.get('approx_kl_ref', 0):>7.3f} {m['anchor_found']:>7.2f} {m.get('anchor_zero_adv', 0):>7.2f} "
                f"{m['dynamic_sampling/keep_rate']:>5.2f} {'yes' if did_reset else '':>5}"
            )
    return m


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--alpha", type=float, default=0.9375)
    parser.add_argument("--tau", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--max-tries", type=int, default=4)
    parser.add_argument("--max-rounds", type=int, default=3)
    parser.add_argument("--updates-per-step", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--estimator", default="dapo")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()

    torch.manual_seed(args.seed)
    pairs = torch.cartesian_prod(torch.arange(10), torch.arange(10))
    order = torch.randperm(100, generator=torch.Generator().manual_seed(args.seed))
    train_prompts, val_prompts = pairs[order[:70]], pairs[order[70:]]
    base = TinyPolicy()
    warm_up(base, pairs, args.warmup_steps, lr=1e-2)
    gen = torch.Generator().manual_seed(args.seed + 3)
    print(f"base model: train@8={accuracy(base, train_prompts, gen):.3f} val@8={accuracy(base, val_prompts, gen):.3f}")

    results = {}
    for name, armor in (("dapo", False), ("armor", True)):
        args.armor = armor
        results[name] = train(name, base, train_prompts, val_prompts, args)
    d, a = results["dapo"], results["armor"]
    print(
        f"\nfinal: dapo train@8={d['train_acc']:.3f} val@8={d['val_acc']:.3f} | armor train@8={a['train_acc']:.3f} "
        f"val@8={a['val_acc']:.3f} anchor_found={a['anchor_found']:.2f} | {time.time() - start:.1f}s"
    )


if __name__ == "__main__":
    main()
