"""Prompt datasets: local files or a `datasets.load_dataset` name, checked row by row."""

from pathlib import Path

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompt_dataset(path_or_name: str, split: str = "train", config_name: str | None = None):
    """Load rows that each hold a `prompt` (a string or a list of chat messages) plus any columns.

    A local file by extension (.jsonl, .json, .parquet, .csv), a folder written by
    `Dataset.save_to_disk`, or else a name for `datasets.load_dataset` (which may need the network).
    """
    import datasets

    path = Path(path_or_name)
    if path.suffix in FILE_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist (dataset_name); check the path")
        ds = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train")
    elif path.is_dir() and (path / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(path_or_name, config_name, split=split)
    validate_rows(ds, path_or_name)
    return ds


def validate_rows(rows, source: str) -> None:
    """Fail early, naming the row, on anything the formatter would trip over later."""
    columns = rows.column_names
    if "prompt" not in columns:
        raise ValueError(f"dataset {source} has no 'prompt' column (columns: {columns}); rename the prompt column to 'prompt'")
    if len(rows) == 0:
        raise ValueError(f"dataset {source} has no rows")
    for i, prompt in enumerate(rows["prompt"]):
        check_prompt(prompt, f"dataset {source}, row {i}")


def check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: 'prompt' is an empty string")
        return
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: 'prompt' must be a string or a non-empty list of messages "
            f"[{{'role': ..., 'content': ...}}], got {type(prompt).__name__}"
        )
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {j} must be a dict with string 'role' and 'content', got {message!r}")
