"""Checks of what a run config names on this machine.

Paths, the first rows of each dataset (a user verifier called on them), ``rollout.environment``
built from the first training rows and stepped once (`config.environment_probe`), optional
packages it turns on, what its settings need (`config.needs`), and the run that owns its
checkpoint directory.

``armor-train --check`` runs them after the config's own checks (``validate``); a run started
on a machine without the files (a laptop preparing a cluster recipe) skips them with
``--check --no-files``. Each problem is one ConfigError naming the key (and the file).
"""

from __future__ import annotations

import importlib.util
import os

from armor_megatron.config import needs
from armor_megatron.config.environment_probe import probe_environment
from armor_megatron.config.identity import check_run_identity, checkpoint_dir
from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError
from armor_megatron.data.prompts import (
    PromptRow,
    field_kind,
    field_of,
    ground_truth_column,
    has_field,
    peek_rows,
    prompt_row,
    read_rows,
)

PEEK_ROWS = 8  # rows of each dataset parsed at check time
ENVIRONMENT_PROBE_ROWS = 2  # of them, the training rows rollout.environment is built from and stepped once
RESUME_WORDS = ("auto", "none", "force")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what a run without mcore_path loads
# a fast tokenizer's file, or a slow one's vocabulary (SentencePiece, BPE, WordPiece): AutoTokenizer needs one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
LATEST = "latest"  # the file in a run's checkpoint directory naming its newest checkpoint (megatron.model_state)


def check_files(cfg: RunConfig) -> list[str]:
    """Check the files and datasets ``cfg`` names, the packages it needs and its run identity.

    Raises a ConfigError for the first problem; returns the warnings, one line each: what runs but
    looks wrong (a response stating a row's ground truth scores no more than one stating none).
    """
    _check_model(cfg)
    data = cfg.data
    rows, warnings = _check_dataset(
        "data.train_path",
        data.train_path,
        cfg,
        (data.prompt_key, "data.prompt_key"),
        (data.answer_key, "data.answer_key"),
    )
    warnings += probe_environment(cfg, rows[:ENVIRONMENT_PROBE_ROWS])
    for i, ds in enumerate(cfg.eval.datasets):
        own = f"eval.datasets[{i}]"
        prompt = (
            (ds.prompt_key, f"{own}.prompt_key")
            if ds.prompt_key
            else (data.prompt_key, f"data.prompt_key or {own}.prompt_key")
        )
        answer = (
            (ds.answer_key, f"{own}.answer_key")
            if ds.answer_key
            else (data.answer_key, f"data.answer_key or {own}.answer_key")
        )
        warnings += _check_dataset(f"{own}.path", ds.path, cfg, prompt, answer)[1]
    resume = cfg.checkpoint.resume
    if resume not in RESUME_WORDS:
        _check_resume_path(resume)
    if cfg.reference.init_from and not os.path.isdir(cfg.reference.init_from):
        raise ConfigError("reference.init_from", f"{cfg.reference.init_from}: no such checkpoint directory")
    for key, path in (("checkpoint.dir", checkpoint_dir(cfg)), ("logging.dir", cfg.logging.dir)):
        _check_writable_dir(key, path)
    _check_packages(cfg)
    needs.check(cfg)
    check_run_identity(cfg, resume)
    return warnings


