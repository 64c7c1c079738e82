"""The supported model families, one module each; importing this package registers them all in
`models.arch.FAMILIES`. A new family is one more module here (see `models.family.Family`) and
its import below."""

from armor_megatron.models.families import (  # noqa: F401
    deepseek,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
