"""Prompt datasets: local files or a `datasets.load_dataset` name, checked row by row."""

import json
from dataclasses import dataclass
from pathlib import Path

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset that cannot be used as it is; the message names the file, the row or line, and
    what to fix."""


@dataclass(frozen=True)
class GivenDataset:
    """A datasets.Dataset given as an object (the Python API's train_dataset), with the name
    messages call it by."""

    rows: object
    name: str

    def __str__(self) -> str:
        return self.name


def load_prompt_dataset(path_or_name, split: str = "train", config_name: str | None = None):
    """Load rows that each hold a `prompt` (a string or a list of chat messages) plus any columns.

    A local file by extension (.jsonl, .json, .parquet, .csv), a folder written by
    `Dataset.save_to_disk`, a GivenDataset, or else a name for `datasets.load_dataset` (which may
    need the network).
    """
    import datasets

    if isinstance(path_or_name, GivenDataset):
        validate_rows(path_or_name.rows, path_or_name.name)
        return path_or_name.rows

    path = Path(path_or_name)
    try:
        if path.suffix in FILE_FORMATS:
            if not path.is_file():
                raise FileNotFoundError(f"dataset file {path} does not exist (dataset_name); check the path")
            if path.stat().st_size == 0:
                raise DataError(f"dataset file {path} is empty; it needs rows with a 'prompt'")
            if path.suffix == ".jsonl":
                check_jsonl(path)
            ds = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train")
        elif path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path_or_name, config_name, split=split)
    except (DataError, FileNotFoundError):
        raise
    except Exception as exc:  # noqa: BLE001 - the datasets library's own errors name neither the file's fix nor our options
        if path.is_dir():
            raise DataError(
                f"dataset folder {path} could not be loaded ({type(exc).__name__}: {exc}); give a folder written by "
                "Dataset.save_to_disk, one of data files that datasets.load_dataset reads, or a .jsonl/.json/.parquet/.csv file"
            ) from exc
        raise DataError(f"dataset {path_or_name} could not be loaded ({type(exc).__name__}: {exc})") from exc
    ds = swift_messages(ds)
    validate_rows(ds, path_or_name)
    return ds


def swift_messages(ds):
    """ms-swift's row format, a `messages` column and no `prompt`: the messages before a last
    assistant answer are the prompt (the answer stays, as the column `messages`, for rewards)."""
    if "prompt" in ds.column_names or "messages" not in ds.column_names:
        return ds

    def prompt(row):
        messages = row["messages"]
        return {"prompt": messages[:-1] if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant" else messages}

    return ds.map(prompt)


def sample_rows(ds, n: int, seed: int):
    """ms-swift's `dataset#n` (swift/dataset/utils.py sample_dataset): every row n // len times
    over, then n % len rows drawn without replacement, seeded."""
    import numpy as np

    repeats, rest = divmod(n, len(ds))
    picked = np.random.RandomState(seed).permutation(len(ds))[:rest]
    return ds.select([*range(len(ds))] * repeats + picked.tolist())


def check_jsonl(path: Path) -> None:
    """Each non-empty line one JSON object in UTF-8 without repeated keys, or an error naming the
    line (the datasets library names none, or fails later on a row it cannot merge)."""

    def unique(pairs):
        keys = [k for k, _ in pairs]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise DataError(f"key {repeated[0]!r} appears twice")
        return dict(pairs)

    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"dataset file {path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=unique)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); a .jsonl file holds one JSON object per line") from None
            except DataError as exc:
                raise DataError(f"{where}: {exc}; give each key once") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a {type(row).__name__}, not a JSON object; each line holds one row as {{\"prompt\": ...}}")


ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_rows(rows, source: str) -> None:
    """Fail early, naming the row, on anything the formatter would trip over later."""
    columns = rows.column_names
    if "prompt" not in columns:
        raise DataError(f"dataset {source} has no 'prompt' column (columns: {columns}); rename the prompt column to 'prompt'")
    if len(rows) == 0:
        raise DataError(f"dataset {source} has no rows")
    if "tools" in columns:
        raise DataError(f"dataset {source} has a 'tools' column: tools are not read per row (nor are they by TRL's GRPOTrainer); "
                        "give them to every prompt with the tools option, and rename the column if it is for reward functions")  # fmt: skip
    for i, prompt in enumerate(rows["prompt"]):
        check_prompt(prompt, f"dataset {source}, row {i}")


def check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: 'prompt' is an empty string")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataError(
            f"{where}: 'prompt' must be a string or a non-empty list of messages "
            f"[{{'role': ..., 'content': ...}}], got {type(prompt).__name__}"
        )
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {j} must be a dict with string 'role' and 'content', got {message!r}")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has role {message['role']!r}; chat templates know {', '.join(ROLES)}")
        calls = message.get("tool_calls")  # None where other rows have it (datasets fills missing keys so)
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                                     and isinstance(c["function"].get("name"), str) for c in calls)):  # fmt: skip
            raise DataError(f"{where}: message {j}'s tool_calls must be a list of {{'type': 'function', 'function': {{'name': ..., "
                            f"'arguments': {{...}}}}}}, got {calls!r:.200}")  # fmt: skip
