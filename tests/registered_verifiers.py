"""Register throwaway verifiers for the length of a test (or module) and remove them after, so
no test sees another's verifiers in the process-wide registry."""

import contextlib

from armor_megatron.rewards import register_verifier
from armor_megatron.rewards.registry import unregister_verifier


@contextlib.contextmanager
def registered(**verifiers):
    """``with registered(name=fn, ...):`` — each ``fn(response, ground_truth)`` is registered as
    ``name`` inside the block; a name already taken fails at once instead of being replaced."""
    done = []
    try:
        for name, fn in verifiers.items():
            register_verifier(name)(fn)
            done.append(name)
        yield
    finally:
        for name in done:
            unregister_verifier(name)
