import json
import shlex
import subprocess

import pytest

from armor_megatron.config import ConfigError
from armor_megatron.launch.plan import LaunchOptions, LaunchPlanError, plan_job, preview_allocation
from armor_megatron.launch.render import render_shell, render_text
from armor_megatron.launch.slurm_env import SlurmEnv, SlurmEnvError

TWO_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
}
ARGS = ["--config", "c.yaml"]


def env_of(nodes, gpus=8, job_id="4242"):
    return SlurmEnv(job_id=job_id, nodes=tuple(nodes), gpus_per_node=gpus)


# ---------------------------------------------------------------------------- the allocation


def test_slurm_env_reads_the_allocation():
    env = SlurmEnv.from_environ({**TWO_NODES, "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "1"})
    assert env.nodes == ("node01", "node02") and env.gpus_per_node == 8
    assert (env.job_id, env.array_task_id, env.restart_count) == ("4242", 3, 1)
    # the batch script's scontrol expansion wins over ours; typed GPU counts are understood
    env = SlurmEnv.from_environ(
        {"SLURM_JOB_ID": "1", "ARMOR_NODES": "a b", "SLURM_JOB_NODELIST": "zzz", "SLURM_GPUS_PER_NODE": "h100:4"}
    )
    assert env.nodes == ("a", "b") and env.gpus_per_node == 4


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_JOB_NODELIST": "n1"}, "SLURM_JOB_ID is not set"),
        ({"SLURM_JOB_ID": "7"}, "SLURM_JOB_NODELIST is not set"),
        ({**TWO_NODES, "SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES=3 but the node list names 2 hosts"),
        ({**TWO_NODES, "SLURM_GPUS_ON_NODE": "eight"}, "SLURM_GPUS_ON_NODE='eight' is not an integer"),
        ({**TWO_NODES, "SLURM_JOB_NODELIST": "node[1-"}, "SLURM_JOB_NODELIST: cannot parse"),
    ],
)
def test_slurm_env_errors_name_the_variable(env, message):
    with pytest.raises(SlurmEnvError, match=message.replace("[", r"\[")):
        SlurmEnv.from_environ(env)


# ---------------------------------------------------------------------------- layouts


def test_colocated_engines_fill_gpus_in_order_across_nodes(load):
    cfg = load("qwen3_30b_a3b_moe_armor", "rollout.sglang.mem_fraction_static=0.7")
    plan = plan_job(cfg, SlurmEnv.from_environ(TWO_NODES), train_args=ARGS)
    # 3 policy + 1 reference engine of tp 4 on 2 x 8 GPUs: node01 GPUs 0-3, 4-7, then node02 GPUs 0-3, 4-7
    assert [(e.group, e.node, e.gpus) for e in plan.engines] == [
        ("policy", "node01", (0, 1, 2, 3)),
        ("policy", "node01", (4, 5, 6, 7)),
        ("policy", "node02", (0, 1, 2, 3)),
        ("reference", "node02", (4, 5, 6, 7)),
    ]
    assert plan.engine_urls == (
        "http://node01:30000",
        "http://node01:30001",
        "http://node02:30002",
        "http://node02:30003",
    )
    assert plan.trainer_nodes == ("node01", "node02") and plan.world_size == 16
    assert (plan.master_addr, plan.master_port) == ("node01", 24242)  # 20000 + 4242 mod 10000
    assert shlex.join(plan.engines[3].command) == (
        "srun --overlap --nodes=1 --ntasks=1 --nodelist=node02 env -u SGLANG_RETURN_ORIGINAL_LOGPROB "
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false python -m sglang.launch_server "
        "--model-path /models/Qwen3-30B-A3B-Base --tp-size 4 --base-gpu-id 4 --host 0.0.0.0 --port 30003 "
        "--mem-fraction-static 0.7 --dtype bfloat16 --random-seed 3 --enable-memory-saver"
    )
    urls = json.dumps(list(plan.engine_urls[:3]), separators=(",", ":"))
    assert plan.trainer_command == (
        "srun",
        "--nodes=2",
        "--ntasks=16",
        "--ntasks-per-node=8",
        "--nodelist=node01,node02",
        "--kill-on-bad-exit=1",
        "--overlap",
        "python",
        "-m",
        "armor_megatron.cli.train",
        "--config",
        "c.yaml",
        f"rollout.sglang.urls={urls}",
        'anchor.reference_urls=["http://node02:30003"]',
    )


@pytest.mark.parametrize(
    "overrides, reference_engines",
    [
        ([], 2),
        (['anchor.reference_urls=["http://ref:30000"]'], 0),  # the user runs the reference group
        (["anchor.source=swap"], 0),  # π_ref is swapped into the policy engines
        (["anchor.enabled=false"], 0),
    ],
)
def test_the_reference_group_is_launched_only_when_anchors_need_it(load, overrides, reference_engines):
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=2", "anchor.reference_engines=2", *overrides)
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS)
    assert [e.group for e in plan.engines] == ["policy"] * 2 + ["reference"] * reference_engines
    assert [e.gpus for e in plan.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)][: 2 + reference_engines]
    assert plan.group_urls("policy") == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    reference_args = [a for a in plan.trainer_command if a.startswith("anchor.reference_urls=")]
    if reference_engines:
        assert reference_args == ['anchor.reference_urls=["http://127.0.0.1:30002","http://127.0.0.1:30003"]']
    else:
        assert reference_args == []


