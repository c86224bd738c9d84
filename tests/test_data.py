"""Prompt / preference datasets, the arithmetic task and the resumable iterator.

The tokenizer is a tiny WordLevel one trained here on a few strings, with a simple chat template,
so nothing is downloaded; one test also runs with the default model's tokenizer when its cached
folder exists.
"""

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.data import (
    BatchIterator,
    DataError,
    DataPosition,
    PreferenceDataset,
    PromptDataset,
    arithmetic_preference_pairs,
    arithmetic_task,
    bucket_length,
    check_tokenizer_vocab,
    epoch_order,
    load_table,
    num_arithmetic_problems,
    sequential_batches,
    split_implicit_prompt,
    take_indices,
)
from jaxrl_llm.rewards import IntegerAnswer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["[PAD]", "[UNK]", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "What is 1 + 2 ? Answer with just the number .",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "yes no good bad Be brief 0 1 2 3 4 5 6 7 8 9",
]


def make_tokenizer(chat_template=CHAT_TEMPLATE):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="<eos>"
    )
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def words(n):
    """A prompt of ``n`` word tokens (the template adds 3: <|user|> ... <eos> <|assistant|>)."""
    return " ".join(["a"] * n)


ROWS = [{"prompt": words(n), "answer": str(n), "level": n % 3} for n in (1, 5, 12, 3, 30, 7)]


def write(path: Path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        keys = list(rows[0])
        path.write_text(
            ",".join(keys) + "\n" + "".join(",".join(str(r[k]) for k in keys) + "\n" for r in rows)
        )
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# --- prompt datasets -----------------------------------------------------------------------


def test_prompts_are_chat_templated_and_tokenised(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer, max_prompt_length=64)
    assert len(ds) == 6 and ds.num_dropped == 0
    expected = ids(tokenizer, "<|user|> a a a a a <eos> <|assistant|>")
    np.testing.assert_array_equal(ds.prompt_ids[1], expected)
    assert ds.prompt_ids[1].dtype == np.int32
    assert ds.prompts[1] == words(5)
    assert ds.fields == {
        "raw_prompt": [r["prompt"] for r in ROWS],  # as the data gives it, for TRL's rewards
        "answer": [r["answer"] for r in ROWS],
        "level": [r["level"] for r in ROWS],
    }


def test_system_prompt_fields_and_prompt_field(tokenizer):
    rows = [{"question": "What is 1 + 2 ?", "answer": "3", "junk": 1}]
    ds = PromptDataset.from_records(
        rows, tokenizer, prompt_field="question", system_prompt="Be brief", fields=["answer"]
    )
    text = "<|system|> Be brief <eos> <|user|> What is 1 + 2 ? <eos> <|assistant|>"
    np.testing.assert_array_equal(ds.prompt_ids[0], ids(tokenizer, text))
    assert ds.fields == {"raw_prompt": ["What is 1 + 2 ?"], "answer": ["3"]}
    assert ds.prompts == ["What is 1 + 2 ?"]


def test_chat_message_prompts(tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "no"}, {"role": "user", "content": "yes"}]}]
    ds = PromptDataset.from_records(rows, tokenizer, system_prompt="Be brief")
    text = "<|system|> no <eos> <|user|> yes <eos> <|assistant|>"  # its own system message wins
    np.testing.assert_array_equal(ds.prompt_ids[0], ids(tokenizer, text))
    assert ds.prompts == ["yes"]


def test_plain_text_without_chat_template():
    tok = make_tokenizer(chat_template=None)
    ds = PromptDataset.from_records(
        [{"prompt": "yes no"}], tok, chat_template=False, system_prompt="Be brief"
    )
    np.testing.assert_array_equal(ds.prompt_ids[0], ids(tok, "Be brief yes no"))
    with pytest.raises(DataError, match="no chat template; set chat_template=False"):
        PromptDataset.from_records([{"prompt": "yes"}], tok)


def test_over_long_prompts_are_dropped_and_counted(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer, max_prompt_length=10)  # 7+3 fits, 12+3 not
    assert len(ds) == 4 and ds.num_dropped == 2
    np.testing.assert_array_equal(ds.source_rows, [0, 1, 3, 5])
    assert ds.fields["answer"] == ["1", "5", "3", "7"]
    with pytest.raises(DataError, match="all 6 prompts are longer than the limit of 3 tokens"):
        PromptDataset.from_records(ROWS, tokenizer, max_prompt_length=3)


