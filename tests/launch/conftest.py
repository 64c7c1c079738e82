import os
import random
import socket

import pytest

from armor_megatron.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_path(name: str) -> str:
    return os.path.join("configs", f"{name}.yaml")


@pytest.fixture
def load():
    """load("qwen3_8b_base_two_stage", "key=value", ...) -> RunConfig, paths relative to the repository."""

    def _load(name, *overrides):
        return load_config(os.path.join(ROOT, config_path(name)), list(overrides))

    return _load


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now, below Linux's ephemeral range
    (32768-60999): the OS never hands those out on its own, so only a process that binds them
    explicitly can take them between this check and the job's engines binding them (the SLURM
    plan gives engines consecutive ports from ``rollout.sglang.base_port``)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")