def test_disaggregated_engines_get_the_last_whole_nodes(load):
    cfg = load(
        "llama3_70b_armor", "rollout.sglang.host=0.0.0.0", "rollout.sglang.allow_unauthenticated=true"
    )  # 8 nodes, 32 engine GPUs, 4 engines of tp 8
    plan = plan_job(cfg, env_of([f"gpu{i}" for i in range(1, 9)], job_id="17"), train_args=ARGS)
    assert plan.trainer_nodes == ("gpu1", "gpu2", "gpu3", "gpu4") and plan.world_size == 32
    assert [(e.node, e.gpus[0], len(e.gpus)) for e in plan.engines] == [(f"gpu{i}", 0, 8) for i in (5, 6, 7, 8)]
    assert "--enable-memory-saver" not in plan.engines[0].command  # only colocated engines release memory
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false" not in plan.engines[0].command  # nor need a quiet /health
    assert "--overlap" not in plan.trainer_command  # the trainer's nodes are its own
    assert plan.master_port == 20017


def test_disaggregated_engines_share_each_node_when_gpus_do_not_make_whole_nodes(load):
    cfg = load(
        "qwen3_8b_base_two_stage",
        "rollout.sglang.host=0.0.0.0",
        "rollout.sglang.allow_unauthenticated=true",
        "rollout.sglang.placement=disaggregated",
        "launch.engine_gpus=4",
        "rollout.sglang.num_engines=1",
        "rollout.sglang.tp_per_engine=2",
    )
    plan = plan_job(cfg, SlurmEnv.from_environ(TWO_NODES), train_args=ARGS)
    # each node keeps its last 4 / 2 = 2 GPUs for one engine (policy, then reference) and gives GPUs 0-5 to the trainer
    assert [(e.group, e.node, e.gpus) for e in plan.engines] == [
        ("policy", "node01", (6, 7)),
        ("reference", "node02", (6, 7)),
    ]
    assert plan.trainer_procs_per_node == 6 and "--overlap" in plan.trainer_command


def test_cpu_job_runs_one_replica_of_tp_pp_processes(load):
    plan = plan_job(load("tiny_cpu"), env_of(["cpu1"], gpus=None), train_args=ARGS)
    assert plan.engines == () and plan.world_size == 2
    plan = plan_job(load("tiny_cpu", "launch.nodes=2"), env_of(["cpu1", "cpu2"], gpus=None), train_args=ARGS)
    assert plan.trainer_procs_per_node == 1 and plan.world_size == 2


def test_attached_servers_are_not_launched(load):
    cfg = load("qwen25_math_7b_dapo_armor", 'rollout.sglang.urls=["http://infer:30000"]')
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS)
    assert plan.engines == () and plan.trainer_command[-2:] == ("--config", "c.yaml")


