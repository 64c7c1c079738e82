"""Prompt datasets (JSONL or Parquet) and a resumable, seeded prompt loader.

A row is ``{prompt_key: str | chat messages, answer_key: Any, type_key: optional verifier name}``;
a key with dots names a nested field (``reward_model.ground_truth`` reads
``row["reward_model"]["ground_truth"]``, as verl's parquet files hold it) unless the row has a
column of that exact name. A row without the answer column may carry its ground truth in
``label`` instead (safety rows: ``harmful`` / ``benign``; slime's JSONL files), so one
mixed-domain file needs no placeholder answers. Extra columns are kept in ``PromptRow.extra``. The loader walks a seeded permutation per epoch
and its ``state_dict()`` (epoch, position) is saved in checkpoints so a resumed run sees
exactly the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from armor_megatron.errors import DatasetError, MissingInputError, UserInputError

LABEL_KEY = "label"  # the ground truth of rows that have no answer column (safety rows)


def field_of(row: dict[str, Any], key: str) -> Any:
    """A row's field ``key``, dotted keys reading nested fields.

    ``row[key]``, or for a dotted ``key`` without a column of that exact name the nested field
    (``"reward_model.ground_truth"`` -> ``row["reward_model"]["ground_truth"]``); KeyError(key)
    when absent.
    """
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def has_field(row: dict[str, Any], key: str) -> bool:
    """Whether :func:`field_of` finds ``key`` in ``row``."""
    try:
        field_of(row, key)
    except KeyError:
        return False
    return True


def field_kind(key: str) -> str:
    """How an error names ``key``: a nested "field" (dotted) or a "column"."""
    return "field" if "." in key else "column"


def ground_truth_column(row: dict[str, Any], answer_key: str) -> str | None:
    """The field holding a row's ground truth: ``answer_key`` (dotted: nested), else ``label``, else None."""
    if has_field(row, answer_key):
        return answer_key
    return LABEL_KEY if LABEL_KEY in row else None


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One dataset row: its index in the file, prompt, ground truth, verifier and other columns.

    ``columns``: the whole row as the file holds it (every column, nested fields as they are).
    """

    index: int
    prompt: Any
    answer: Any
    verifier: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    columns: dict[str, Any] = dataclasses.field(default_factory=dict)

    def reward_fields(self, trajectory: Any = None) -> dict[str, Any]:
        """The fields a verifier may name besides response and ground truth (docs/rewards.md).

        ``prompt``; ``data_source`` and ``extra_info``, the columns of these names (verl's) or None;
        ``row``, the whole row; ``trajectory``, a multi-turn response's turns (None: single-turn).
        """
        row = self.columns or {"prompt": self.prompt, "answer": self.answer, **self.extra}  # a row built in code
        return {
            "prompt": self.prompt,
            "data_source": row.get("data_source"),
            "extra_info": row.get("extra_info"),
            "row": row,
            "trajectory": trajectory,
        }


def prompt_row(index: int, row: dict[str, Any], prompt_key: str, truth_column: str, type_key: str) -> PromptRow:
    """Row ``index`` of a file as a `PromptRow`: its prompt, the ground truth of ``truth_column``, its verifier, the rest.

    ``truth_column``: the column `ground_truth_column` found for the answer key; the other columns
    (all but prompt, ground truth and type) are ``extra``.
    """
    verifier = field_of(row, type_key) if has_field(row, type_key) else None
    extra = {k: v for k, v in row.items() if k not in (prompt_key, truth_column, type_key)}
    return PromptRow(index, field_of(row, prompt_key), field_of(row, truth_column), verifier, extra, row)


def row_mapping(row: PromptRow) -> dict[str, Any]:
    """What an environment is built from (``rollout.environment``): a row's other columns, ``prompt``, ``answer``, ``index``."""
    return {**row.extra, "prompt": row.prompt, "answer": row.answer, "index": row.index}


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a ``.jsonl``/``.json`` or ``.parquet`` file as dicts; one-line errors on bad input."""
    return _rows(path, None)


def peek_rows(path: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of a dataset file, read without loading the rest (``.json``: the whole list is parsed).

    The same one-line errors as :func:`read_rows`.
    """
    return _rows(path, n)


def _rows(path: str, limit: int | None) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise MissingInputError(f"dataset not found: {path}")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow is a core dependency
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
        try:
            if limit is None:
                table_rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
                return table_rows
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
        except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError on a damaged file
            raise DatasetError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
        batch_rows: list[dict[str, Any]] = [] if batch is None else batch.to_pylist()
        return batch_rows
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except UnicodeDecodeError:
            raise DatasetError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
        return rows if limit is None else rows[:limit]
    rows = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if len(rows) == limit:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line.decode("utf-8")))
            except UnicodeDecodeError:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text") from None
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    return rows


class PromptDataset:
    """Rows of one dataset file, with the prompt / answer / type columns picked by name."""

    def __init__(self, path: str, prompt_key: str = "prompt", answer_key: str = "answer", type_key: str = "type"):
        rows = read_rows(path)
        if not rows:
            raise DatasetError(f"{path}: dataset is empty")
        self.path = path
        self.rows: list[PromptRow] = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: row {i} is {type(row).__name__}, not an object with columns")
            truth = ground_truth_column(row, answer_key)
            for key, present in ((prompt_key, has_field(row, prompt_key)), (answer_key, truth is not None)):
                if not present:
                    raise DatasetError(
                        f"{path}: row {i} has no {key!r} {field_kind(key)} (columns: {', '.join(sorted(row))})"
                    )
            assert truth is not None  # a row without one raised above
            prompt = field_of(row, prompt_key)
            if not isinstance(prompt, (str, list)):
                raise DatasetError(
                    f"{path}: row {i} {prompt_key!r} is {type(prompt).__name__}, not a string or a list of chat messages"
                )
            self.rows.append(prompt_row(i, row, prompt_key, truth, type_key))

    def keep(self, predicate: Callable[[PromptRow], bool]) -> int:
        """Keep the rows ``predicate(row)`` accepts (their ``index`` stays the file's row number).

        Returns how many were left out.
        """
        before = len(self.rows)
        self.rows = [row for row in self.rows if predicate(row)]
        return before - len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


class PromptLoader:
    """Endless batches of ``batch_size`` rows: a fresh seeded permutation per epoch, resumable."""

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=gen).tolist()

    def next_batch(self) -> list[PromptRow]:
        """The next ``batch_size`` rows, crossing into the next epoch when this one runs out."""
        out: list[PromptRow] = []
        while len(out) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.position : self.position + self.batch_size - len(out)]
            out.extend(self.dataset[i] for i in take)
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[list[PromptRow]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The loader's position (epoch, position, seed), for checkpoints."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position :meth:`state_dict` saved; a different seed raises."""
        if state.get("seed", self.seed) != self.seed:
            raise UserInputError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def encode_prompt(
    tokenizer: Any, prompt: Any, *, apply_chat_template: bool = True, template: str | None = None
) -> list[int]:
    """Token ids of one prompt.

    A list of chat messages, or a string when ``apply_chat_template`` is set and the tokenizer
    has a chat template, goes through ``apply_chat_template(add_generation_prompt=True)``;
    otherwise the string (``template.format(prompt=...)`` when given) is tokenized as is.
    """
    if isinstance(prompt, str) and template:
        prompt = template.format(prompt=prompt)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list) or (apply_chat_template and has_chat):
        if not has_chat:
            raise DatasetError("prompt is a list of chat messages but the tokenizer has no chat template")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if not isinstance(prompt, str):
        raise DatasetError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    return list(tokenizer(prompt)["input_ids"])
