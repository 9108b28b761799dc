"""Runs reproducers one after another in this process and prints how each ended (``python spec/repro/run_files.py
[--no-spec] PATH...``, run by :mod:`.measure` as a script by its path, so nothing of the suite is imported by it):
``EXIT <code> <how> <path>``, ``how`` being ``raised`` where the file printed that the engine raised (``FAIL <ID> ...
got <Error>: ...``, ``the packer raised <Error>``) and ``check`` where a check failed. With ``--no-spec`` first,
``spec`` cannot be imported. Imports nothing of the suite (a face: tests/test_layering.py)."""

from __future__ import annotations

import sys

# run as a script, its own folder (spec/repro) leads sys.path: its modules must not shadow anything a file imports
if __name__ == "__main__":
    del sys.path[0]

import contextlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402

#: how a file says the engine raised: "FAIL <ID> ...: got <Error>: ...", "the packer raised <Error>"
RAISED = re.compile(r"^FAIL \S+[^\n]*?(got|raised) \w*(Error|Exception)\b", re.M)


def run(path: str) -> tuple[int, str]:
    """Run ``path`` as ``__main__``: its exit code (3: it broke) and how it failed (``raised`` or ``check``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - a broken file: reported as 3
            print("ERROR", type(exc).__name__, exc)
            code = 3
    return code, "raised" if RAISED.search(out.getvalue()) else "check"


def main(args: list[str]) -> int:
    if args and args[0] == "--no-spec":
        sys.modules["spec"] = None  # any import of the suite fails
        args = args[1:]
    for path in args:
        code, how = run(path)
        print("EXIT", code, how, path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
