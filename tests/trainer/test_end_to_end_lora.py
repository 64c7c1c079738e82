"""A LoRA ARMOR run through ``armor-train`` on the tiny model (TP=2, gloo, the local engine): only the
adapters train, the reference is the actor's base (adapters off) and its resets merge the adapters,
the engine samples with the merged weights; a checkpoint holds the base only once a reset has merged
into it (before, the adapters and where the base comes from), and a run killed with ``kill -9`` at
such a checkpoint resumes, reading the base from ``model.path``, to the same metrics as the run that
was never stopped. (Whether 80 steps raise the reward is measured, not tested: the runs are in
docs/lora.md.)"""

import pytest

from tests.megatron.test_lora import _bytes, _stored_tensor_keys
from tests.trainer.test_end_to_end import _args, _kill_9_at_checkpoint, _train_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LORA = [
    "lora.enabled=true",
    "lora.rank=8",
    "lora.alpha=16",
    "optimizer.lr=2e-3",  # adapters start at B = 0 and take a larger rate than full fine-tuning
    "train.steps=6",
    "reference.tau=3",
    "checkpoint.every_steps=2",  # step 2: before the first reset (adapters only); 4 and 6: after one
    "eval.every_steps=3",
]


def test_a_lora_run_trains_resets_by_merging_and_resumes_bit_exact_after_kill_9(tiny, tmp_path):
    # both runs in processes of their own, as a user starts them: a pooled rank carries what the
    # session's earlier calls left in its process (seen in the whole suite: the last bits of step 4)
    straight = _train_cli(tiny, tmp_path / "straight", *LORA)
    assert sorted(straight) == list(range(7))
    for step in range(1, 7):
        m = straight[step]
        assert m["train/skipped"] == 0.0 and m["train/grad_norm"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-5  # the engine sampled with the merged weights
    # π_ref = the base = π_θ at the start and again right after each merge (steps 3 and 6)
    kl = {step: straight[step]["train/approx_kl_ref"] for step in range(1, 7)}
    assert kl[1] < 1e-9 and kl[4] < 1e-9 and kl[3] > 1e-7, kl
    assert straight[3]["reference/reset"] == 1.0 and straight[6]["reference/reset"] == 1.0
    assert "eval/val/pass@1" in straight[6]
    # the base is in a checkpoint once a reset has merged into it
    ckpt = tmp_path / "straight" / "ckpt"
    before, after = ckpt / "iter_0000002", ckpt / "iter_0000004"
    assert all(".lora." in k for k in _stored_tensor_keys(before))
    assert "embedding.word_embeddings.weight" in _stored_tensor_keys(after)
    assert _bytes(before) < _bytes(after)

    run = tmp_path / "killed"
    assert _kill_9_at_checkpoint(_args(tiny, run, *LORA), run, "iter_0000002")
    resumed = _train_cli(tiny, run, *LORA)  # the base read from model.path again, checked against its record
    for step in (3, 4, 5, 6):
        for key in ("rollout/accuracy", "train/loss", "train/grad_norm", "train/approx_kl_ref"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert resumed[6]["eval/val/pass@1"] == straight[6]["eval/val/pass@1"]
