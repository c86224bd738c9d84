"""A deterministic, resumable batch iterator.

The data is an endless stream: epoch 0's order, then epoch 1's, ... where epoch ``e``'s order is
a permutation drawn from ``numpy.random.default_rng([seed, e])`` (or ``0..N-1`` without
shuffling). A position is ``(epoch, index)``: how far into epoch ``epoch``'s order the stream has
been read. A batch takes the next ``batch_size`` indices of the stream, crossing into the next
epoch when one ends, so every example is seen exactly once per epoch and batches always have
``batch_size`` rows (static shapes for jit). Because the order is a pure function of
``(seed, epoch)``, the position alone (four ints, :meth:`BatchIterator.state_dict`) restores the
stream: resuming from a saved position yields exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np


class DataPosition(NamedTuple):
    """Where the stream stands: ``index`` examples of epoch ``epoch``'s order already read."""

    epoch: int = 0
    index: int = 0


class BatchableDataset(Protocol):
    def __len__(self) -> int: ...

    def batch(self, indices: Any, **kwargs: Any) -> Any: ...


def epoch_order(num_examples: int, epoch: int, *, seed: int, shuffle: bool = True) -> np.ndarray:
    """``int64[N]`` example order of epoch ``epoch``: a seeded permutation, or ``arange``."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_examples).astype(np.int64)


def take_indices(
    num_examples: int, count: int, position: DataPosition, *, seed: int, shuffle: bool = True
) -> tuple[np.ndarray, DataPosition]:
    """The next ``count`` indices of the stream from ``position``, and the position after them."""
    if num_examples < 1:
        raise ValueError("cannot iterate over an empty dataset")
    epoch, index = position
    if not 0 <= index < num_examples:
        raise ValueError(f"position index {index} is outside [0, {num_examples})")
    out = []
    while count > 0:
        order = epoch_order(num_examples, epoch, seed=seed, shuffle=shuffle)
        chunk = order[index : index + count]
        out.append(chunk)
        count -= len(chunk)
        index += len(chunk)
        if index == num_examples:
            epoch, index = epoch + 1, 0
    indices = np.concatenate(out) if out else np.zeros((0,), np.int64)
    return indices, DataPosition(epoch, index)


def sequential_batches(
    dataset: BatchableDataset, batch_size: int, **batch_kwargs: Any
) -> Iterator[Any]:
    """One pass in dataset order (for evaluation); the last batch has the remaining rows."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    for start in range(0, len(dataset), batch_size):
        stop = min(start + batch_size, len(dataset))
        yield dataset.batch(np.arange(start, stop, dtype=np.int64), **batch_kwargs)


class BatchIterator:
    """Endless batches of a dataset (:class:`PromptDataset`, :class:`PreferenceDataset`, ...).

    Args:
      dataset: anything with ``len()`` and ``batch(indices, **batch_kwargs)``.
      batch_size: rows per batch.
      seed: the shuffling seed.
      shuffle: shuffle each epoch (else the dataset's order every epoch).
      position: where to start (a :class:`DataPosition`, or a :meth:`state_dict`).
      **batch_kwargs: passed to ``dataset.batch`` (``pad_multiple``, ``fixed_length``).

    ``next(it)`` returns ``dataset.batch(...)`` of ``batch_size`` rows; ``it.next_batch(n)``
    takes ``n`` rows instead (e.g. DAPO refilling dropped groups). :attr:`position` is the
    position after the last batch returned.
    """

    def __init__(
        self,
        dataset: BatchableDataset,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        position: DataPosition | dict[str, int] | None = None,
        **batch_kwargs: Any,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if len(dataset) < 1:
            raise ValueError("cannot iterate over an empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.batch_kwargs = batch_kwargs
        self._position = DataPosition()
        if isinstance(position, dict):
            self.load_state_dict(position)
        elif position is not None:
            self._set_position(DataPosition(*position))

    @property
    def position(self) -> DataPosition:
        return self._position

    def _set_position(self, position: DataPosition) -> None:
        epoch, index = int(position.epoch), int(position.index)
        if epoch < 0 or not 0 <= index < len(self.dataset):
            raise ValueError(
                f"data position {tuple(position)} is invalid for {len(self.dataset)} examples"
            )
        self._position = DataPosition(epoch, index)

    def next_indices(self, count: int | None = None) -> np.ndarray:
        """Advances the stream by ``count`` (default ``batch_size``) and returns the indices."""
        indices, self._position = take_indices(
            len(self.dataset),
            self.batch_size if count is None else count,
            self._position,
            seed=self.seed,
            shuffle=self.shuffle,
        )
        return indices

    def next_batch(self, count: int | None = None) -> Any:
        """The next ``count`` (default ``batch_size``) rows as a batch."""
        return self.dataset.batch(self.next_indices(count), **self.batch_kwargs)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Any:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position plus what it is valid for: ``{epoch, index, seed, num_examples}``."""
        return {
            "epoch": self._position.epoch,
            "index": self._position.index,
            "seed": self.seed,
            "num_examples": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; the seed and dataset size must match this iterator."""
        missing = {"epoch", "index"} - set(state)
        if missing:
            raise ValueError(f"data state lacks {sorted(missing)}: {state!r}")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(
                f"data state was saved with seed {int(state['seed'])}, this iterator has seed "
                f"{self.seed}: resuming would give other batches"
            )
        if "num_examples" in state and int(state["num_examples"]) != len(self.dataset):
            raise ValueError(
                f"data state was saved for {int(state['num_examples'])} examples, the dataset "
                f"now has {len(self.dataset)} (changed data or max_prompt_length?)"
            )
        self._set_position(DataPosition(int(state["epoch"]), int(state["index"])))