def test_batches_are_left_padded_to_buckets(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer, max_prompt_length=40)  # lengths 4 8 15 6 33 10
    batch = ds.batch([0, 2], pad_multiple=8)  # 4 and 15 tokens -> T = 16
    assert batch.prompt_ids_bt.shape == (2, 16) and batch.prompt_ids_bt.dtype == np.int32
    assert batch.prompt_mask_bt.dtype == np.bool_
    np.testing.assert_array_equal(batch.prompt_mask_bt.sum(1), [4, 15])
    assert batch.prompt_mask_bt[:, -1].all() and not batch.prompt_mask_bt[:, 0].any()
    np.testing.assert_array_equal(batch.prompt_ids_bt[0, -4:], ds.prompt_ids[0])
    assert (batch.prompt_ids_bt[~batch.prompt_mask_bt] == tokenizer.pad_token_id).all()
    assert batch.fields["answer"] == ["1", "12"] and batch.prompts == [words(1), words(12)]
    np.testing.assert_array_equal(batch.indices, [0, 2])
    assert ds.batch([0, 1], pad_multiple=8).prompt_ids_bt.shape == (2, 8)
    assert ds.batch([4], pad_multiple=8).prompt_ids_bt.shape == (1, 40)
    assert ds.batch([0], pad_multiple=16, fixed_length=True).prompt_ids_bt.shape == (1, 48)


@pytest.mark.parametrize(
    ("longest", "multiple", "expected"),
    [(1, 16, 16), (16, 16, 16), (17, 16, 32), (0, 8, 8), (100, 1, 100)],
)
def test_bucket_length(longest, multiple, expected):
    assert bucket_length(longest, multiple) == expected


def test_bucketing_bounds_the_number_of_shapes(tokenizer):
    rows = [{"prompt": words(n)} for n in range(1, 60)]
    ds = PromptDataset.from_records(rows, tokenizer, max_prompt_length=64)
    shapes = {
        ds.batch([i, j], pad_multiple=16).prompt_ids_bt.shape[1] for i in range(59) for j in (0, 30)
    }
    assert shapes == {16, 32, 48, 64}


