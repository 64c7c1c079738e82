import types

from armor_megatron.cli.train import processes_needed


def layout(gpus_per_node=0, engine_gpus=0, **parallelism):
    par = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, **parallelism}
    return types.SimpleNamespace(
        parallelism=types.SimpleNamespace(**par),
        launch=types.SimpleNamespace(gpus_per_node=gpus_per_node, engine_gpus=engine_gpus),
    )


def test_cpu_runs_start_the_ranks_the_layout_needs():
    assert processes_needed(layout(tp=2)) == 2
    assert processes_needed(layout(pp=2)) == 2
    assert processes_needed(layout(ep=2)) == 2  # experts take their ranks from data parallelism
    assert processes_needed(layout(tp=2, ep=4)) == 4
    assert processes_needed(layout(tp=2, pp=2, ep=2)) == 4


def test_gpu_runs_start_one_rank_per_trainer_gpu():
    assert processes_needed(layout(gpus_per_node=8, engine_gpus=2, tp=2)) == 6
