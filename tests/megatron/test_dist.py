import os

import pytest

from armor_megatron.megatron.dist import DistEnv, ParallelConfig, _gpu_index
from armor_megatron.models.arch import ModelArch
from tests.processes import stopped_after

DENSE = ModelArch(
    family="llama",
    vocab_size=128,
    hidden_size=32,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
)
MOE = ModelArch(
    family="mixtral",
    vocab_size=128,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
)


def test_torchrun_env():
    env = DistEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert env == DistEnv(3, 8, 1, "10.0.0.1", 1234, "torchrun")


def test_slurm_env_takes_master_from_first_node_and_port_from_job_id():
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "5",
            "SLURM_JOB_NODELIST": "gpu[12-13]",
            "SLURM_JOB_ID": "123456",
        }
    )
    # 20000 + 123456 % 20000 = 23456
    assert env == DistEnv(5, 16, 5, "gpu12", 23456, "slurm")


def test_torchrun_variables_win_over_slurm_ones():
    env = DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"})
    assert env.launcher == "torchrun" and env.world_size == 2


def test_single_process_without_launcher():
    assert DistEnv.from_environ({}) == DistEnv(0, 1, 0, "127.0.0.1", 0, "single")  # 0: the OS picks a port


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside world size 4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "cannot find the master host"),
    ],
)
def test_bad_environment(environ, message):
    with pytest.raises(ValueError, match=message):
        DistEnv.from_environ(environ)


@pytest.mark.parametrize(
    "parallel, world, arch, message",
    [
        (ParallelConfig(tp=2, pp=2), 6, None, r"world size 6 is not divisible by tp·pp·cp = 2·2·1 = 4"),
        (ParallelConfig(tp=1, cp=4), 6, None, r"not divisible by tp·pp·cp = 1·1·4 = 4"),
        (ParallelConfig(tp=8), 8, DENSE, "num_attention_heads=4 is not divisible by tp=8"),
        (
            ParallelConfig(tp=4),
            4,
            ModelArch(**{**DENSE.__dict__, "num_key_value_heads": 2}),
            "num_key_value_heads=2 is not divisible by tp=4",
        ),
        (ParallelConfig(pp=3), 3, DENSE, "num_layers=4 is not divisible by pp=3"),
        (ParallelConfig(pp=2, vpp=4), 2, DENSE, r"num_layers=4 is not divisible by pp·vpp = 8"),
        (ParallelConfig(ep=3), 3, MOE, "num_experts=4 is not divisible by ep=3"),
        (ParallelConfig(ep=2), 2, DENSE, "ep=2 needs a MoE model"),
        (ParallelConfig(ep=4, pp=2), 4, None, r"world size 4 is not divisible by etp·ep·pp = 1·4·2 = 8"),
        (ParallelConfig(tp=0), 4, None, "tp=0 must be >= 1"),
    ],
)
def test_layout_errors(parallel, world, arch, message):
    with pytest.raises(ValueError, match=message):
        parallel.validate(world, arch)


def test_gpu_binding():
    assert _gpu_index(3, 8) == 3
    assert _gpu_index(3, 1) == 0  # one GPU per task already bound by the launcher
    with pytest.raises(ValueError, match="local rank 3 has no GPU \\(2 visible\\)"):
        _gpu_index(3, 2)


def test_valid_layouts():
    ParallelConfig(tp=2, pp=2).validate(8, DENSE)
    ParallelConfig(ep=2).validate(2, MOE)
    ParallelConfig(pp=2, vpp=2).validate(2, DENSE)
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(8) == 2


def slurm_worker(rank):
    import os

    import torch
    import torch.distributed as tdist
    from megatron.core import parallel_state

    from armor_megatron.megatron import dist

    slurm = {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": os.environ["MASTER_PORT"],  # the store run_ranks holds for this run
    }
    try:
        dist.initialize(ParallelConfig(tp=2), DENSE, environ={**slurm, "SLURM_NTASKS": "3"})
    except ValueError as e:  # checked before any process group exists
        layout_error = str(e)
    ctx = dist.initialize(ParallelConfig(tp=2), DENSE, environ=slurm, deterministic=True)
    try:
        total = torch.tensor([rank + 1.0])
        tdist.all_reduce(total)
        return (
            layout_error,
            ctx.env.launcher,
            ctx.backend,
            str(ctx.device),
            total.item(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
            torch.are_deterministic_algorithms_enabled(),
        )
    finally:
        dist.shutdown()
        assert not tdist.is_initialized() and not parallel_state.model_parallel_is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_initialize_from_slurm_variables():
    from tests.megatron.spawn import run_ranks

    results = run_ranks(slurm_worker, 2, timeout=100)
    error = "world size 3 is not divisible by tp·pp·cp = 2·1·1 = 2"
    assert results == [
        (error, "slurm", "gloo", "cpu", 3.0, 0, 1, True),
        (error, "slurm", "gloo", "cpu", 3.0, 1, 1, True),
    ]


_SINGLE = """
from armor_megatron.megatron import dist
from armor_megatron.megatron.dist import ParallelConfig
ctx = dist.initialize(ParallelConfig(), environ={})
print(ctx.env.launcher, ctx.env.world_size, flush=True)
dist.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_single_processes_side_by_side_do_not_share_a_rendezvous_port():
    """Two launcher-less runs at once (and a third program on the old default port 29500): each
    process rendezvouses with itself on a port the OS picks."""
    import socket
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_PROCID")}
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", 29500))
            squatter.listen()
        except OSError:
            pass  # something else holds it already: just as good
        procs = [
            subprocess.Popen([sys.executable, "-c", _SINGLE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(2)
        ]
        with stopped_after(procs[0]), stopped_after(procs[1]):
            outs = [p.communicate(timeout=100) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-2000:]
        assert out.decode().split() == ["single", "1"]