def test_torchrun_launcher_runs_one_agent_per_node(load):
    cfg = load("tiny_cpu", "launch.nodes=2", "launch.gpus_per_node=4")
    plan = plan_job(
        cfg, env_of(["a", "b"], gpus=4, job_id="9"), train_args=ARGS, options=LaunchOptions(launcher="torchrun")
    )
    assert shlex.join(plan.trainer_command) == (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=a,b --kill-on-bad-exit=1 "
        "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=a:20009 --rdzv-id=9 "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=120 "
        "-m armor_megatron.cli.train --config c.yaml"
    )
    # a trainer entry that is not a python interpreter is started as a program
    opts = LaunchOptions.from_environ(
        {"ARMOR_TRAIN_ENTRY": "./train.sh --fast", "ARMOR_SRUN_ARGS": "--mpi=pmix"}, launcher="torchrun"
    )
    cmd = plan_job(cfg, env_of(["a", "b"], gpus=4), train_args=ARGS, options=opts).trainer_command
    assert cmd[cmd.index("--shutdown-timeout=120") + 1 :] == (
        "--no-python",
        "./train.sh",
        "--fast",
        "--config",
        "c.yaml",
    )
    assert "--mpi=pmix" in cmd[: cmd.index("torchrun")]


def test_container_and_site_flags_reach_every_srun(load):
    opts = LaunchOptions.from_environ(
        {
            "ARMOR_CONTAINER_IMAGE": "nvcr.io/x:1",
            "ARMOR_CONTAINER_MOUNTS": "/data:/data",
            "ARMOR_PYTHON": "/opt/py/bin/python",
        }
    )
    plan = plan_job(load("qwen25_math_7b_dapo_armor"), env_of(["n1"]), train_args=ARGS, options=opts)
    for cmd in [plan.trainer_command, plan.engines[0].command]:
        assert "--container-image=nvcr.io/x:1" in cmd and "--container-mounts=/data:/data" in cmd
        assert "/opt/py/bin/python" in cmd


@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_engines_run_the_sglang_environments_interpreter(load, api_key):
    overrides = ["rollout.sglang.python=/envs/sglang/bin/python", "anchor.source=separate"]
    cfg = load("qwen25_math_7b_dapo_armor", *overrides, *([f"rollout.sglang.api_key={api_key}"] if api_key else []))
    opts = LaunchOptions.from_environ({"ARMOR_PYTHON": "/envs/trainer/bin/python"})
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS, options=opts)
    assert {e.group for e in plan.engines} == {"policy", "reference"}
    for engine in plan.engines:  # both groups; with a key, the key wrapper runs there too
        python = engine.command.index("-m") - 1
        assert engine.command[python] == "/envs/sglang/bin/python", engine.command
    assert plan.trainer_command[plan.trainer_command.index("-m") - 1] == "/envs/trainer/bin/python"
    same = plan_job(load("qwen25_math_7b_dapo_armor"), env_of(["n1"]), train_args=ARGS, options=opts)
    assert same.engines[0].command[same.engines[0].command.index("-m") - 1] == "/envs/trainer/bin/python"


def test_master_port_steps_over_engine_ports(load):
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.base_port=20042", "rollout.sglang.num_engines=1")
    plan = plan_job(cfg, env_of(["n1"], job_id="42"), train_args=ARGS)
    assert [e.port for e in plan.engines] == [20042, 20043] and plan.master_port == 20044


