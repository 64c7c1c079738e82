"""The lookup task of the multi-turn example: its environment, rows, warm-up corpus and tool-use metrics."""

from armor_megatron.tasks.tool_lookup import LookupTable, build_tokenizer, split_problems, tool_use, transcript


def test_the_table_answers_calls_and_ends_at_an_answer():
    env = LookupTable({"prompt": "k7?", "answer": "5", "key": "7", "index": 0})
    assert env.step("#7") == "=5 " and env.step("#3") == "=? " and env.step("\\boxed{5}") is None


def test_rows_and_the_warm_up_corpus():
    train, val, warmup = split_problems(8, seed=0, num_train=32, num_warmup=200, tool_share=0.5)
    assert (len(train), len(val), len(warmup)) == (32, 8, 200)
    for r in train + val:
        assert r["prompt"] == f"k{r['key']}?" and r["answer"] in set("0123456789") and r["type"] == "math"
    same_key = [r["answer"] for r in warmup if r["key"] == "7"]
    assert len(set(same_key)) > 5  # the value is drawn per row: the key does not give it away
    calls = [r for r in warmup if r["response"].startswith("#")]
    assert 60 < len(calls) < 140  # about half call the tool
    for r in warmup:  # a call's transcript answers right, a guess wrong
        assert r["response"].endswith(f"\\boxed{{{r['answer']}}}") == (r in calls)
    # the warm-up transcript is the token sequence a multi-turn rollout builds: call, result, answer
    tok = build_tokenizer()
    r = calls[0]
    ids = tok.encode(transcript(r), add_special_tokens=False)
    call = tok.encode(f"#{r['key']}>", add_special_tokens=False)
    result = tok.encode(LookupTable(r).step(f"#{r['key']}"), add_special_tokens=False)
    assert ids[: len(call) + len(result)] == call + result and tok.unk_token_id not in ids


def test_tool_use_counts_calls_per_response():
    def sample(prompt, *turns):
        return {"prompt": prompt, "trajectory": [{"response": t} for t in turns]}

    metrics = tool_use(
        [sample("k7?", "#7", "\\boxed{58}"), sample("k7?", "#3", "#7", "x"), sample("k2?", "\\boxed{11}")]
    )
    assert metrics == {"tool_calls": 1.0, "tool_correct_share": 2 / 3, "tool_direct_share": 1 / 3}
