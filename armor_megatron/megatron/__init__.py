"""Megatron-core actor and reference: start-up, CPU compatibility, model builder, log-probs,
train step, checkpoints.

The only subpackage that imports ``megatron.core`` (lazily, inside functions, so importing
`armor_megatron.megatron.dist` stays cheap). Modules:

* `dist`        - torchrun / SLURM start-up, model-parallel groups, teardown
* `cpu_compat`  - work-arounds that let megatron-core 0.16.1 run on CPU with gloo
* `model`       - ``GPTModel`` from a `ModelArch`; checkpoint key names
* `logprobs`    - per-token log-probs / entropy through the pipeline schedule
* `actor`       - `MegatronActor`: the policy, its optimizer and the ARMOR train step
* `reference`   - `ReferenceModel`: the frozen π_ref, `reset_from(actor)`
* `optimizer`   - Megatron DDP, optimizer, LR schedule, clip-and-step
* `stability`   - `StabilityGuard`: skip non-finite or spiking steps (pure Python)
* `checkpoint`  - atomic torch_dist training checkpoints, `latest`, pruning, resharding loads
"""
