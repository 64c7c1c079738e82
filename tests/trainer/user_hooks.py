"""User code the end-to-end runs load by ``module:function`` (the trainer subprocess imports it
through PYTHONPATH): verifiers, a reset hook, an environment."""


def never_right(response, ground_truth):
    """A verifier no response satisfies: every group's rewards are equal (all 0) and no anchor is found."""
    return 0.0


def reset_when_evaluated(step, metrics):
    """validation_hook: reset θ_ref after every step that was evaluated (its metrics hold the evaluation)."""
    return "eval/mean/pass@1" in metrics


def odd_length(response, ground_truth):
    """A verifier that rewards responses of odd length: groups of random responses have signal."""
    return float(len(response) % 2)


def hangs_once_marked(response, ground_truth):
    """A verifier stuck for good (a sandbox that never answers) on generated responses while
    $ARMOR_TEST_HANG_MARKER names a file path: it creates that file, then never returns. The
    start-up probes' responses (the ground truth stated in a box, and one stating no answer) it
    answers, as does every call without the variable (the requeued run)."""
    import os
    import time

    from armor_megatron.rewards.registry import NO_ANSWER

    marker = os.environ.get("ARMOR_TEST_HANG_MARKER")
    if marker and not response.startswith("The answer is \\boxed{") and response != NO_ANSWER:
        open(marker, "a").close()
        while True:
            time.sleep(3600)
    return float(len(response) % 2)


def odd_length_signalling(response, ground_truth):
    """`odd_length`, and a preemption that lands while a rollout is scoring: the generated response
    numbered $ARMOR_TEST_SIGTERM_AT_CALL (0-based, counted over every call of the run by files created in
    $ARMOR_TEST_CALL_DIR) sends SIGTERM to the trainer, this worker's parent, and is scored a moment
    later. Without the variables it is `odd_length`."""
    import os
    import signal
    import time

    from armor_megatron.rewards.registry import NO_ANSWER

    calls, at = os.environ.get("ARMOR_TEST_CALL_DIR"), os.environ.get("ARMOR_TEST_SIGTERM_AT_CALL")
    if calls and at and not response.startswith("The answer is \\boxed{") and response != NO_ANSWER:
        index = 0
        while True:  # the first free number is this call's (workers score concurrently)
            try:
                os.close(os.open(os.path.join(calls, str(index)), os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                index += 1
        if index == int(at):
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(0.5)
    return odd_length(response, ground_truth)


class OneLookup:
    """rollout.environment of the multi-turn runs: answers the model's first turn with the row's answer, ends at the second."""

    def __init__(self, row):
        self.answer, self.turns = row["answer"], 0

    def step(self, response):
        self.turns += 1
        return f"={self.answer} " if self.turns == 1 else None