def _check_writable_dir(key: str, path: str) -> None:
    """``path`` is a directory this process can write, or can be created.

    Its nearest existing ancestor is a writable directory (not a file).
    """
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(key, f"{path}: {probe} is a file, so the directory cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is" if probe == os.path.abspath(path) else f"would be created in {probe}, which is"
        raise ConfigError(key, f"{path}: {what} not writable by this user")


def _check_resume_path(path: str) -> None:
    """``checkpoint.resume`` names a torch_dist checkpoint or a checkpoint root whose ``latest`` names one."""
    if not os.path.isdir(path):
        raise ConfigError("checkpoint.resume", f"{path}: no such checkpoint directory (or use auto | none | force)")
    if os.path.isfile(os.path.join(path, LATEST)) or os.path.isfile(os.path.join(path, "metadata.json")):
        return
    raise ConfigError(
        "checkpoint.resume",
        f"{path}: not a checkpoint (no metadata.json) nor a checkpoint directory of a run (no `{LATEST}` file); "
        "name a step's directory such as <checkpoint.dir>/iter_0000100, or use auto | none | force",
    )


def _check_model(cfg: RunConfig) -> None:
    path = cfg.model.path
    if not os.path.isdir(path):
        raise ConfigError("model.path", f"{path}: no such directory (a Hugging Face model directory)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError("model.path", f"{path}: no config.json (not a Hugging Face model directory)")
    # its contents were read and checked with the config (validate.hf_config_of)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(
            "model.path",
            f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy them from the model's "
            "Hugging Face repository (transformers would build an empty tokenizer from this directory)",
        )
    mcore = cfg.model.mcore_path
    if not mcore and not any(os.path.isfile(os.path.join(path, f)) for f in SAFETENSORS_WEIGHTS):
        raise ConfigError(
            "model.path",
            f"{path}: no safetensors weights ({' or '.join(SAFETENSORS_WEIGHTS)}) to start from; "
            "set model.mcore_path to start from a torch_dist checkpoint instead",
        )
    if mcore and not os.path.isdir(mcore):
        raise ConfigError(
            "model.mcore_path",
            f"{mcore}: no such directory (convert first: armor-convert hf-to-mcore {path} {mcore}, or unset it)",
        )


def _check_dataset(
    key: str, path: str, cfg: RunConfig, prompt: tuple[str, str], answer: tuple[str, str]
) -> tuple[list[PromptRow], list[str]]:
    """Check one dataset file's first rows against the config; those rows, and the warnings.

    The file exists, its first rows parse and carry the prompt/answer columns (``prompt`` and
    ``answer``: the field and the setting that names it), a row's
    ``type`` column names a verifier that loads, that verifier can score the row's ground truth,
    and a user verifier called on it returns a reward (``probe_verifier``). The remote judge's
    failures name ``reward.remote``. A warning when the response stating a row's ground truth
    scores no more than the one stating no answer (a wrong answer column, most often).
    """
    from armor_megatron.rewards.registry import (
        NO_ANSWER,
        check_ground_truth,
        load_verifier,
        probe_verifier,
        stating_response,
    )
    from armor_megatron.rewards.remote import NAME as REMOTE_JUDGE

    data = cfg.data
    checked: list[PromptRow] = []
    unrewarded: list[tuple[PromptRow, str, float]] = []  # rows whose stated ground truth scored no more than none
    try:
        rows = peek_rows(path, PEEK_ROWS)
    except FileNotFoundError:
        raise ConfigError(key, f"{path}: no such file") from None
    except (OSError, ValueError) as err:
        raise ConfigError(key, str(err).splitlines()[0]) from None
    if not rows:
        raise ConfigError(key, f"{path}: dataset is empty")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(key, f"{path}: row {i} is {type(row).__name__}, not an object with columns")
        truth = ground_truth_column(row, answer[0])
        for (column, setting), present in ((prompt, has_field(row, prompt[0])), (answer, truth is not None)):
            if not present:
                raise ConfigError(
                    key,
                    f"{path}: row {i} has no {column!r} {field_kind(column)} ({setting}; columns: {', '.join(sorted(row))})",
                )
        assert truth is not None  # a row without one raised above
        verifier = field_of(row, data.type_key) if has_field(row, data.type_key) else None
        if verifier is not None:
            _check_row_type(key, path, i, verifier, cfg)
            try:
                load_verifier(verifier)
            except ValueError as err:
                raise ConfigError(key, f"{path}: row {i} {data.type_key}: {str(err).splitlines()[0]}") from None
        spec, parsed = verifier or cfg.reward.verifier, prompt_row(i, row, prompt[0], truth, data.type_key)
        fields = parsed.reward_fields()
        try:
            check_ground_truth(spec, parsed.answer)
            stated = probe_verifier(spec, parsed.answer, fields=fields)  # with the row's real fields
            # early responses state none: a reward too, which a stated ground truth should beat
            unanswered = probe_verifier(spec, parsed.answer, NO_ANSWER, fields)
        except ValueError as err:
            if spec == REMOTE_JUDGE:  # the judge, its address or its key: reward.remote's to fix
                raise ConfigError("reward.remote", f"{err} ({path} row {i})") from None
            raise ConfigError(key, f"{path}: row {i}: {err}") from None
        if stated is not None and unanswered is not None and stated <= unanswered and stating_response(parsed.answer):
            unrewarded.append((parsed, spec, stated))
        checked.append(parsed)
    if len(rows) == PEEK_ROWS:  # the rest of the file: every row's type, before any step
        for i, row in enumerate(read_rows(path)[PEEK_ROWS:], PEEK_ROWS):
            if isinstance(row, dict) and has_field(row, data.type_key):
                _check_row_type(key, path, i, field_of(row, data.type_key), cfg)
    return checked, [_unrewarded_warning(key, path, answer, unrewarded, len(rows))] if unrewarded else []


def _unrewarded_warning(
    key: str, path: str, answer: tuple[str, str], unrewarded: list[tuple[PromptRow, str, float]], peeked: int
) -> str:
    """The warning of rows whose ground truth, stated in a response, scored no more than no answer."""
    row, spec, score = unrewarded[0]
    return (
        f"{key}: {path}: a response stating the ground truth scored no more than one stating no answer on "
        f"{len(unrewarded)} of the first {peeked} rows (row {row.index}: {score:g} for ground truth "
        f"{row.answer!r:.60}, verifier {spec!r}); is {answer[0]!r} ({answer[1]}) the answer column? The probe "
        "states it as \\boxed{...}, '#### ...' and 'Answer: ...'"
    )


def _check_row_type(key: str, path: str, index: int, verifier: object, cfg: RunConfig) -> None:
    """A row's ``type`` names a registered verifier, ``reward.verifier`` or one of ``reward.verifiers``."""
    from armor_megatron.rewards.registry import check_row_verifier

    try:
        check_row_verifier(verifier, cfg.reward.verifier, cfg.reward.verifiers)
    except ValueError as err:
        raise ConfigError(key, f"{path}: row {index} {cfg.data.type_key}: {err}") from None


def _check_packages(cfg: RunConfig) -> None:
    lg = cfg.logging
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "logging.tensorboard", "true, but the tensorboard package is not installed (pip install tensorboard)"
        )
    if lg.wandb.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.project", "set, but the wandb package is not installed (pip install wandb)")
