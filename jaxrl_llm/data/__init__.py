"""Prompt and preference datasets: local files, chat templates, bucketed padding, resumable order.

    train_rows, eval_rows = arithmetic_task(num_train=2000, num_eval=200, seed=0)
    dataset = PromptDataset.from_records(train_rows, tokenizer, max_prompt_length=256)
    # or PromptDataset.from_file("gsm8k.jsonl", tokenizer, prompt_field="question")
    it = BatchIterator(dataset, batch_size=8, seed=0, pad_multiple=32)
    batch = next(it)          # PromptBatch: prompt_ids_bt int32[B, T], prompt_mask_bt bool[B, T],
                              # prompts, fields (for rewards), indices
    state = it.state_dict()   # {epoch, index, seed, num_examples}: save it with the checkpoint
    it = BatchIterator(dataset, batch_size=8, seed=0, pad_multiple=32, position=state)
    for batch in sequential_batches(eval_dataset, 32, pad_multiple=32): ...  # one ordered pass

Everything here is host-side NumPy; no JAX. See docs/rewards_and_data.md.
"""

from jaxrl_llm.data.arithmetic import (
    ARITHMETIC_OPS,
    ARITHMETIC_TEMPLATE,
    arithmetic_preference_pairs,
    arithmetic_task,
    num_arithmetic_problems,
)
from jaxrl_llm.data.files import (
    FORMAT_NAMES,
    FORMATS,
    DataError,
    check_files,
    load_table,
    to_columns,
)
from jaxrl_llm.data.iterator import (
    BatchIterator,
    DataPosition,
    epoch_order,
    sequential_batches,
    take_indices,
)
from jaxrl_llm.data.preference import PreferenceBatch, PreferenceDataset, split_implicit_prompt
from jaxrl_llm.data.prompts import PromptBatch, PromptDataset
from jaxrl_llm.data.tokens import (
    bucket_length,
    check_tokenizer_vocab,
    left_pad,
    render_prompts,
    right_pad,
)

__all__ = [
    "ARITHMETIC_OPS",
    "ARITHMETIC_TEMPLATE",
    "FORMATS",
    "FORMAT_NAMES",
    "BatchIterator",
    "DataError",
    "DataPosition",
    "PreferenceBatch",
    "PreferenceDataset",
    "PromptBatch",
    "PromptDataset",
    "arithmetic_preference_pairs",
    "arithmetic_task",
    "bucket_length",
    "check_files",
    "check_tokenizer_vocab",
    "epoch_order",
    "left_pad",
    "load_table",
    "num_arithmetic_problems",
    "render_prompts",
    "right_pad",
    "sequential_batches",
    "split_implicit_prompt",
    "take_indices",
    "to_columns",
]
