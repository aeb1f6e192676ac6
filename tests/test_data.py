"""Datasets in every file format, row checks, chat formatting, truncation, the group sampler."""

import json

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from tandem.data import DataError, GroupSampler, encode_prompt, load_prompt_dataset, prompt_text

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole

ROWS = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(5)]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_every_format_loads_the_same_rows(tmp_path, fmt):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    ds = Dataset.from_list(rows)
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        ds.to_json(path, lines=False)
    elif fmt == "parquet":
        ds.to_parquet(path)
    elif fmt == "csv":
        ds.to_csv(path, index=False)
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(path)
    loaded = load_prompt_dataset(str(path))
    assert loaded["prompt"] == [r["prompt"] for r in rows]
    assert [str(a) for a in loaded["answer"]] == [r["answer"] for r in rows]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "x"}], "no 'prompt' column"),
        ([{"prompt": "ok"}, {"prompt": ""}], "row 1: 'prompt' is an empty string"),
        ([{"prompt": [{"role": "user"}]}], "row 0: message 0 must be a dict with string 'role' and 'content'"),
        # a string tool_calls reached the chat template, which failed with a jinja2 error naming no row
        ([{"prompt": [{"role": "assistant", "content": "", "tool_calls": "calculator(1)"}, {"role": "user", "content": "?"}]}],
         "row 0: message 0's tool_calls must be a list of"),
        ([{"prompt": "ok"}, {"prompt": [{"role": "", "content": "x"}]}], "row 1: message 0 has role ''; chat templates know system"),
        ([{"prompt": [{"role": "narrator", "content": "x"}]}], "row 0: message 0 has role 'narrator'"),
        ([{"prompt": "ok", "tools": "calculator"}], "has a 'tools' column: tools are not read per row"),
    ],
)
def test_bad_rows_name_the_row(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(str(path))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("broken.jsonl", b'{"prompt": "1+1="}\n{"prompt": "2+2=", \n', r"broken.jsonl, line 2: not valid JSON \(Expecting property name"),
        ("twice.jsonl", b'{"prompt": "a"}\n\n{"prompt": "b", "prompt": "c"}\n', r"twice.jsonl, line 3: key 'prompt' appears twice; give each key once"),
        ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', r"latin1.jsonl, line 1: not UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8"),
        ("list.jsonl", b'["prompt", "x"]\n', r"list.jsonl, line 1: a list, not a JSON object"),
        ("empty.jsonl", b"", r"empty.jsonl is empty; it needs rows with a 'prompt'"),
        ("empty.csv", b"", r"empty.csv is empty"),
    ],
)
def test_a_broken_file_is_an_error_naming_the_line(tmp_path, name, content, message):
    # The datasets library said "Expected object or value at position 28", raised StopIteration,
    # DatasetGenerationError or UnicodeDecodeError, naming neither the line nor the fix.
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_prompt_dataset(str(path))


def test_a_folder_that_is_no_dataset_is_an_error_saying_what_loads(tmp_path):
    # A save_to_disk folder that lost its dataset_info.json: the datasets library's own
    # DatasetGenerationError said neither which folder nor what would load.
    Dataset.from_list([{"prompt": "1+1="}]).save_to_disk(tmp_path / "saved")
    (tmp_path / "saved" / "dataset_info.json").unlink()
    with pytest.raises(DataError, match=rf"dataset folder {tmp_path / 'saved'} could not be loaded .*Dataset.save_to_disk"):
        load_prompt_dataset(str(tmp_path / "saved"))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))


def test_chat_prompts_use_the_template_and_strings_do_not(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert prompt_text(tok, ROWS[0]["prompt"]) == "<|im_start|>user\n0+1=<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(tok, "plain text") == "plain text"


def test_truncation_policies(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    full = encode_prompt(tok, "abcdefgh", None, "error")
    assert len(full) == 8
    assert encode_prompt(tok, "abcdefgh", 3, "left") == full[-3:]
    assert encode_prompt(tok, "abcdefgh", 3, "skip") is None
    with pytest.raises(ValueError, match="max_prompt_length=3"):
        encode_prompt(tok, "abcdefgh", 3, "error")


def _stream(sampler, rounds):
    return [sampler.next_round()[0] for _ in range(rounds)]


def test_sampler_is_deterministic_and_covers_each_epoch():
    a, b = GroupSampler(10, 5, seed=3), GroupSampler(10, 5, seed=3)
    rounds = _stream(a, 4)
    assert rounds == _stream(b, 4)
    assert sorted(rounds[0] + rounds[1]) == list(range(10))  # epoch 0
    assert sorted(rounds[2] + rounds[3]) == list(range(10))  # epoch 1
    assert rounds[0] + rounds[1] != rounds[2] + rounds[3]  # reshuffled
    assert _stream(GroupSampler(10, 5, seed=4), 2) != rounds[:2]


def test_sampler_rounds_straddle_epochs_when_size_does_not_divide():
    s = GroupSampler(7, 3, seed=0)
    rounds = _stream(s, 7)  # 21 prompts = 3 epochs exactly
    flat = [i for r in rounds for i in r]
    for e in range(3):
        assert sorted(flat[7 * e : 7 * e + 7]) == list(range(7))
    assert all(len(r) == 3 for r in rounds)


def test_sampler_state_restores_exactly():
    s = GroupSampler(7, 3, seed=0)
    _stream(s, 2)
    state = s.state_dict()
    expected = _stream(s, 5)
    t = GroupSampler(7, 3, seed=0)
    t.load_state_dict(state)
    assert _stream(t, 5) == expected
    with pytest.raises(ValueError, match="same seed"):
        GroupSampler(7, 3, seed=1).load_state_dict(state)


def test_ranks_split_the_single_process_stream():
    single = GroupSampler(9, 4, seed=1)
    ranks = [GroupSampler(9, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        whole, slots = single.next_round()
        parts = [s.next_round() for s in ranks]
        assert parts[0][0] + parts[1][0] == whole
        assert parts[0][1] + parts[1][1] == slots == [0, 1, 2, 3]


def test_chat_template_kwargs_reach_the_template(tiny_model):
    # A Qwen3-style switch: the template opens an empty think block when enable_thinking is false.
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    assert prompt_text(tok, ROWS[0]["prompt"]) == "0+1="
    assert prompt_text(tok, ROWS[0]["prompt"], {"enable_thinking": False}) == "0+1=<think></think>"
    assert encode_prompt(tok, ROWS[0]["prompt"], None, "error", {"enable_thinking": False}) == tok("0+1=<think></think>", add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_fails_on_a_prompt_is_a_data_error(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = "{{ raise_exception('this template takes no system message') }}"
    with pytest.raises(DataError, match="the chat template could not render the prompt .*this template takes no system message"):
        prompt_text(tok, [{"role": "system", "content": "x"}])
