"""BookCorpus text for teacher-forced windows.

The original `bookcorpus` repository loads through a script, which `datasets` >= 4 refuses. The
hub keeps an automatic parquet conversion of it (revision `refs/convert/parquet`), which current
`datasets` reads and can stream, so only the rows needed are fetched. `--data` takes local files
instead (.txt, .parquet, .json/.jsonl, or a directory of them; text column `text`), and the
built-in source is English text shipped with Python, so the command runs with no network.
"""

from __future__ import annotations

import glob
import os

from .needlebench import DataError

HUB_ID = "bookcorpus/bookcorpus"
HUB_REVISION = "refs/convert/parquet"
_BUILDERS = {".txt": "text", ".parquet": "parquet", ".json": "json", ".jsonl": "json"}


def _local_files(path: str) -> tuple[str, list]:
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.splitext(f)[1] in _BUILDERS
        )
    )
    if not files:
        raise DataError(f"--data {path}: no .txt, .parquet, .json or .jsonl files found.")
    kinds = {_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(
            f"--data {path}: use files of one kind (.txt, .parquet or .json/.jsonl), got {sorted(map(str, kinds))}."
        )
    return kinds.pop(), files


def _rows(source: str, data: str | None, dataset_id: str, revision: str | None, column: str):
    """An iterator of text rows and a description of where they come from."""
    from datasets import load_dataset

    if data is not None:
        builder, files = _local_files(data)
        ds = load_dataset(builder, data_files=files, split="train", streaming=True)
        where = f"local files ({data})"
    else:
        ds = load_dataset(dataset_id, revision=revision, streaming=True)
        # the parquet conversion of a large dataset may hold only a "partial-train" split
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
        where = f"{dataset_id}" + (f"@{revision}" if revision else "") + f" [{split}]"
    first = next(iter(ds), None)
    if first is None or column not in first:
        raise DataError(
            f"{where} has no rows with a '{column}' column (columns: {sorted(first or {})}); set --text-column."
        )
    return (row[column] for row in ds), where


def load_token_stream(
    tok,
    tokens: int,
    *,
    source="auto",
    data=None,
    dataset_id=HUB_ID,
    revision=HUB_REVISION,
    column="text",
    builtin_model=False,
) -> tuple[list, str, str | None]:
    """(at least `tokens` token ids of running text, where they came from, a fallback warning or None)."""
    warning = None
    if source == "builtin" or (source == "auto" and builtin_model and data is None):
        rows, where = None, "builtin (held-out pydoc_data topics)"
    else:
        try:
            rows, where = _rows(source, data, dataset_id, revision, column)
        except DataError:
            raise
        except Exception as e:
            msg = (
                f"could not load BookCorpus from {'--data ' + data if data else dataset_id}: {type(e).__name__}: {e}. "
                "Give local files with --data, another copy with --dataset-id/--revision, or use --source builtin."
            )
            if source == "hub" or data is not None:
                raise DataError(msg) from None
            rows, where, warning = (
                None,
                "builtin (held-out pydoc_data topics)",
                msg + " Falling back to the built-in text.",
            )
    if rows is None:
        from hf_contextpar.models import heldout_text  # pydoc topics needle-lm never trained on

        ids = tok(heldout_text(), add_special_tokens=False).input_ids
    else:
        ids, chunk, chars = [], [], 0
        for row in rows:  # BookCorpus rows are sentences: one per line, as in its text files
            chunk.append(row)
            chars += len(row)
            if chars > 200_000:
                ids.extend(tok("\n".join(chunk) + "\n", add_special_tokens=False).input_ids)
                chunk, chars = [], 0
                if len(ids) >= tokens:
                    break
        if chunk and len(ids) < tokens:
            ids.extend(tok("\n".join(chunk), add_special_tokens=False).input_ids)
    if len(ids) < tokens:
        raise DataError(
            f"{where} gives only {len(ids)} tokens, {tokens} are needed; lower --window or --num-windows, "
            "or give more text with --data."
        )
    return ids, where, warning


def windows(ids: list, window: int, count: int, bos: int | None) -> list[list]:
    """`count` consecutive windows of exactly `window` tokens (each starting with BOS when the model uses one)."""
    body = window - (1 if bos is not None else 0)
    out = []
    for i in range(count):
        piece = ids[i * body : (i + 1) * body]
        out.append(([bos] if bos is not None else []) + piece)
    return out


def uses_bos(tok) -> int | None:
    """The BOS id if the tokenizer puts one in front of a text by itself, else None."""
    bos = getattr(tok, "bos_token_id", None)
    ids = tok("a").input_ids
    return bos if bos is not None and ids and ids[0] == bos else None
