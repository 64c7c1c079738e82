import json

from armor_megatron.tasks.arithmetic import BOXED, build_tokenizer, make_problems, solution, write_jsonl


def test_tokenizer_round_trips_and_keeps_boxed_as_one_token(tmp_path):
    tok = build_tokenizer()
    ids = tok.encode("17+25=" + BOXED + "42}", add_special_tokens=False)
    # 6 prompt characters, then "\boxed{" as one token, then "4", "2", "}"
    assert len(ids) == 10 and ids[6] == tok.convert_tokens_to_ids(BOXED)
    assert tok.decode(ids) == "17+25=\\boxed{42}"
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("3+4=", add_special_tokens=False) == tok.encode("3+4=", add_special_tokens=False)


def test_problems_are_seeded_and_correct(tmp_path):
    rows = make_problems(50, seed=3)
    assert rows == make_problems(50, seed=3) and rows != make_problems(50, seed=4)
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["answer"]) == int(a) + int(b)
    assert solution(rows[0]) == "\\boxed{" + rows[0]["answer"] + "}"
    write_jsonl(str(tmp_path / "x" / "train.jsonl"), rows)
    assert [json.loads(line) for line in (tmp_path / "x" / "train.jsonl").read_text().splitlines()] == rows
