r"""Verifiable rewards and evaluation metrics (pure Python + math-verify; no megatron, no engine).

    from armor_megatron.rewards import compute_score, load_verifier
    compute_score("... so the answer is \\boxed{\\frac12}", "0.5").score      # 1.0
    load_verifier("my_pkg.rewards:judge")     # a user verifier(response, ground_truth)

Registered verifiers: ``math`` (math-verify equivalence of the last ``\boxed{}``, under a hard
timeout), ``multiple_choice`` (option letters A–J), ``format`` (exactly one ``\boxed{}``),
``think_format`` (``</think>``-closed reasoning, then exactly one ``\boxed{}``), ``safety``
(refuse harmful requests, answer benign ones), ``knowledge`` (normalised exact match with
aliases). A mixed dataset routes each row to the verifier its ``type`` column names. Build
variants with ``make_math_verifier``, ``make_choice_verifier``, ``make_format_verifier``,
combine with ``weighted_verifier``, add your own with ``register_verifier``. A verifier may name
the row fields it wants (``prompt``, ``data_source``, ``extra_info``, ``row``, ``trajectory``;
verl's ``compute_score`` works unchanged) and score a group or batch at once (``responses``):
:mod:`armor_megatron.rewards.fields`. ``reward.remote`` adds the verifier ``remote``, a judge over
HTTP (:mod:`armor_megatron.rewards.remote`).
"""

from armor_megatron.rewards.batch import compute_score, score_batch
from armor_megatron.rewards.choice import make_choice_verifier
from armor_megatron.rewards.combine import weighted_verifier
from armor_megatron.rewards.format_rule import make_format_verifier
from armor_megatron.rewards.isolated import configure_pool, shutdown_workers
from armor_megatron.rewards.knowledge import verify_knowledge
from armor_megatron.rewards.math_answer import make_math_verifier
from armor_megatron.rewards.metrics import (
    CORRECT_THRESHOLD,
    accuracy_by_domain,
    avg_at_k,
    flatten_metrics,
    group_metrics,
    metrics_by_dataset,
    pass_at_k,
)
from armor_megatron.rewards.registry import (
    check_ground_truth,
    get_verifier,
    load_verifier,
    register_verifier,
    registered_verifiers,
    scorable,
)
from armor_megatron.rewards.result import RewardResult, Verifier
from armor_megatron.rewards.safety import verify_safety
from armor_megatron.rewards.spec import VerifierSpecError

__all__ = [
    "CORRECT_THRESHOLD",
    "RewardResult",
    "Verifier",
    "VerifierSpecError",
    "accuracy_by_domain",
    "avg_at_k",
    "check_ground_truth",
    "compute_score",
    "configure_pool",
    "flatten_metrics",
    "get_verifier",
    "group_metrics",
    "load_verifier",
    "make_choice_verifier",
    "make_format_verifier",
    "make_math_verifier",
    "metrics_by_dataset",
    "pass_at_k",
    "register_verifier",
    "registered_verifiers",
    "score_batch",
    "scorable",
    "shutdown_workers",
    "verify_knowledge",
    "verify_safety",
    "weighted_verifier",
]
