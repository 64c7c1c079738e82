"""Runs request bodies through SGLang 0.5.23's own code, in the interpreter of tools/sglang_cpu_env.py.

Reads jobs from stdin, one JSON object a line, ``{"checks": [{"kind": ..., ...}, ...],
"tokenizer": DIR, "vocab_size": V}``, and answers each with one line on stdout,
``[{"ok": bool, "error": str | None, ...}, ...]``, one entry per check (SGLang imports once). Each kind does what the server does with a body on that route (file and function named):

* ``generate``: ``api_contract.generate_contract_error`` (the schema gate of ``/generate``),
  FastAPI's parse of ``GenerateReqInput`` (pydantic), ``normalize_batch_and_arguments``, then per
  request ``SamplingParams(**params)``, ``.normalize(tokenizer)``, ``.verify(vocab_size)``
  (``TokenizerManager._create_tokenized_object``), with SGLang's own ``get_tokenizer``;
* ``request``: FastAPI's parse of a body into the named ``io_struct`` request class;
* ``payload``: ``MultiprocessingSerializer.deserialize`` (``SafeUnpickler``) of one
  ``serialized_named_tensors`` entry, after ``monkey_patch_torch_reductions`` as a TP worker
  does, then ``FlattenedTensorBucket.reconstruct_tensors`` for ``flattened_bucket``
  (``WeightUpdater._update_weights_from_flattened_bucket``); the tensors come back as lists;
* ``allowlist``: ``SafeUnpickler.ALLOWED_GLOBALS``.

It imports nothing from armor_megatron: it runs where only SGLang is installed.
"""

import json
import multiprocessing
import os
import sys
import traceback

import torch

# torchvision's index wheels are CUDA builds; their operators are missing on a CPU torch, and its
# import registers fake kernels for these two regardless (tools/sglang_cpu_env.py says more).
_TORCHVISION = torch.library.Library("torchvision", "DEF")
for _schema in (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
):
    _TORCHVISION.define(_schema)

from pydantic import TypeAdapter  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.utils.common import MultiprocessingSerializer, SafeUnpickler  # noqa: E402
from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer  # noqa: E402
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: E402
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata  # noqa: E402


def parse(cls, body):
    """FastAPI's validation of a JSON body into ``cls`` (pydantic, as its ModelField does)."""
    return TypeAdapter(cls).validate_python(body, from_attributes=True)


def check_generate(body, tokenizer, vocab_size):
    error = generate_contract_error(body)
    if error is not None:
        raise ValueError(f"contract: {error}")
    obj = parse(io_struct.GenerateReqInput, body)
    obj.normalize_batch_and_arguments()
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    normalized = []
    for p in params:
        sp = SamplingParams(**p)
        sp.normalize(tokenizer)
        sp.verify(vocab_size)
        normalized.append(
            {k: getattr(sp, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "n", "ignore_eos")}
            | {"stop_strs": list(sp.stop_strs), "stop_token_ids": sorted(sp.stop_token_ids or ())}
            | {"sampling_seed": sp.sampling_seed}
        )
    return {"batch_size": obj.batch_size, "parallel_sample_num": obj.parallel_sample_num, "params": normalized}


def check_payload(entry, load_format):
    monkey_patch_torch_reductions()
    obj = MultiprocessingSerializer.deserialize(entry)
    if load_format == "flattened_bucket":
        metadata = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
            )
            for m in obj["metadata"]
        ]
        named = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata).reconstruct_tensors()
    else:
        named = list(obj)
    return {
        "tensors": [
            {"name": n, "dtype": str(t.dtype), "shape": list(t.shape), "values": t.float().flatten().tolist()}
            for n, t in named
        ]
    }


def run(check, tokenizer, vocab_size):
    kind = check["kind"]
    if kind == "generate":
        return check_generate(check["body"], tokenizer, vocab_size)
    if kind == "request":
        parse(getattr(io_struct, check["cls"]), check["body"])
        return {}
    if kind == "payload":
        return check_payload(check["entry"], check["load_format"])
    if kind == "allowlist":
        return {"allowed": sorted(SafeUnpickler.ALLOWED_GLOBALS)}
    raise ValueError(f"unknown check kind {kind!r}")


def answer(job, tokenizers):
    path = job.get("tokenizer")
    if path and path not in tokenizers:
        tokenizers[path] = get_tokenizer(path)
    tokenizer = tokenizers.get(path)
    results = []
    for check in job["checks"]:
        try:
            results.append({"ok": True, "error": None, **run(check, tokenizer, job.get("vocab_size") or 1 << 20)})
        except Exception as e:  # noqa: BLE001 - every refusal is reported, as the server reports it
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
    return results


def main():
    authkey = os.environ.get("ARMOR_MP_AUTHKEY")
    if authkey:  # CPU tensor handles are file descriptors served to the sender's authkey
        multiprocessing.current_process().authkey = bytes.fromhex(authkey)
    tokenizers = {}
    for line in sys.stdin:
        sys.stdout.write(json.dumps(answer(json.loads(line), tokenizers)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
