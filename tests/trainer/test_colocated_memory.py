"""The colocated job's device memory, phase by phase, on CPU: the trainer's real calls (engines
releasing and resuming memory tags over HTTP at SGLang test-double servers, the trainer's host
offload, log-prob passes, updates, weight pushes, checkpoints) drive a `DeviceLedger` sized as
the 7B recipe on 80 GiB GPUs (configs/qwen25_math_7b_dapo_armor.yaml, `armor-train --plan`) with
SGLang's default ``mem_fraction_static`` 0.7. From the start (engines up, trainer not built) through
two steps no phase may exceed the GPU, and the phases are the ones ``--plan`` replays. The models
are stand-ins holding a tiny HF model: what a GPU would hold is the planner's, not theirs."""

import json

import pytest
import torch

from armor_megatron.config import load_config
from armor_megatron.config.validate import model_arch_of
from armor_megatron.launch.device_ledger import GIB, DeviceLedger, replay_colocated_step
from armor_megatron.launch.memory import plan_memory
from armor_megatron.megatron.collective_export import CollectiveExport
from armor_megatron.models.arch import ModelArch
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang import engine as sglang_engine
from armor_megatron.rollout.sglang.engine import MEMORY_TAGS, SGLangEngine
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint
from armor_megatron.trainer import components
from armor_megatron.trainer.loop import ArmorTrainer

pytestmark = pytest.mark.timeout(300)


SEVEN_B = ("configs/qwen25_math_7b_dapo_armor.yaml", ["rollout.sglang.mem_fraction_static=0.7"])


def seven_b_plan():
    cfg = load_config(*SEVEN_B)
    plan = plan_memory(cfg, model_arch_of(cfg))
    assert plan.placement == "colocated" and plan.problem() is None
    return plan.stages[0].sizes, plan.stages[0].phases, plan.stages[0].start_phases


class LedgerEngine(SGLangEngine):
    """An SGLang client whose memory calls and weight pushes are also told to the ledger."""

    ledger: DeviceLedger
    roles: dict  # engine URL -> role

    @property
    def role(self) -> str:
        return self.roles[self.workers[0].url]

    def release_memory(self, timeout=None, tags=MEMORY_TAGS):
        super().release_memory(timeout=timeout, tags=tags)
        self.ledger.engine_released(self.role, tuple(tags))

    def resume_memory(self, timeout=None, tags=MEMORY_TAGS):
        super().resume_memory(timeout=timeout, tags=tags)
        self.ledger.engine_resumed(self.role, tuple(tags))

    def update_weights(self, weights, version, timeout=None):
        self.ledger.weights_pushed(self.role)
        super().update_weights(weights, version, timeout=timeout)


class _Guard:
    def observe_step(self, metrics):
        pass


class StandInModel:
    """The Megatron models' surface the loop uses, around a tiny HF model (its parameters are what
    the host offload moves and the export reads); compute is charged to the ledger."""

    def __init__(self, hf_model, ledger: DeviceLedger):
        self.model_chunks = [hf_model]
        self.ledger = ledger
        self.guard = _Guard()

    def _check_on_device(self):
        p = next(self.model_chunks[0].parameters())
        assert p.untyped_storage().nbytes() > 0, "computing with the trainer's memory on the host"

    def compute_logprobs(self, input_ids, lengths, with_entropy=False):
        self._check_on_device()
        self.ledger.compute("logprobs")
        return type("LogProbs", (), {"logprobs": torch.zeros(input_ids.shape), "entropy": None})()

    def train_step(self, batch):
        self._check_on_device()
        self.ledger.compute("update")
        return {"loss": 0.0}

    def reset_from(self, actor):
        self._check_on_device()
        with torch.no_grad():
            for mine, theirs in zip(self.model_chunks[0].parameters(), actor.model_chunks[0].parameters()):
                mine.copy_(theirs)


