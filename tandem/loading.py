"""Loading a user's object named "path/to/file.py:name" or "package.module:name" (reward
functions, tools, environments), with errors that name the option it came from."""

import importlib
import importlib.util
from pathlib import Path

_FILE_MODULES: dict[Path, object] = {}


GIVEN = "object:"  # the spec of an object the Python API was given (GRPOTrainer's tools=...), held by the run, not loadable


def load_object(spec: str, option: str, kind: str = "function", given: dict | None = None):
    """The object `spec` names (or `given` holds, for an object spec); `option` (e.g. "reward_funcs
    entry") and `kind` word the errors."""
    if spec.startswith(GIVEN):
        if spec not in (given or {}):
            raise ValueError(f"{option} {spec!r} was given to GRPOTrainer as an object: give it there again, or here as 'path/to/file.py:{kind}'")
        return given[spec]
    if ":" not in spec:
        raise ValueError(f"{option} {spec!r} is not of the form 'path/to/file.py:{kind}' or 'package.module:{kind}'")
    where, name = spec.rsplit(":", 1)
    obj = getattr(load_module(where, f"{option} {spec!r}"), name, None)
    if not callable(obj):
        raise ValueError(f"{option} {spec!r}: {where} has no {kind} {name!r}")
    return obj


def load_module(where: str, named: str):
    """The module of a file ("path/to/file.py", run once) or of an importable name; `named` (the
    option and its value) begins each error."""
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise FileNotFoundError(f"{named}: file {path} does not exist")
            return _file_module(path)
        return importlib.import_module(where)
    except SyntaxError as exc:
        raise ValueError(f"{named}: {exc.filename}, line {exc.lineno}: {exc.msg}") from None
    except (FileNotFoundError, ImportError):
        raise
    except Exception as exc:  # the file's own code, run at load, failed: a user's mistake, named as one
        raise ValueError(f"{named}: loading {where} raised {type(exc).__name__}: {exc}") from exc


def _file_module(path: Path):
    """The module of a user's file, run once: its functions share its globals, as after an import."""
    key = path.resolve()
    if key not in _FILE_MODULES:
        module_spec = importlib.util.spec_from_file_location(f"tandem_user_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]
