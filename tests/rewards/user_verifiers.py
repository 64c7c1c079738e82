"""User verifiers loaded by spec string in test_registry.py ("tests.rewards.user_verifiers:...")."""

from armor_megatron.rewards import RewardResult

NOT_CALLABLE = 3


def exact_match(response, ground_truth):
    return response.strip() == str(ground_truth)


def with_breakdown(response, ground_truth, *, scale=1.0):
    return {"score": scale * len(response), "length": len(response), "extracted": response[:3], "note": "dropped"}


def full_result(response, ground_truth):
    return RewardResult(0.5, {"half": 1.0}, "x")


def takes_one(text):
    return 1.0


def returns_list(response, ground_truth):
    return [1.0]


def returns_nan(response, ground_truth):
    return float("nan")


class Judge:
    @staticmethod
    def score(response, ground_truth):
        return 1.0


def hangs_on_hang(response, ground_truth):
    """Never returns on the response "hang" (a stuck sandbox); scores 1 otherwise."""
    import time

    while response == "hang":
        time.sleep(3600)
    return 1.0


def raises(response, ground_truth):
    raise KeyError("no judge for this row")


def long_extracted(response, ground_truth):
    return {"score": 1.0, "extracted": "x" * 5000}


def hangs_always(response, ground_truth):
    import time

    while True:
        time.sleep(3600)