class StandInExport(CollectiveExport):
    """The stand-in model's tensors under the export's read-once contract (one process: no collectives)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def _items(self):
        for n, t in self.model.model_chunks[0].state_dict().items():
            yield n, t.detach().clone()


def export(model):
    return StandInExport(model)


@pytest.fixture
def colocated_trainer(tmp_path, monkeypatch):
    """The start as ``trainer/run.py`` orders it, on a ledger: engines up → released → trainer built → first push."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "hf")
    hf_config, tokenizer = make_tiny_checkpoint(path, seed=0)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes, planned, planned_start = seven_b_plan()
    ledger = DeviceLedger(sizes, trainer_on_device=False)  # the job starts: engines up, no model built
    servers = [SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path).start() for _ in range(2)]
    try:
        cfg = load_config(
            "configs/tiny_cpu.yaml",
            [
                f"model.path={path}",
                f"data.train_path={tmp_path}/train.jsonl",
                "eval.datasets=[]",
                "eval.every_steps=0",
                "rollout.engine=sglang",
                f"rollout.sglang.urls=[{servers[0].url}]",
                f"anchor.reference_urls=[{servers[1].url}]",
                "rollout.sglang.placement=colocated",
                "rollout.sglang.weight_sync=disk",
                f"rollout.sglang.disk_dir={tmp_path}/engine_weights",
                "reward.verifier=tests.trainer.user_hooks:odd_length",
                "rollout.prompts_per_step=4",
                "rollout.group_size=4",
                "reference.reset=every",
                "reference.tau=1",
                "checkpoint.every_steps=1",
                f"checkpoint.dir={tmp_path}/ckpt",
                f"logging.dir={tmp_path}/runs",
            ],
        )
        monkeypatch.setattr(sglang_engine, "SGLangEngine", LedgerEngine)  # what the trainer's code builds
        monkeypatch.setattr(LedgerEngine, "ledger", ledger, raising=False)
        monkeypatch.setattr(
            LedgerEngine, "roles", {servers[0].url: "policy", servers[1].url: "reference"}, raising=False
        )
        ledger.start("engines up")
        components.release_engines_at_start(cfg)  # trainer/run.py, before any model is built
        models = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
        for p in (p for m in models for p in m.parameters()):
            p.data = p.data.clone()  # own memory: the loaded tensors map the file
        actor, reference = (StandInModel(m, ledger) for m in models)
        ledger.trainer_built()
        make_engines = components.engine_factory(cfg, hf_config, tokenizer)
        trainer = ArmorTrainer(
            cfg, ModelArch.from_hf_config(hf_config), actor, reference, tokenizer, make_engines, export
        )
        trainer.trainer_memory.ledger = ledger
        trainer.start_engines()
        yield trainer, ledger, planned, planned_start, servers
        trainer.driver.policy_engine.shutdown()
        trainer.driver.reference_engine.shutdown()
    finally:
        for server in servers:
            server.stop()


def test_the_colocated_start_fits_and_is_the_one_the_plan_replays(colocated_trainer):
    """Engines release everything before the trainer is built, the first push follows a step's
    order; before, the trainer was built beside engines holding mem_fraction_static and their
    graphs, and the first push came with everything on the GPU at once."""
    trainer, ledger, _, planned_start, servers = colocated_trainer
    problem = ledger.problem("colocated 7B start on CPU")
    assert problem is None, problem + "\n" + "\n".join(f"{p.label}: {p.total / GIB:.1f}" for p in ledger.phases)
    assert [(p.label, round(p.total)) for p in ledger.phases] == [(p.label, round(p.total)) for p in planned_start]
    for server in servers:  # every engine holds all its memory again, the pushed weights in place
        assert not server._released and not server._weights_lost and server.failure is None


def test_the_start_before_issue_31_does_not_fit():
    """Today's order replayed on the same sizes: trainer built beside the engines' static region."""
    sizes, _, _ = seven_b_plan()
    ledger = DeviceLedger(sizes, trainer_on_device=False)
    ledger.start("engines up")
    ledger.trainer_built()
    ledger.weights_pushed("policy")
    problem = ledger.problem("start")
    assert problem is not None and problem.startswith("start, phase 'trainer built'")


@pytest.mark.slow  # two SGLang test doubles and a colocated trainer's whole step: near the 10 s limit on a busy machine
def test_a_colocated_step_never_holds_trainer_and_engines_at_once(colocated_trainer):
    trainer, ledger, planned, _, servers = colocated_trainer
    saves = []

    def save():
        assert trainer.trainer_memory is None or not trainer.trainer_memory.offloaded
        ledger.checkpoint()
        saves.append(trainer.step)

    for _ in range(2):
        ledger.start("rollout")
        first = len(ledger.phases)
        metrics, _ = trainer._step(save)
        assert "train/skipped_no_signal" not in metrics  # the verifier sees to it
    assert saves == [1, 2]
    problem = ledger.problem("colocated 7B step on CPU")
    assert problem is None, problem + "\n" + "\n".join(f"{p.label}: {p.total / GIB:.1f}" for p in ledger.phases)
    # the second step's phases are the ones --plan replays, byte for byte
    step = [(p.label, round(p.total)) for p in ledger.phases[first - 1 :]]
    assert step == [(p.label, round(p.total)) for p in planned]
    for server in servers:  # every engine holds all its memory again, the pushed weights in place
        assert not server._released and not server._weights_lost
    assert servers[0].engine.weight_version == "step-2"


def test_the_plan_replays_the_same_order():
    sizes, planned, _ = seven_b_plan()
    replayed = replay_colocated_step(DeviceLedger(sizes, trainer_on_device=False)).phases
    assert [p.label for p in replayed] == [p.label for p in planned]
    assert max(p.total for p in planned) < sizes.gpu
