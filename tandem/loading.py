"""Loading a user's object named "path/to/file.py:name" or "package.module:name" (reward
functions, tools, environments), with errors that name the option it came from."""

import ast
import importlib
import importlib.util
import pickle
import sys
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


def spawn_problem(obj) -> str | None:
    """Why worker processes, which are spawned, cannot have `obj` (pickled by reference to a module
    they import, the script's included), or None where they can."""
    try:
        pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - pickle's errors are of many kinds; each means the same here
        return f"it cannot be pickled ({exc})"
    if getattr(obj, "__module__", type(obj).__module__) != "__main__":
        return None
    script = getattr(sys.modules["__main__"], "__file__", None)
    if script is None:
        return "it is defined in an interactive session, which worker processes cannot import"
    if not _guarded(Path(script)):
        return (f"it is defined in {script}, whose top level would run again in each worker (spawned processes import the script): "
                'put what the script runs under `if __name__ == "__main__":`, or the function in a module of its own')  # fmt: skip
    return None


def _guarded(script: Path) -> bool:
    """Whether the script's top level has an `if __name__ == "__main__":` block."""
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
            if any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators):
                return True
    return False
