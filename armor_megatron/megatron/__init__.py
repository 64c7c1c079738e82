"""Megatron-core actor, reference and critic.

Start-up, CPU compatibility, model builder, log-probs, train step, checkpoints.

The only subpackage that imports ``megatron.core`` (lazily, inside functions, so importing
`armor_megatron.megatron.dist` stays cheap). Modules:

* `dist`        - torchrun / SLURM start-up, model-parallel groups, teardown
* `cpu_compat`  - work-arounds that let megatron-core 0.16.1 run on CPU with gloo
* `model`       - ``GPTModel`` from a `ModelArch`; checkpoint key names
* `logprobs`    - per-token log-probs / entropy through the pipeline schedule
* `trained_model` - `ModelSettings` (how a run builds all three models) and what actor and critic share
* `actor`       - `MegatronActor`: the policy, its optimizer and the ARMOR train step
* `reference`   - `ReferenceModel`: the frozen π_ref, `reset_from(actor)`
* `critic`      - `MegatronCritic`: PPO's value model (value head on the actor's backbone)
* `optimizer`   - Megatron DDP, optimizer, LR schedule, clip-and-step
* `stability`   - `StabilityGuard`: skip non-finite or spiking steps (pure Python)
* `checkpoint`  - atomic torch_dist training checkpoints, `latest`, pruning, resharding loads
* `mcore_version` - the supported megatron-core release; importing this package refuses another minor
* `jit_fusions` - megatron's ``jit_fuser`` functions compiled at first call, only when compiling is on
  (installed when this package is imported: megatron-core then imports without dynamo and Inductor)
"""

from armor_megatron.megatron import jit_fusions as _jit_fusions
from armor_megatron.megatron import mcore_version as _mcore_version

_jit_fusions.install()

if (_installed := _mcore_version.installed_version()) is not None:
    _mcore_version.check(_installed)
