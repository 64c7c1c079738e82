"""Our SGLang requests and payloads through SGLang 0.5.23's own code, on CPU.

The client tests talk to the test double; here the bodies our client actually sends (recorded
from the double while the real client code runs) go through the code SGLang runs on them:
the ``/generate`` contract gate, ``GenerateReqInput`` parsing and normalisation,
``SamplingParams.normalize``/``verify``, the weight-update request classes, and
``SafeUnpickler`` + ``FlattenedTensorBucket`` for tensor payloads (tests/rollout/sglang/
real_sglang_runner.py, run in the environment of tools/sglang_cpu_env.py, built on first use into
the user's cache and reused by every later run and clone). Negative twins: what the double refuses,
SGLang refuses too.
"""

import copy
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang import tensor_payload
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer, _HTTPError
from armor_megatron.rollout.testing.tiny_models import encode, tiny_weights

from .conftest import FAST_RETRY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_sglang_runner.py")
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k


@pytest.fixture(scope="session")
def sglang_python():
    """The interpreter of the SGLang CPU environment (built by tools/sglang_cpu_env.py when absent)."""
    tool = os.path.join(REPO, "tools", "sglang_cpu_env.py")
    proc = subprocess.run([sys.executable, tool], capture_output=True, text=True, timeout=900)
    if proc.returncode == 75:
        pytest.skip(f"SGLang CPU environment not built, package index unreachable: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"tools/sglang_cpu_env.py failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def sglang_runner(sglang_python):
    """real_sglang_runner.py running in SGLang's environment (SGLang imported once for the session)."""
    env = dict(os.environ, ARMOR_MP_AUTHKEY=multiprocessing.current_process().authkey.hex())
    env.pop("PYTHONPATH", None)  # SGLang's side sees SGLang only
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: warnings never block the runner
        proc = subprocess.Popen(
            [sglang_python, RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
        proc.stderr_file = stderr
        try:
            yield proc
        finally:
            proc.kill()
            proc.communicate(timeout=60)


def run_sglang(runner, checks, tokenizer=None, vocab_size=None):
    """Results of ``checks`` run by real_sglang_runner.py in SGLang's environment (one per check)."""
    runner.stdin.write(json.dumps({"checks": checks, "tokenizer": tokenizer, "vocab_size": vocab_size}) + "\n")
    runner.stdin.flush()
    line = runner.stdout.readline()
    if not line:
        runner.stderr_file.seek(0)
        pytest.fail(f"the SGLang runner died:\n{runner.stderr_file.read()[-3000:]}")
    results = json.loads(line)
    assert len(results) == len(checks)
    return results


class RecordingServer(SGLangTestServer):
    """The double, keeping a copy of every request body it gets (path, body)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bodies = []

    def handle(self, method, path, headers, body):
        self.bodies.append((path, copy.deepcopy(body)))
        return super().handle(method, path, headers, body)

    def sent(self, path):
        return [b for p, b in self.bodies if p == path]


@pytest.fixture
def recording(tiny_ckpt):
    path, _, _ = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="default")
    with RecordingServer(engine, model_path=path) as server:
        yield server


SAMPLINGS = {
    "sampled": (SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5), 3),
    "greedy": (SamplingParams(max_new_tokens=3, temperature=0.0), 1),
    "no top_k, stops": (SamplingParams(max_new_tokens=4, top_k=0, stop=("9",), stop_token_ids=(1,)), 2),
    "ignore_eos": (SamplingParams(max_new_tokens=2, ignore_eos=True), 2),
}


def test_generate_bodies_pass_sglangs_parsing_and_verify(recording, tiny_ckpt, sglang_runner):
    path, cfg, tok = tiny_ckpt
    engine = SGLangEngine([recording.url], retry=FAST_RETRY, request_timeout=60.0)
    prompt = encode(tok, "12+3=")
    for sampling, n in SAMPLINGS.values():
        engine.generate([prompt], n, sampling)
    det = SGLangEngine([recording.url], retry=FAST_RETRY, request_timeout=60.0, deterministic=True)
    det.reseed(7)
    det.generate([prompt], 2, SAMPLINGS["sampled"][0])
    bodies = recording.sent("/generate")
    assert len(bodies) == len(SAMPLINGS) + 1
    results = run_sglang(
        sglang_runner, [{"kind": "generate", "body": b} for b in bodies], tokenizer=path, vocab_size=cfg["vocab_size"]
    )
    for body, res in zip(bodies, results):
        assert res["ok"], f"SGLang refuses our /generate body {body}: {res['error']}"
    sampled, greedy, no_top_k, ignore_eos, deterministic = results
    # what our parameters mean to SGLang
    assert sampled["parallel_sample_num"] == 3 and sampled["params"][0]["top_k"] == 5
    assert sampled["params"][0]["temperature"] == pytest.approx(0.7) and sampled["params"][0]["top_p"] == 0.9
    assert greedy["params"][0]["top_k"] == 1  # temperature 0: SGLang's greedy
    assert no_top_k["params"][0]["top_k"] == TOP_K_ALL  # our top_k 0 disables the filter: so does SGLang's -1
    assert no_top_k["params"][0]["stop_strs"] == ["9"] and no_top_k["params"][0]["stop_token_ids"] == [1]
    assert ignore_eos["params"][0]["ignore_eos"] is True
    # deterministic mode: the prompt twice, one params dict and one seed per sample
    assert deterministic["batch_size"] == 2 and deterministic["parallel_sample_num"] == 1
    assert [p["sampling_seed"] for p in deterministic["params"]] == [7, 8]
    for res in results:
        assert all(type(p["max_new_tokens"]) is int for p in res["params"])


# Bodies the double refuses; SGLang's code must refuse them too (its message named).
REFUSED_SAMPLING = {
    "unknown key": ({"max_new_tokens": 4, "bogus": 1}, "bogus"),
    "top_k 0": ({"max_new_tokens": 4, "top_k": 0}, "top_k"),
    "float max_new_tokens": ({"max_new_tokens": 4.0}, "i64"),
    "negative max_new_tokens": ({"max_new_tokens": -1}, "max_new_tokens"),
    "string n": ({"max_new_tokens": 4, "n": "2"}, "i64"),
}


def test_what_the_double_refuses_sglang_refuses(recording, tiny_ckpt, sglang_runner):
    path, cfg, tok = tiny_ckpt
    bodies = []
    for params, _ in REFUSED_SAMPLING.values():
        body = {"input_ids": encode(tok, "1+1="), "sampling_params": params, "return_logprob": True}
        with pytest.raises(_HTTPError) as refused:
            recording.handle("POST", "/generate", {}, body)
        assert refused.value.status == 400
        bodies.append(body)
    results = run_sglang(
        sglang_runner, [{"kind": "generate", "body": b} for b in bodies], tokenizer=path, vocab_size=cfg["vocab_size"]
    )
    for (name, (_, word)), res in zip(REFUSED_SAMPLING.items(), results):
        assert not res["ok"], f"SGLang accepts what the double refuses ({name})"
        assert word in res["error"], (name, res["error"])


def test_weight_update_bodies_build_sglangs_request_classes(recording, tiny_ckpt, tmp_path, sglang_runner):
    _, cfg, _ = tiny_ckpt
    make = lambda sync: SGLangEngine([recording.url], retry=FAST_RETRY, request_timeout=60.0, weight_sync=sync)  # noqa: E731
    make(WeightSyncConfig(mode="tensor", bucket_bytes=16 << 10)).update_weights(tiny_weights(cfg, seed=1), "t1")
    plain = make(WeightSyncConfig(mode="tensor", flatten=False, tp_size=2))
    plain.update_weights(tiny_weights(cfg, seed=2), "t2")
    disk = make(WeightSyncConfig(mode="disk", disk_dir=str(tmp_path / "sync"), hf_config=cfg))
    disk.update_weights(tiny_weights(cfg, seed=3), "d3")
    dist = make(WeightSyncConfig(mode="distributed", backend="gloo", bucket_bytes=16 << 10, timeout=60))
    dist.update_weights(tiny_weights(cfg, seed=4), "g4")
    dist.shutdown()
    plain.release_memory()
    plain.resume_memory()
    plain.pause(mode="retract")
    plain.resume()
    classes = {
        "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
        "/begin_weight_update": "BeginWeightUpdateReqInput",
        "/end_weight_update": "EndWeightUpdateReqInput",
        "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
        "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
    }
    checks = [{"kind": "request", "cls": classes[p], "body": b, "path": p} for p, b in recording.bodies if p in classes]
    assert {c["path"] for c in checks} == set(classes), "a weight-update route was not exercised"
    for check, res in zip(checks, run_sglang(sglang_runner, checks)):
        assert res["ok"], f"SGLang refuses our {check['path']} body {check['body']}: {res['error']}"
    # negative twins where SGLang validates: a missing required field, a wrong type, an unknown mode
    bad = [
        ("InitWeightsUpdateGroupReqInput", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}),
        ("UpdateWeightsFromDistributedReqInput", {"names": ["w"], "dtypes": ["float32"], "shapes": "2x2"}),
        ("UpdateWeightsFromTensorReqInput", {"serialized_named_tensors": ["not base64!"]}),
        ("PauseGenerationReqInput", {"mode": "freeze"}),
    ]
    for (cls, body), res in zip(
        bad, run_sglang(sglang_runner, [{"kind": "request", "cls": c, "body": b} for c, b in bad])
    ):
        assert not res["ok"], f"SGLang accepts {cls} {body}"


def test_tensor_payloads_pass_sglangs_unpickler_and_bucket(sglang_runner):
    named = [
        ("model.layers.0.mlp.down_proj.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4),
        ("model.norm.weight", torch.tensor([1.5, -2.0, 0.25])),
        ("lm_head.weight", torch.full((1, 2), 3.0)),
    ]
    half = [("model.embed_tokens.weight", torch.tensor([[0.5, 1.0], [-1.0, 2.0]], dtype=torch.bfloat16))]
    checks = [
        {"kind": "payload", "entry": tensor_payload.serialize(named), "load_format": "flattened_bucket"},
        {"kind": "payload", "entry": tensor_payload.serialize(named, None), "load_format": None},
        {"kind": "payload", "entry": tensor_payload.serialize(half), "load_format": "flattened_bucket"},
    ]
    results = run_sglang(sglang_runner, checks)
    for want, res in zip([named, named, half], results):
        assert res["ok"], res["error"]
        got = res["tensors"]
        assert [g["name"] for g in got] == [n for n, _ in want]
        for g, (_, t) in zip(got, want):
            assert g["dtype"] == str(t.dtype) and g["shape"] == list(t.shape)
            assert g["values"] == t.float().flatten().tolist()


def test_a_global_sglang_forbids_is_refused_by_both_unpicklers(sglang_runner):
    # our metadata dataclass under its own module path: SGLang's list does not name it
    import base64
    import io
    import pickle

    meta = tensor_payload.FlattenedTensorMetadata("w", torch.Size([1]), torch.float32, 0, 1, 1)
    buf = io.BytesIO()
    pickle.Pickler(buf, 2).dump({"flattened_tensor": [0.0], "metadata": [meta]})
    entry = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(pickle.UnpicklingError, match="refuses"):
        tensor_payload.deserialize(entry, "flattened_bucket")
    (res,) = run_sglang(sglang_runner, [{"kind": "payload", "entry": entry, "load_format": "flattened_bucket"}])
    assert not res["ok"] and "Blocked unsafe global" in res["error"], res["error"]


def test_our_allowlist_is_part_of_sglangs(sglang_runner):
    (res,) = run_sglang(sglang_runner, [{"kind": "allowlist"}])
    theirs = {tuple(pair) for pair in res["allowed"]}
    assert tensor_payload.SGLANG_ALLOWED_GLOBALS <= theirs, sorted(tensor_payload.SGLANG_ALLOWED_GLOBALS - theirs)
