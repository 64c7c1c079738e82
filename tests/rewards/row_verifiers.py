"""Verifiers naming row fields, loaded by spec (``tests.rewards.row_verifiers:...``) in a reward worker process."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl reward function as verl's users write it (gsm8k's ``#### <answer>`` rule), unchanged."""
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"reward function is not implemented for {data_source=}")
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "")
    bonus = 0.5 if extra_info and extra_info.get("split") == "train" else 0.0
    return (1.0 if answer == ground_truth else 0.0) + bonus


def sees_the_row(response, ground_truth, prompt, row, trajectory):
    """1 when the response repeats the row's ``hint`` column; the prompt's length in the breakdown."""
    assert trajectory is None, "a single-turn response has no trajectory"
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return {"score": float(response == row["hint"]), "prompt_chars": len(text)}


def ranks(responses, ground_truth):
    """A group verifier: 1 for the shortest response that holds the answer, 0.5 for others holding it, 0 else."""
    holding = [i for i, r in enumerate(responses) if str(ground_truth) in r]
    best = min(holding, key=lambda i: len(responses[i]), default=None)
    return [1.0 if i == best else 0.5 if i in holding else 0.0 for i in range(len(responses))]


def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batch reward signature: one call, one score per response."""
    return [compute_score(d, s, g, e) for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]


def drops_one(responses, ground_truths):
    """A batch verifier returning one score too few."""
    return [1.0] * (len(responses) - 1)


def weighted_by_source(data_source, solution_str, ground_truth, extra_info):
    """verl's signature: an exact match weighted by ``extra_info["weight"]``, for the ``toy`` source only."""
    if data_source != "toy":
        raise NotImplementedError(f"reward function is not implemented for {data_source=}")
    return extra_info["weight"] * float(solution_str == ground_truth)