# --- files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_file_format_gives_the_same_dataset(tmp_path, tokenizer, fmt):
    path = write(tmp_path / f"data.{fmt}", ROWS, fmt)
    ds = PromptDataset.from_file(path, tokenizer, cache_dir=tmp_path / "cache")
    reference = PromptDataset.from_records(ROWS, tokenizer)
    assert len(ds) == len(reference) and ds.prompts == reference.prompts
    for a, b in zip(ds.prompt_ids, reference.prompt_ids, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [str(a) for a in ds.fields["answer"]] == [r["answer"] for r in ROWS]
    assert ds.source == str(path)


def test_format_overrides_the_extension(tmp_path, tokenizer):
    path = write(tmp_path / "rows.txt", ROWS, "jsonl")
    ds = PromptDataset.from_file(path, tokenizer, format="jsonl", cache_dir=tmp_path / "cache")
    assert ds.prompts == [r["prompt"] for r in ROWS]


def test_several_files(tmp_path, tokenizer):
    a = write(tmp_path / "a.jsonl", ROWS[:2], "jsonl")
    b = write(tmp_path / "b.jsonl", ROWS[2:], "jsonl")
    ds = PromptDataset.from_file([a, b], tokenizer, cache_dir=tmp_path / "cache")
    assert len(ds) == 6
    with pytest.raises(DataError, match="mix formats"):
        load_table([a, write(tmp_path / "c.csv", ROWS, "csv")])


def test_struct_columns_also_give_a_dotted_column_per_key(tmp_path, tokenizer):
    """verl's data files keep the answer in ``reward_model.ground_truth`` (a Parquet struct):
    every key of a column of mappings is a column too, at any depth, from every source."""
    from jaxrl_llm.data.files import to_columns

    rows = [
        {"prompt": "a", "reward_model": {"ground_truth": "1", "meta": {"level": 3}}},
        {"prompt": "b", "reward_model": None},
        {"prompt": "c", "reward_model": {"ground_truth": "2"}},
    ]
    want = {
        "reward_model.ground_truth": ["1", None, "2"],
        "reward_model.meta": [{"level": 3}, None, None],
        "reward_model.meta.level": [3, None, None],
    }
    columns = to_columns(rows, source="rows")
    assert {k: columns[k] for k in want} == want and columns["prompt"] == ["a", "b", "c"]
    assert to_columns(columns, source="columns") == columns  # idempotent
    # A dotted column that exists is kept; lists and scalars are not opened.
    kept = to_columns([{"x": {"y": 1}, "x.y": 5, "m": [{"role": "user"}]}], source="rows")
    assert kept["x.y"] == [5] and set(kept) == {"x", "x.y", "m"}
    path = write(tmp_path / "verl.parquet", rows, "parquet")  # struct columns in Parquet
    ds = PromptDataset.from_file(
        path,
        tokenizer,
        fields=["reward_model.ground_truth"],
        chat_template=False,
        cache_dir=tmp_path / "cache",
    )
    assert ds.fields == {
        "raw_prompt": ["a", "b", "c"],
        "reward_model.ground_truth": ["1", None, "2"],
    }
    with pytest.raises(DataError, match=r"no field 'reward_model\.ground_truht'.*Did you mean"):
        PromptDataset.from_records(rows, tokenizer, fields=["reward_model.ground_truht"])


def test_file_errors(tmp_path, tokenizer, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl' does not exist$"):
        load_table(tmp_path / "nope.jsonl")
    monkeypatch.chdir(tmp_path)
    where = re.escape(f"(relative to the working directory: {tmp_path / 'nope.jsonl'})")
    with pytest.raises(FileNotFoundError, match=r"'nope\.jsonl' does not exist " + where):
        load_table("nope.jsonl")
    cache.mkdir()
    with pytest.raises(FileNotFoundError, match=r"'cache' is a folder, not a file"):
        load_table("cache")
    cache.rmdir()
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"unsupported file extension '\.txt'; expected one of"):
        load_table(tmp_path / "data.txt")
    with pytest.raises(DataError, match="unknown data format 'xml'"):
        load_table(tmp_path / "data.txt", format="xml")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file is empty"):
        load_table(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl: the file has no rows"):
        load_table(tmp_path / "blank.jsonl")
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"header\.csv: the file has no rows"):
        load_table(tmp_path / "header.csv")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(
        DataError, match=r"latin1.jsonl: line 2 is not valid UTF-8 \(byte 0xe9 at column 16\)"
    ):
        load_table(tmp_path / "latin1.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        load_table(tmp_path / "broken.jsonl", cache_dir=cache)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"none\.parquet: the file has no rows"):
        load_table(tmp_path / "none.parquet", cache_dir=cache)


def test_row_and_field_errors(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [{"prompt": "yes"}, {"answer": "3"}], "jsonl")
    with pytest.raises(DataError, match=r"d.jsonl: row 1 has no value for field 'prompt'"):
        PromptDataset.from_file(path, tokenizer, cache_dir=tmp_path / "cache")
    with pytest.raises(
        DataError,
        match=r"no field 'question' \(fields: prompt, answer, level\)\. Set `prompt_field`",
    ):
        PromptDataset.from_records(ROWS[:1], tokenizer, prompt_field="question")
    with pytest.raises(DataError, match=r"Did you mean 'answer'\? Set `fields`"):
        PromptDataset.from_records(ROWS[:1], tokenizer, fields=["answr"])
    with pytest.raises(DataError, match="row 0, field 'prompt' is empty"):
        PromptDataset.from_records([{"prompt": "  "}], tokenizer)
    with pytest.raises(DataError, match="row 0, field 'prompt' is int 3; expected a string"):
        PromptDataset.from_records([{"prompt": 3}], tokenizer)
    with pytest.raises(DataError, match="not of chat messages"):
        PromptDataset.from_records([{"prompt": [{"text": "x"}]}], tokenizer)
    with pytest.raises(DataError, match="records: no rows"):
        PromptDataset.from_records([], tokenizer)
    with pytest.raises(DataError, match="row 1 is a str, expected a mapping"):
        PromptDataset.from_records([{"prompt": "a"}, "b"], tokenizer)


def test_non_utf8_bytes_in_parquet(tmp_path, tokenizer):
    table = pa.table({"prompt": pa.array([b"yes", b"caf\xe9"], pa.binary())})
    pq.write_table(table, tmp_path / "bin.parquet")
    with pytest.raises(DataError, match=r"bin.parquet: row 1, field 'prompt' is not valid UTF-8"):
        PromptDataset.from_file(tmp_path / "bin.parquet", tokenizer, cache_dir=tmp_path / "c")


def test_tokenizer_vocab_check(tokenizer):
    check_tokenizer_vocab(tokenizer, len(tokenizer))
    check_tokenizer_vocab(tokenizer, len(tokenizer) + 64)  # embeddings padded to a multiple
    with pytest.raises(
        DataError, match=f"has {len(tokenizer)} tokens but the model's vocab_size is 30"
    ):
        check_tokenizer_vocab(tokenizer, 30)
    with pytest.raises(DataError, match=r"unused rows > max_unused=1024\).*another model's"):
        check_tokenizer_vocab(tokenizer, 50_000)
    check_tokenizer_vocab(tokenizer, 50_000, max_unused=100_000)
    with pytest.raises(DataError, match="pad_token_id=40 is outside"):
        check_tokenizer_vocab(type("T", (), {"__len__": lambda s: 10, "pad_token_id": 40})(), 16)


# --- iterator ----------------------------------------------------------------------------------


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(100, 0, seed=1)
    assert sorted(a) == list(range(100))
    np.testing.assert_array_equal(a, epoch_order(100, 0, seed=1))
    assert not np.array_equal(a, epoch_order(100, 1, seed=1))
    assert not np.array_equal(a, epoch_order(100, 0, seed=2))
    np.testing.assert_array_equal(epoch_order(5, 3, seed=1, shuffle=False), np.arange(5))


def test_take_indices_crosses_epochs():
    indices, pos = take_indices(5, 7, DataPosition(0, 3), seed=0)
    np.testing.assert_array_equal(
        indices, np.concatenate([epoch_order(5, 0, seed=0)[3:], epoch_order(5, 1, seed=0)])
    )
    assert pos == DataPosition(2, 0)
    with pytest.raises(ValueError, match="outside"):
        take_indices(5, 1, DataPosition(0, 5), seed=0)


def test_every_example_once_per_epoch(tokenizer):
    ds = PromptDataset.from_records([{"prompt": words(n % 9 + 1)} for n in range(10)], tokenizer)
    it = BatchIterator(ds, 4, seed=3)
    seen = np.concatenate([next(it).indices for _ in range(5)])  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert it.position == DataPosition(2, 0)


def test_resume_gives_the_same_batches(tokenizer):
    ds = PromptDataset.from_records([{"prompt": words(n % 9 + 1)} for n in range(10)], tokenizer)
    straight = BatchIterator(ds, 3, seed=7, pad_multiple=8)
    reference = [next(straight) for _ in range(9)]
    first = BatchIterator(ds, 3, seed=7, pad_multiple=8)
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through a file
    assert state == {"epoch": 1, "index": 2, "seed": 7, "num_examples": 10}
    resumed = BatchIterator(ds, 3, seed=7, pad_multiple=8, position=state)
    for want in reference[4:]:
        got = next(resumed)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.prompt_ids_bt, want.prompt_ids_bt)
        np.testing.assert_array_equal(got.prompt_mask_bt, want.prompt_mask_bt)
    also = BatchIterator(ds, 3, seed=7, position=DataPosition(1, 2))
    np.testing.assert_array_equal(also.next_indices(), reference[4].indices)


def test_resume_refuses_a_changed_setup(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer)
    state = {"epoch": 0, "index": 2, "seed": 7, "num_examples": 6}
    with pytest.raises(ValueError, match="saved with seed 7, this iterator has seed 8"):
        BatchIterator(ds, 2, seed=8, position=state)
    with pytest.raises(ValueError, match="saved for 9 examples, the dataset now has 6"):
        BatchIterator(ds, 2, seed=7, position={**state, "num_examples": 9})
    with pytest.raises(ValueError, match="invalid for 6 examples"):
        BatchIterator(ds, 2, position=DataPosition(0, 6))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        BatchIterator(ds, 0)


def test_next_batch_with_other_size_and_no_shuffle(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer)
    it = BatchIterator(ds, 2, shuffle=False)
    np.testing.assert_array_equal(next(it).indices, [0, 1])
    np.testing.assert_array_equal(it.next_batch(5).indices, [2, 3, 4, 5, 0])
    assert it.position == DataPosition(1, 1)


def test_sequential_batches_cover_the_dataset_in_order(tokenizer):
    ds = PromptDataset.from_records(ROWS, tokenizer)
    batches = list(sequential_batches(ds, 4, pad_multiple=8))
    assert [b.indices.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5]]
    assert batches[1].prompt_ids_bt.shape == (2, 40)


