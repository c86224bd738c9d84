"""Prompt batches from strings and completion text, with the real SmolLM2 tokenizer."""

import numpy as np
import pytest

from jaxrl_llm import rollout


def test_encode_prompts_chat_template_left_padding_and_buckets(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = ["What is 2 + 3?", "Name a primary colour, then explain why it is primary."]
    ids, mask = rollout.encode_prompts(tok, prompts, pad_multiple=16)
    assert ids.dtype == np.int32 and mask.dtype == np.bool_
    assert ids.shape[1] % 16 == 0 and mask[:, -1].all()
    for row, prompt in enumerate(prompts):
        expected = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        assert tok.decode(ids[row][mask[row]]) == expected
        assert not mask[row, : ids.shape[1] - mask[row].sum()].any()  # left padding
    assert np.all(ids[~mask] == tok.pad_token_id)


def test_encode_prompts_options(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = rollout.encode_prompts(tok, ["hi"], system_prompt="Be brief.", pad_multiple=8)
    text = tok.decode(ids[0][mask[0]])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and ids.shape[1] % 8 == 0
    ids, mask = rollout.encode_prompts(tok, ["hi there"], chat_template=False, pad_multiple=1)
    assert tok.decode(ids[0][mask[0]]) == "hi there" and mask.all()
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    ids, mask = rollout.encode_prompts(tok, [messages])
    assert tok.decode(ids[0][mask[0]]).endswith("c<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "prompts, kw, message",
    [
        ([], {}, "no prompts"),
        (["ok", "  "], {}, "prompt 1 is empty"),
        ("text", {}, "one string"),
        (["a " * 50], {"max_prompt_length": 20}, "more than max_prompt_length=20"),
    ],
)
def test_encode_prompts_errors(smollm2_tokenizer, prompts, kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        rollout.encode_prompts(smollm2_tokenizer, prompts, **kw)


def test_decode_completions_drops_padding_and_stops_at_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    hello = tok("Hello world", add_special_tokens=False)["input_ids"]
    bye = tok(" bye", add_special_tokens=False)["input_ids"]
    eos, n = tok.eos_token_id, 8
    rows = [[*hello, eos, *bye], hello + bye, []]
    tokens = np.full((3, 1, n), tok.pad_token_id, np.int32)
    mask = np.zeros((3, 1, n), bool)
    for i, row in enumerate(rows):
        tokens[i, 0, : len(row)] = row
        mask[i, 0, : len(row)] = True
    texts = rollout.decode_completions(tok, tokens, mask)
    assert texts == [["Hello world"], ["Hello world bye"], [""]]
    with pytest.raises(ValueError, match=r"\[B, G, T\]"):
        rollout.decode_completions(tok, tokens[0], mask[0])
