"""`threads_at_exit.py REPORT SCRIPT ARGS...`: runs SCRIPT as `__main__` with ARGS, and when the
interpreter exits (after every other atexit handler, the script's own included) writes the names of
the threads this process still has to REPORT.<RANK>.json (RANK from the environment, 0 without it).
A thread still running then runs into the interpreter's finalization."""

import atexit
import json
import os
import runpy
import sys


def thread_names() -> list[str]:
    """Every thread of this process by its kernel name (Python's, and those native code started)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as handle:
            names.append(handle.read().strip())
    return sorted(names)


def main(report: str, script: str, *args: str) -> None:
    def write() -> None:
        with open(f"{report}.{os.environ.get('RANK', '0')}.json", "w", encoding="utf-8") as handle:
            json.dump(thread_names(), handle)

    atexit.register(write)  # registered first: run last
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