# --- preference data ---------------------------------------------------------------------------


def test_preference_batches(tokenizer):
    rows = [
        {"prompt": "yes", "chosen": "good", "rejected": "bad bad bad"},
        {"prompt": words(3), "chosen": [{"role": "assistant", "content": "a b"}], "rejected": "no"},
    ]
    ds = PreferenceDataset.from_records(rows, tokenizer)
    eos = tokenizer.eos_token_id
    np.testing.assert_array_equal(ds.chosen_ids[0], [*ids(tokenizer, "good"), eos])
    np.testing.assert_array_equal(ds.chosen_ids[1], [*ids(tokenizer, "a b"), eos])
    batch = ds.batch([0, 1], pad_multiple=4)
    assert batch.prompt_ids_bt.shape == (2, 8)  # 4 and 6 tokens
    np.testing.assert_array_equal(batch.prompt_mask_bt.sum(1), [4, 6])
    assert batch.prompt_mask_bt[:, -1].all()
    assert batch.chosen_ids_bt.shape == batch.rejected_ids_bt.shape == (2, 4)
    np.testing.assert_array_equal(batch.chosen_mask_bt.sum(1), [2, 3])
    np.testing.assert_array_equal(batch.rejected_mask_bt.sum(1), [4, 2])
    assert batch.chosen_mask_bt[:, 0].all()  # right-padded
    assert batch.rejected_ids_bt[0, 3] == eos


