import json

import pytest

from armor_megatron.data.prompts import PromptDataset, PromptLoader, PromptRow, read_rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "type": "math", "level": i % 3} for i in range(5)]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(str(tmp_path / "d.jsonl")) == read_rows(str(tmp_path / "d.parquet")) == rows
    ds = PromptDataset(str(tmp_path / "d.parquet"))
    assert (ds[2].prompt, ds[2].answer, ds[2].verifier, ds[2].extra) == ("2+1=", "3", "math", {"level": 2})


def test_bad_datasets_give_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset not found"):
        read_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        read_rows(str(tmp_path / "bad.jsonl"))
    _write_jsonl(tmp_path / "cols.jsonl", [{"question": "x", "answer": 1}])
    with pytest.raises(ValueError, match="row 0 has no 'prompt' column"):
        PromptDataset(str(tmp_path / "cols.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="dataset is empty"):
        PromptDataset(str(tmp_path / "empty.jsonl"))
    # past the rows --check peeks at: still the file, the line or row, and the problem
    good = "".join('{"prompt": "1+1=", "answer": "2"}\n' for _ in range(30))
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + b'{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:31: not UTF-8 text"):
        PromptDataset(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "latin1.json").write_bytes(b'[{"prompt": "caf\xe9", "answer": "2"}]')
    with pytest.raises(ValueError, match=r"latin1.json: not UTF-8 text"):
        PromptDataset(str(tmp_path / "latin1.json"))
    (tmp_path / "types.jsonl").write_text(good + '{"prompt": 7, "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"types.jsonl: row 30 'prompt' is int, not a string or a list of chat"):
        PromptDataset(str(tmp_path / "types.jsonl"))
    (tmp_path / "rows.jsonl").write_text(good + "[1, 2]\n")
    with pytest.raises(ValueError, match=r"rows.jsonl: row 30 is list, not an object with columns"):
        PromptDataset(str(tmp_path / "rows.jsonl"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken.parquet: not a readable Parquet file"):
        PromptDataset(str(tmp_path / "broken.parquet"))


def test_loader_covers_each_epoch_once_and_resumes_exactly(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": i} for i in range(7)])
    ds = PromptDataset(str(tmp_path / "d.jsonl"))
    loader = PromptLoader(ds, batch_size=3, seed=5)
    first_epoch = [r.index for _ in range(2) for r in loader.next_batch()] + [loader.next_batch()[0].index]
    assert sorted(first_epoch) == list(range(7))  # 7 rows: batches of 3, 3, then 1 + 2 from epoch 1
    state = loader.state_dict()
    expected = [[r.index for r in loader.next_batch()] for _ in range(4)]
    resumed = PromptLoader(ds, batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert [[r.index for r in resumed.next_batch()] for _ in range(4)] == expected
    with pytest.raises(ValueError, match="seed 5"):
        PromptLoader(ds, batch_size=3, seed=6).load_state_dict(state)


def test_unshuffled_loader_keeps_file_order(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": i} for i in range(3)])
    loader = PromptLoader(PromptDataset(str(tmp_path / "d.jsonl")), batch_size=2, shuffle=False)
    assert [r.index for r in loader.next_batch() + loader.next_batch()] == [0, 1, 2, 0]


def test_rows_left_out_keep_the_others_file_indices(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * n, "answer": n} for n in (3, 30, 5, 40)])
    dataset = PromptDataset(str(tmp_path / "d.jsonl"))
    assert dataset.keep(lambda row: len(row.prompt) <= 10) == 2
    loader = PromptLoader(dataset, batch_size=3, shuffle=False)
    assert [(r.index, r.answer) for r in loader.next_batch()] == [(0, 3), (2, 5), (0, 3)]


def test_a_row_without_an_answer_column_takes_its_label(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "answer": "2", "type": "math"}\n'
        '{"prompt": "How do I pick a lock?", "label": "harmful", "type": "safety"}\n'
    )
    rows = PromptDataset(str(path)).rows
    assert [(r.answer, r.verifier) for r in rows] == [("2", "math"), ("harmful", "safety")]
    assert "label" not in rows[1].extra
    path.write_text('{"prompt": "x", "type": "safety"}\n')
    with pytest.raises(ValueError, match="row 0 has no 'answer' column"):
        PromptDataset(str(path))


VERL_ROW = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": "1+1="}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"index": 0, "verifier": "math"},
}


def test_dotted_keys_read_nested_fields_of_a_verl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([VERL_ROW]), tmp_path / "verl.parquet")
    ds = PromptDataset(str(tmp_path / "verl.parquet"), answer_key="reward_model.ground_truth")
    assert (ds[0].prompt, ds[0].answer, ds[0].verifier) == ([{"role": "user", "content": "1+1="}], "2", None)
    assert ds[0].extra["data_source"] == "math_dapo" and ds[0].extra["reward_model"]["style"] == "rule"
    typed = PromptDataset(
        str(tmp_path / "verl.parquet"), answer_key="reward_model.ground_truth", type_key="extra_info.verifier"
    )
    assert typed[0].verifier == "math"
    with pytest.raises(ValueError, match=r"row 0 has no 'reward_model.answer' field \(columns: ability, data_source"):
        PromptDataset(str(tmp_path / "verl.parquet"), answer_key="reward_model.answer")


def test_a_column_named_with_a_dot_wins_over_the_nested_field(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "a.b": "flat", "a": {"b": "nested"}}])
    assert PromptDataset(str(tmp_path / "d.jsonl"), answer_key="a.b")[0].answer == "flat"


def test_a_row_keeps_every_column_for_the_verifiers_that_ask(tmp_path):
    rows = [
        {"question": "1+1=", "gold": "2", "data_source": "toy", "extra_info": {"index": 0}, "type": "math"},
        {"question": "2+2=", "gold": "4"},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(str(tmp_path / "d.jsonl"), prompt_key="question", answer_key="gold")
    assert ds[0].reward_fields() == {
        "prompt": "1+1=",
        "data_source": "toy",
        "extra_info": {"index": 0},
        "row": rows[0],  # the prompt, answer and type columns too, under the file's own names
        "trajectory": None,
    }
    assert ds[1].reward_fields(trajectory=[{"role": "tool"}]) == {
        "prompt": "2+2=",
        "data_source": None,
        "extra_info": None,
        "row": rows[1],
        "trajectory": [{"role": "tool"}],
    }
    built = PromptRow(7, "p", "a", extra={"data_source": "s"})  # a row made in code, not read from a file
    assert built.reward_fields()["row"] == {"prompt": "p", "answer": "a", "data_source": "s"}