@pytest.mark.parametrize(
    "name, overrides, env, message",
    [
        ("qwen25_math_7b_dapo_armor", [], env_of(["a", "b"]), "launch.nodes=1 but the allocation holds 2 node"),
        ("qwen25_math_7b_dapo_armor", [], env_of(["a"], gpus=4), "launch.gpus_per_node=8 but SLURM gives 4"),
        (
            "qwen3_8b_base_two_stage",
            ["rollout.sglang.host=127.0.0.1"],
            env_of(["a", "b"]),
            "rollout.sglang.host=127.0.0.1: in a multi-node job",
        ),
        (
            "qwen25_math_7b_dapo_armor",
            ["rollout.engine=local", "launch.engine_gpus=2"],
            env_of(["a"]),
            "none are launched",
        ),
        (
            "qwen3_8b_base_two_stage",
            ["rollout.sglang.weight_sync=tensor"],
            env_of(["a", "b"]),
            "weight_sync=tensor sends CUDA IPC handles, which only engines on the driver's node a can open, but engine 4 runs on b",
        ),
        ("tiny_cpu", ["launch.nodes=3"], env_of(["a", "b", "c"], gpus=None), "do not spread evenly over 3 nodes"),
        (
            "llama3_70b_armor",
            [
                "rollout.sglang.host=0.0.0.0",
                "rollout.sglang.allow_unauthenticated=true",
                "launch.engine_gpus=12",
                "rollout.sglang.num_engines=2",
                "rollout.sglang.tp_per_engine=4",
                "parallelism.tp=4",
                "parallelism.pp=1",
                "parallelism.vpp=null",
            ],
            env_of([f"n{i}" for i in range(8)]),
            "fits neither whole nodes",
        ),
    ],
)
def test_layout_errors_name_the_setting(load, name, overrides, env, message):
    with pytest.raises(LaunchPlanError) as err:
        plan_job(load(name, *overrides), env, train_args=ARGS)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        (
            "qwen25_math_7b_dapo_armor",
            ["rollout.sglang.tp_per_engine=3"],
            "rollout.sglang.tp_per_engine: 3 does not divide",
        ),
        (
            "qwen25_math_7b_dapo_armor",
            ["rollout.sglang.num_engines=9", "rollout.sglang.tp_per_engine=1"],
            "rollout.sglang.num_engines: 10 engines (9 policy + 1 reference) x tp_per_engine 1 need 10 GPUs",
        ),
        ("qwen25_math_7b_dapo_armor", ["launch.engine_gpus=2"], "launch.engine_gpus: 2 reserves GPUs, but"),
        (
            "qwen25_math_7b_dapo_armor",
            [
                "rollout.sglang.placement=disaggregated",
                "launch.engine_gpus=4",
                "rollout.sglang.num_engines=1",
                "rollout.sglang.tp_per_engine=1",
            ],
            "launch.engine_gpus: 4, but disaggregated engines need 2 (1 policy + 1 reference) x tp_per_engine 1 = 2",
        ),
        (
            "qwen25_math_7b_dapo_armor",
            ["rollout.sglang.weight_sync=distributed"],
            "rollout.sglang.weight_sync: distributed puts the driver and the engines in one NCCL group",
        ),
        ("tiny_cpu", ["rollout.engine=sglang"], "rollout.engine: sglang launches engines on GPUs"),
    ],
)
def test_engine_layouts_that_cannot_start_are_refused_when_the_config_loads(load, name, overrides, message):
    with pytest.raises(ConfigError) as err:
        load(name, *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_shipped_recipe_plans_on_its_own_allocation(load):
    for name in [
        "qwen25_math_7b_dapo_armor",
        "qwen3_8b_base_two_stage",
        "llama3_70b_armor",
        "qwen3_30b_a3b_moe_armor",
        "tiny_cpu",
    ]:
        cfg = load(name, "rollout.sglang.host=0.0.0.0", "rollout.sglang.allow_unauthenticated=true")
        plan = plan_job(cfg, preview_allocation(cfg), train_args=ARGS)
        assert plan.world_size % (cfg.parallelism.tp * cfg.parallelism.pp) == 0


# ---------------------------------------------------------------------------- rendering


def test_shell_rendering_evaluates_to_the_same_commands_and_keeps_user_env(load):
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=1", "rollout.sglang.api_key=s3 cr'et")
    plan = plan_job(cfg, env_of(["n1"]), train_args=["--config", "my configs/x.yaml"])
    script = (
        render_shell(plan)
        + 'printf "%s\\n" "$ARMOR_TRAINER_CMD" "${ARMOR_ENGINE_CMDS[@]}" "$NCCL_DEBUG" "$CUDA_DEVICE_MAX_CONNECTIONS" "$ARMOR_ENGINE_API_KEY"'
    )
    out = subprocess.run(
        ["bash", "-c", script],
        env={"NCCL_DEBUG": "INFO", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == [shlex.join(plan.trainer_command)] + [shlex.join(e.command) for e in plan.engines]
    assert lines[3:] == ["INFO", "1", "s3 cr'et"]  # the user's NCCL_DEBUG wins over the default
    assert shlex.split(lines[0])[-3] == "my configs/x.yaml"


def test_text_rendering_lists_layout_and_commands(load):
    plan = plan_job(
        load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=1", "rollout.sglang.tp_per_engine=1"),
        env_of(["n1"]),
        train_args=ARGS,
    )
    text = render_text(plan)
    assert "# engine 0 (policy): n1 GPUs 0 -> http://127.0.0.1:30000" in text
    assert "# engine 1 (reference): n1 GPUs 1 -> http://127.0.0.1:30001" in text
    assert text.splitlines()[-1] == shlex.join(plan.trainer_command)


def test_the_api_key_reaches_engines_by_environment_and_is_never_printed(load):
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=1", "rollout.sglang.api_key=s3cret")
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS)
    for engine in plan.engines:  # `ps` on the node shows these
        assert "s3cret" not in engine.command and "--api-key" not in engine.command
        module = engine.command.index("-m")
        assert engine.command[module + 1 : module + 3] == (
            "armor_megatron.rollout.sglang.launcher",
            "sglang.launch_server",
        )
    assert "s3cret" not in render_text(plan) and "ARMOR_ENGINE_API_KEY=<redacted>" in render_text(plan)
    script = render_shell(plan) + 'sh -c \'printf "%s" "$ARMOR_ENGINE_API_KEY"\''  # exported to child processes
    out = subprocess.run(
        ["bash", "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30
    )
    assert out.stdout == "s3cret"
    no_key = plan_job(
        load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=1"), env_of(["n1"]), train_args=ARGS
    )
    assert (
        "sglang.launch_server" in no_key.engines[0].command
        and "armor_megatron.rollout.sglang.launcher" not in no_key.engines[0].command
    )


def test_every_task_gets_the_cores_of_its_gpus(load):
    """Without --cpus-per-task srun confines a task to one core: each rank gets the allocation's
    cores per GPU, a torchrun task those of all its ranks, an engine those of its tp GPUs."""
    cfg = load("qwen25_math_7b_dapo_armor")
    env = {**TWO_NODES, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node01", "SLURM_CPUS_ON_NODE": "96"}
    plan = plan_job(cfg, env, train_args=ARGS)
    assert "--cpus-per-task=12" in plan.trainer_command  # srun: one task per GPU, 96 / 8 cores each
    tp = cfg.rollout.sglang.tp_per_engine
    assert all(f"--cpus-per-task={12 * tp}" in e.command for e in plan.engines)
    torchrun = plan_job(cfg, env, train_args=ARGS, options=LaunchOptions.from_environ(env, launcher="torchrun"))
    per_node = cfg.launch.gpus_per_node - cfg.launch.engine_gpus
    assert f"--cpus-per-task={12 * per_node}" in torchrun.trainer_command
    explicit = LaunchOptions.from_environ({**env, "ARMOR_CPUS_PER_GPU": "4"})
    assert "--cpus-per-task=4" in plan_job(cfg, env, train_args=ARGS, options=explicit).trainer_command
    with pytest.raises(LaunchPlanError, match="ARMOR_CPUS_PER_GPU='many' is not a number of cores"):
        LaunchOptions.from_environ({"ARMOR_CPUS_PER_GPU": "many"})


def test_the_fabric_interface_reaches_nccl_and_gloo_in_every_step(load):
    cfg = load("qwen3_30b_a3b_moe_armor", "rollout.sglang.mem_fraction_static=0.7", "launch.network_interface=ib0")
    plan = plan_job(cfg, SlurmEnv.from_environ(TWO_NODES), train_args=ARGS)
    out = subprocess.run(
        ["bash", "-c", render_shell(plan) + 'printf "%s\\n" "$NCCL_SOCKET_IFNAME" "$GLOO_SOCKET_IFNAME"'],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ib0", "ib0"]  # exported: srun hands them to the trainer and the engines
    unset = plan_job(
        load("qwen3_30b_a3b_moe_armor", "rollout.sglang.mem_fraction_static=0.7"),
        SlurmEnv.from_environ(TWO_NODES),
        train_args=ARGS,
    )
    assert not {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} & set(unset.env)  # NCCL and gloo choose themselves
    with pytest.raises(ConfigError, match="launch.network_interface.*no interface name"):
        load("qwen3_30b_a3b_moe_armor", "launch.network_interface=ib 0")


def test_deterministic_rollouts_start_the_engines_deterministic(load):
    plain = plan_job(load("qwen25_math_7b_dapo_armor"), env_of(["n1"]), train_args=ARGS)
    assert not any("--enable-deterministic-inference" in e.command for e in plain.engines)
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.deterministic=true")
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS)
    assert plan.engines and all("--enable-deterministic-inference" in e.command for e in plan.engines)
    # log-probs at the sampling temperature, as the trainer computes them: never set, and removed
    # from what srun hands the engine steps (the job's environment)
    # and, colocated, /health answers without generating (it must not run while memory is released)
    for e in plan.engines:
        python = e.command.index("-m") - 1
        env = ("env", "-u", "SGLANG_RETURN_ORIGINAL_LOGPROB", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false")
        assert e.command[python - 4 : python] == env
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in plan.env


def test_lora_adapter_sync_starts_the_policy_engines_able_to_load_adapters(load):
    lora = ("lora.enabled=true", "lora.rank=32", "model.spec=local", "parallelism.sp=false")
    merged = plan_job(load("qwen25_math_7b_dapo_armor", *lora), env_of(["n1"]), train_args=ARGS)
    assert not any("--enable-lora" in e.command for e in merged.engines)
    cfg = load("qwen25_math_7b_dapo_armor", *lora, "lora.sync=adapter", "lora.target_modules=[linear_qkv,linear_fc2]")
    plan = plan_job(cfg, env_of(["n1"]), train_args=ARGS)
    flags = [
        "--enable-lora",
        "--max-lora-rank",
        "32",
        "--lora-target-modules",
        "down_proj",
        "k_proj",
        "q_proj",
        "v_proj",
    ]
    for e in plan.engines:  # the reference group (anchor.source separate) serves the base alone
        if e.group == "policy":
            at = e.command.index("--enable-lora")
            assert list(e.command[at : at + len(flags)]) == flags, e.command
        else:
            assert "--enable-lora" not in e.command
    assert {e.group for e in plan.engines} == {"policy", "reference"}


@pytest.mark.parametrize("engines", [1, 0], ids=["launched engines", "external engines"])
def test_an_api_key_override_never_reaches_the_trainers_command_line(load, engines):
    """``ps`` on every node shows the trainer's command line: the key goes by environment."""
    extra = ["rollout.sglang.num_engines=1"] if engines else ['rollout.sglang.urls=["http://e:1"]']
    cfg = load("qwen25_math_7b_dapo_armor", *extra, "rollout.sglang.api_key=s3cret")
    train_args = ["--config", "c.yaml", "rollout.sglang.api_key=s3cret", "algorithm.alpha=0.9"]
    plan = plan_job(cfg, env_of(["n1"]), train_args=train_args)
    assert not any("s3cret" in a for a in plan.trainer_command) and "algorithm.alpha=0.9" in plan.trainer_command
    assert "s3cret" not in render_text(plan)
    script = render_shell(plan) + 'sh -c \'printf "%s" "$ARMOR_ENGINE_API_KEY"\''  # the trainer step inherits it
    out = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.stdout == "s3cret"


def test_a_key_inside_a_section_override_is_refused(load):
    cfg = load("qwen25_math_7b_dapo_armor", "rollout.sglang.num_engines=1")
    with pytest.raises(
        LaunchPlanError, match=r"^rollout.sglang=...: a command-line value holding rollout.sglang.api_key"
    ):
        plan_job(cfg, env_of(["n1"]), train_args=["--config", "c.yaml", "rollout.sglang={api_key: s3cret}"])