def test_preference_limits_and_errors(tokenizer):
    rows = [
        {"prompt": words(20), "chosen": "a", "rejected": "b"},
        {"prompt": "yes", "chosen": words(10), "rejected": "b"},
        {"prompt": "no", "chosen": "a", "rejected": "b"},
    ]
    ds = PreferenceDataset.from_records(
        rows, tokenizer, max_prompt_length=8, max_completion_length=4
    )
    assert len(ds) == 2 and ds.num_dropped == 1 and ds.num_truncated == 1
    assert len(ds.chosen_ids[0]) == 4
    assert ds.batch([0, 1], fixed_length=True, pad_multiple=4).chosen_ids_bt.shape == (2, 4)
    with pytest.raises(DataError, match=r"no field 'chosen'.*Set `chosen_field`"):
        PreferenceDataset.from_records([{"prompt": "a", "rejected": "b"}], tokenizer)
    with pytest.raises(DataError, match="row 0 has no value for field 'rejected'"):
        PreferenceDataset.from_records(
            [{"prompt": "a", "chosen": "b", "rejected": None}], tokenizer
        )
    with pytest.raises(DataError, match="all 1 preference prompts are longer"):
        PreferenceDataset.from_records(rows[:1], tokenizer, max_prompt_length=8)


def test_implicit_prompts_are_the_common_start_of_chosen_and_rejected(tmp_path, tokenizer):
    """Without a prompt column the prompt is what chosen and rejected share (TRL's implicit-prompt
    preference format, e.g. trl-lib/ultrafeedback_binarized): whole messages, or characters with
    a space at the split going to the answers, as trl.data_utils.extract_prompt does."""
    user = lambda text: {"role": "user", "content": text}
    bot = lambda text: {"role": "assistant", "content": text}
    sky = [user("What colour is the sky?")]
    system = [{"role": "system", "content": "Be brief."}, user("2 + 2?")]
    implicit = [
        {"chosen": [*sky, bot("Blue.")], "rejected": [*sky, bot("Green.")]},
        {"chosen": [*system, bot("4")], "rejected": [*system, bot("5"), user("Sure?"), bot("6")]},
    ]
    explicit = [
        {"prompt": sky, "chosen": [bot("Blue.")], "rejected": [bot("Green.")]},
        {"prompt": system, "chosen": [bot("4")], "rejected": [bot("6")]},  # the last reply
    ]
    path = write(tmp_path / "implicit.jsonl", implicit, "jsonl")
    got = PreferenceDataset.from_file(path, tokenizer, cache_dir=tmp_path / "cache")
    want = PreferenceDataset.from_records(explicit, tokenizer)
    assert got.implicit_prompt and not want.implicit_prompt
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        for a, b in zip(getattr(got, name), getattr(want, name), strict=True):
            np.testing.assert_array_equal(a, b)

    # Text: TRL's docstring example, and the split inside a word.
    split = split_implicit_prompt
    assert split("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert split("It costs 12", "It costs 15") == ("It costs 1", "2", "5")
    assert split("Say hi", "Say hi!") == ("Say hi", "", "!")  # one is the start of the other
    text = PreferenceDataset.from_records(
        [{"good": "Q: 2+2? 4", "bad": "Q: 2+2? 5"}],
        tokenizer,
        chosen_field="good",
        rejected_field="bad",
        chat_template=False,
    )
    np.testing.assert_array_equal(text.prompt_ids[0], ids(tokenizer, "Q: 2+2?"))
    np.testing.assert_array_equal(
        text.chosen_ids[0], [*ids(tokenizer, " 4"), tokenizer.eos_token_id]
    )

    with pytest.raises(DataError, match=r"row 0: there is no prompt column, and 'chosen' and"):
        PreferenceDataset.from_records([{"chosen": "yes", "rejected": "no"}], tokenizer)
    with pytest.raises(DataError, match=r"row 1: with no prompt column, 'chosen' and 'rejected'"):
        PreferenceDataset.from_records([implicit[0], {"chosen": "a b", "rejected": sky}], tokenizer)
    # A prompt_field that misses a column it could mean is a typo, not an implicit prompt.
    with pytest.raises(DataError, match=r"no field 'promt'.*Did you mean 'prompt'\?"):
        PreferenceDataset.from_records(explicit, tokenizer, prompt_field="promt")


def test_a_dpo_run_reads_implicit_prompts_and_says_so(tmp_path, tokenizer):
    from jaxrl_llm.train import data as run_data

    rows = [
        {"chosen": f"Q{i}: 2+{i}? {2 + i}", "rejected": f"Q{i}: 2+{i}? {3 + i}", "answer": i}
        for i in range(6)
    ]
    path = write(tmp_path / "hh.jsonl", rows, "jsonl")
    spec = run_data.DataSpec(source="file", path=str(path), eval_size=2, chat_template=False)
    got = run_data.build_data(spec, tokenizer, offline=True)
    assert len(got.train) == 4 and len(got.eval_pairs) == 2 and got.train.implicit_prompt
    assert got.eval_prompts is None  # an answer column, but no prompts to sample from
    assert any("each pair's prompt is the common start of its 'chosen'" in n for n in got.notes)


def test_preference_from_file(tmp_path, tokenizer):
    rows = [{"prompt": "yes", "chosen": "good", "rejected": "bad"}] * 3
    path = write(tmp_path / "pairs.parquet", rows, "parquet")
    ds = PreferenceDataset.from_file(path, tokenizer, cache_dir=tmp_path / "cache")
    assert len(ds) == 3 and ds.source == str(path)


# --- the arithmetic task -----------------------------------------------------------------------


def _problem(prompt):
    a, op, b = prompt.removeprefix("What is ").split("?")[0].split()
    a, b = int(a), int(b)
    return (op, *sorted((a, b))) if op in "+*" else (op, a, b)


def test_arithmetic_answers_and_disjoint_split():
    train, held_out = arithmetic_task(num_train=1500, num_eval=200, ops=("+", "-", "*"), seed=0)
    assert len(train) == 1500 and len(held_out) == 200
    for row in train + held_out:
        a, op, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == str(eval(f"{a} {op} {b}"))
        assert int(row["answer"]) >= 0
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert row["prompt"].endswith("? Answer with just the number.")
    train_problems = {_problem(r["prompt"]) for r in train}
    held_problems = {_problem(r["prompt"]) for r in held_out}
    assert len(train_problems) == 1500 and len(held_problems) == 200
    assert not train_problems & held_problems  # not even "3 + 5" vs "5 + 3"
    assert {_problem(r["prompt"])[0] for r in train} == {"+", "-", "*"}


def test_arithmetic_is_seeded_and_eval_independent_of_train_size():
    a = arithmetic_task(num_train=100, num_eval=50, seed=1)
    assert a == arithmetic_task(num_train=100, num_eval=50, seed=1)
    assert a != arithmetic_task(num_train=100, num_eval=50, seed=2)
    assert a[1] == arithmetic_task(num_train=7, num_eval=50, seed=1)[1]
    big = arithmetic_task(num_train=50, num_eval=30, digits=6, seed=1)  # sampled, not enumerated
    assert big[1] == arithmetic_task(num_train=5, num_eval=30, digits=6, seed=1)[1]
    assert not {_problem(r["prompt"]) for r in big[0]} & {_problem(r["prompt"]) for r in big[1]}


def test_arithmetic_small_space_is_exhausted_exactly():
    train, held_out = arithmetic_task(num_train=45, num_eval=10, digits=1, ops=("+",))
    assert len({_problem(r["prompt"]) for r in train + held_out}) == 55  # all of 0..9 + 0..9
    with pytest.raises(DataError, match=r"asked for 46 \+ 10 = 56 .* only 55 distinct .* 0\.\.9"):
        arithmetic_task(num_train=46, num_eval=10, digits=1, ops=("+",))


def test_arithmetic_operand_range_and_problem_count():
    assert num_arithmetic_problems(digits=1, ops=("+",)) == 55
    assert num_arithmetic_problems(min_operand=0, max_operand=99, ops=("+", "-")) == 10100
    assert num_arithmetic_problems(digits=2, ops=("-",), nonnegative=False) == 8100
    train, held_out = arithmetic_task(num_train=150, num_eval=20, min_operand=3, max_operand=15)
    for row in train + held_out:
        a, _, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert 3 <= int(a) <= 15 and 3 <= int(b) <= 15
    rows, _ = arithmetic_task(num_train=50, num_eval=0, ops=("-",), nonnegative=False, seed=3)
    assert any(int(r["answer"]) < 0 for r in rows)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_operand": 0}, "give both min_operand and max_operand"),
        ({"min_operand": 5, "max_operand": 4}, "min_operand 5 must be <= max_operand 4"),
        ({"ops": ("/",)}, "ops must be distinct operators"),
        ({"ops": ()}, "ops must be distinct operators"),
        ({"digits": 0}, "digits must be an int from 1 to 9"),
        ({"num_eval": -1}, "num_eval must be an int >= 0"),
        ({"template": "What is {a} {b}?"}, "template must contain {op}"),
    ],
)
def test_arithmetic_bad_knobs(kwargs, match):
    with pytest.raises(DataError, match=match):
        arithmetic_task(**kwargs)


