"""Megatron-core actor and reference: start-up, CPU compatibility, model builder, log-probs.

The only subpackage that imports ``megatron.core`` (lazily, inside functions, so importing
`armor_megatron.megatron.dist` stays cheap). Modules:

* `dist`        - torchrun / SLURM start-up, model-parallel groups, teardown
* `cpu_compat`  - work-arounds that let megatron-core 0.16.1 run on CPU with gloo
* `model`       - ``GPTModel`` from a `ModelArch`; checkpoint key names
* `logprobs`    - per-token log-probs / entropy through the pipeline schedule
"""
