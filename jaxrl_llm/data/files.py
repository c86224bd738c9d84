"""Reading local JSONL / JSON / Parquet / CSV files with ``datasets``, with errors that say where.

Files are read with ``datasets.load_dataset(<format>, data_files=...)``, never from the Hub. Before
``datasets`` sees a text file it is checked for what ``datasets`` reports badly: a missing file, an
unsupported extension, an empty file and non-UTF-8 bytes (named by line and column). A JSONL line
that is not valid JSON is named by its line number.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: File extension → ``datasets`` builder.
FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

PathLike = str | os.PathLike


class DataError(ValueError):
    """Bad input data: names the file (or source), the row and field, and what was expected."""


#: ``format=`` names → ``datasets`` builder (``None``/``"auto"``: from the extension).
FORMAT_NAMES: dict[str, str] = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


def _format_of(path: Path, fmt: str | None = None) -> str:
    if fmt not in (None, "auto"):
        if fmt not in FORMAT_NAMES:
            raise DataError(
                f"unknown data format {fmt!r}; expected one of {', '.join(FORMAT_NAMES)}"
            )
        return FORMAT_NAMES[fmt]
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unsupported file extension {suffix or '(none)'!r}; expected one of "
            f"{', '.join(FORMATS)} (or name the format: format='jsonl' | 'parquet' | 'csv')"
        )
    return FORMATS[suffix]


def _scan_text(path: Path) -> int:
    """Checks a text file is UTF-8; returns its number of non-blank lines."""
    non_blank = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: line {lineno} is not valid UTF-8 (byte 0x{line[exc.start]:02x} at "
                    f"column {exc.start + 1}); re-save the file as UTF-8"
                ) from exc
            non_blank += bool(text.strip())
    return non_blank


def _locate_json_error(path: Path) -> str | None:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"{path}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})"
            if not isinstance(row, dict):
                return f"{path}: line {lineno} is a JSON {type(row).__name__}, expected an object"
    return None


def describe_paths(paths: PathLike | Sequence[PathLike]) -> str:
    """The file name(s) for messages."""
    if isinstance(paths, str | os.PathLike):
        return str(paths)
    return ", ".join(map(str, paths))


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:
        raise DataError(
            f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})"
        ) from exc


def check_files(
    paths: PathLike | Sequence[PathLike], *, format: str | None = None
) -> tuple[list[Path], str]:
    """Resolves and checks data files; returns ``(paths, datasets builder name)``.

    ``format`` (``"jsonl"``, ``"json"``, ``"parquet"``, ``"csv"``) overrides the extension.

    Raises ``FileNotFoundError`` for a missing file and :class:`DataError` for an unsupported or
    mixed extension, an empty file or non-UTF-8 text.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    resolved = [Path(p).expanduser() for p in paths]
    if not resolved:
        raise DataError("no data files given")
    builders = set()
    for path in resolved:
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            where = (
                ""
                if path.is_absolute()
                else f" (relative to the working directory: {path.absolute()})"
            )
            raise FileNotFoundError(f"data file {str(path)!r} {what}{where}")
        builder = _format_of(path, format)
        builders.add(builder)
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty; expected at least one row")
        if builder in ("json", "csv"):
            lines = _scan_text(path)
            if lines == 0 or (builder == "csv" and lines == 1):
                raise DataError(f"{path}: the file has no rows")
            if format == "jsonl" or (format in (None, "auto") and path.suffix.lower() == ".jsonl"):
                where = _locate_json_error(path)  # before datasets logs its own parse error
                if where is not None:
                    raise DataError(where)
        elif _parquet_rows(path) == 0:
            raise DataError(f"{path}: the file has no rows")
    if len(builders) > 1:
        raise DataError(f"data files mix formats {sorted(builders)}: {[str(p) for p in resolved]}")
    return resolved, builders.pop()


def load_table(
    paths: PathLike | Sequence[PathLike],
    *,
    format: str | None = None,
    cache_dir: PathLike | None = None,
) -> Any:
    """Local data files as one ``datasets.Dataset`` (train split), checked (see module doc).

    Args:
      paths: one file or a list of files of one format (.jsonl/.json, .parquet, .csv).
      format: ``"jsonl"``, ``"json"``, ``"parquet"`` or ``"csv"`` to override the extension
        (``None`` or ``"auto"``: from the extension).
      cache_dir: the ``datasets`` cache folder (default: ``datasets``' own).
    """
    import datasets

    resolved, builder = check_files(paths, format=format)
    try:
        table = datasets.load_dataset(
            builder,
            data_files=[str(p) for p in resolved],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception as exc:
        if builder == "json":
            for path in resolved:
                where = _locate_json_error(path)
                if where is not None:
                    raise DataError(where) from exc
        names = ", ".join(str(p) for p in resolved)
        raise DataError(f"could not read {names}: {type(exc).__name__}: {exc}") from exc
    if table.num_rows == 0:
        raise DataError(f"{', '.join(str(p) for p in resolved)}: no rows")
    return table


def _with_nested(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``columns`` plus a dotted column for each key of a column whose cells are mappings (a
    Parquet struct, a JSON object), at any depth: verl's data files keep the reference answer
    in ``reward_model.ground_truth``. A row whose mapping lacks the key (or is ``None``) gets
    ``None``; a dotted name that is already a column is left alone."""
    out = dict(columns)
    pending = list(columns.items())
    while pending:
        name, values = pending.pop(0)
        cells = [v for v in values if v is not None]
        if not cells or not all(isinstance(v, Mapping) for v in cells):
            continue
        keys = dict.fromkeys(k for cell in cells for k in cell)
        if not all(isinstance(k, str) for k in keys):
            continue
        for key in keys:
            sub = f"{name}.{key}"
            if sub not in out:
                out[sub] = [None if v is None else v.get(key) for v in values]
                pending.append((sub, out[sub]))
    return out


def to_columns(records: Any, *, source: str) -> dict[str, list[Any]]:
    """Rows as columns: a ``datasets.Dataset``, a mapping of columns or a sequence of row dicts.

    Missing keys in row dicts become ``None``. A column of mappings also gives a column per key,
    named with a dot (``reward_model.ground_truth``; :func:`_with_nested`). Raises
    :class:`DataError` for no rows or a row that is not a mapping.
    """
    if hasattr(records, "column_names") and hasattr(records, "to_dict"):
        columns = {k: list(v) for k, v in records.to_dict().items()}
    elif isinstance(records, Mapping):
        columns = {str(k): list(v) for k, v in records.items()}
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise DataError(f"{source}: columns have different lengths {sorted(lengths)}")
    else:
        rows = list(records)
        keys: dict[str, None] = {}
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise DataError(f"{source}: row {i} is a {type(row).__name__}, expected a mapping")
            keys.update(dict.fromkeys(map(str, row)))
        columns = {k: [row.get(k) for row in rows] for k in keys}
    if not columns or not next(iter(columns.values())):
        raise DataError(f"{source}: no rows")
    return _with_nested(columns)


def require_column(columns: Mapping[str, Any], field: str, *, source: str, option: str) -> None:
    """Raises :class:`DataError` naming the missing column, the nearest one and the option."""
    if field in columns:
        return
    close = difflib.get_close_matches(field, list(columns), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise DataError(
        f"{source}: no field {field!r} (fields: {', '.join(columns)}).{hint} Set `{option}` to "
        f"the column that holds it."
    )