def test_arithmetic_end_to_end_with_the_integer_reward(tokenizer):
    train, _ = arithmetic_task(num_train=8, num_eval=4, digits=1, template="What is {a} {op} {b} ?")
    ds = PromptDataset.from_records(train, tokenizer, max_prompt_length=32)
    batch = next(BatchIterator(ds, 4, seed=0, pad_multiple=16))
    completions = [f"It is {a}." for a in batch.fields["answer"]]
    assert IntegerAnswer()(batch.prompts, completions, **batch.fields) == [1.0] * 4


def test_arithmetic_preference_pairs(tokenizer):
    rows, _ = arithmetic_task(num_train=200, num_eval=0, seed=0)
    columns = {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}
    fields = dict(prompt_field="q", rejected_field="bad")
    pairs = arithmetic_preference_pairs(columns, seed=3, **fields)
    assert list(pairs) == ["q", "chosen", "bad", "answer"]
    assert pairs["q"] == columns["prompt"]
    assert pairs["chosen"] == pairs["answer"] == columns["answer"]  # right answers
    offsets = [int(w) - int(a) for w, a in zip(pairs["bad"], pairs["answer"], strict=True)]
    assert all(1 <= abs(o) <= 10 for o in offsets) and min(offsets) < 0 < max(offsets)
    assert pairs == arithmetic_preference_pairs(columns, seed=3, **fields)  # seeded
    assert pairs["bad"] != arithmetic_preference_pairs(columns, seed=4)["rejected"]
    ds = PreferenceDataset.from_records(pairs, tokenizer, prompt_field="q", rejected_field="bad")
    assert len(ds) == 200


def test_default_model_tokenizer_if_cached():
    from jaxrl_llm.models.default import DEFAULT_MODEL_NAME, cache_dir

    folder = cache_dir() / DEFAULT_MODEL_NAME
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the default model's folder is not cached")
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    check_tokenizer_vocab(tok, 49152)
    train, _ = arithmetic_task(num_train=16, num_eval=4)
    ds = PromptDataset.from_records(train, tok, max_prompt_length=128, system_prompt="Be brief.")
    batch = ds.batch(range(4), pad_multiple=32)
    text = tok.decode(batch.prompt_ids_bt[0][batch.prompt_mask_bt[0]])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is")
    assert text.endswith("<|im_start|>assistant\n")
