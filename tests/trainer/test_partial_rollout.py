"""A step's batch from partial rollouts (`trainer.partial_rollout`): with dynamic sampling each group is
scored once, as it completes, by the filter; the kept groups' scores and breakdown make the batch's metrics,
as they do when `collect_groups` scores the groups (no filter)."""

from types import SimpleNamespace

import pytest

from armor_megatron.data.prompts import PromptRow
from armor_megatron.rollout.engine import Sample
from armor_megatron.rollout.partial import Finished
from armor_megatron.trainer.partial_rollout import PartialRollouts
from armor_megatron.trainer.rollout_phase import RolloutSettings
from tests.registered_verifiers import registered
from tests.trainer.test_rollout_phase import SAMPLING, G, _dapo_style

ENGINE = SimpleNamespace(weight_version="step-0")  # the groups are generated already: only its version is read


class CompletedGroups:
    """A partial generator whose groups complete at once, each row's with the given response texts,
    offered to the filter in the order they are drawn until ``P`` are kept."""

    groups_in_progress = 0

    def __init__(self, texts_by_row):
        self.texts_by_row = texts_by_row

    def generate(self, requests, P, weight_version, accept):
        kept = []
        for request in requests:
            texts = self.texts_by_row[int(request.key.split(":")[0])]
            members = [Finished.of(Sample(0, (5,), t, (-0.5,), "stop", weight_version)) for t in texts]
            if accept is None or accept(request, members):
                kept.append((request, members))
            if len(kept) == P:
                break
        return kept, {"partial/anchors_discarded": 0.0}


class Rows:
    """The prompt loader: the same rows, batch after batch."""

    def __init__(self, rows):
        self.rows = rows

    def next_batch(self):
        return list(self.rows)


@pytest.mark.parametrize("filtered", [True, False], ids=["dynamic_sampling", "no_filter"])
def test_the_kept_groups_breakdown_reaches_the_metrics_as_their_mean(filtered):
    rows = [PromptRow(i, f"{i}+1=", str(i + 1)) for i in range(3)]
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            group_size=G, prompts_per_step=2, partial=SimpleNamespace(over_provision=1.0, max_versions=1)
        ),
        algorithm=SimpleNamespace(dynamic_sampling=SimpleNamespace(enabled=filtered, max_oversample_rounds=1)),
    )
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier="test_dapo_style")
    partial = PartialRollouts(cfg, settings, lambda p: [ord(c) for c in p], {r.index: r for r in rows}, 0)
    # an even first character is correct (acc): row 1's group is all wrong, so a filter drops it
    texts = ["bbaa", "aaaa", "baaa"]
    partial.generator = CompletedGroups({r.index: t for r, t in zip(rows, texts)})
    with registered(test_dapo_style=_dapo_style):
        accepted, metrics = partial.generate(ENGINE, Rows(rows), None, "ref-0")
        batch, metrics = partial.assemble(accepted, metrics, 0, ENGINE, None, "ref-0")
    trained = [0, 2] if filtered else [0, 1]
    assert batch["prompt_index"] == [rows[p].index for p in trained for _ in range(G)]
    assert batch["accuracy"].tolist() == [1.0 if t == "b" else -1.0 for p in trained for t in texts[p]]
    # the mean over the 8 responses that train (filtered: not over all 12 the filter scored, 0.25)
    assert metrics["reward/breakdown/acc"] == pytest.approx(3 / 8 if filtered else 2 / 8)
    assert metrics["reward/timeouts"] == 0.0
