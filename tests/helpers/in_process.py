"""A command's main() run in the test's own process, as its process would run it: its exit status,
stdout and stderr as a `subprocess.CompletedProcess`, without a process start (torch's import).

What a process would take with it when it ends is put back: the working directory, the environment,
the SIGTERM and SIGINT handlers (the trainer installs its own) and torch's thread count."""

import contextlib
import io
import os
import signal
import subprocess

import torch


def run_in_process(argv: list[str], call, cwd=None, threads: int | None = None) -> subprocess.CompletedProcess:
    """`call()` (returns an exit status or raises SystemExit) with stdout and stderr captured, in `cwd`
    and on `threads` torch threads when given; `argv` names the command in the result."""
    here, environ, num_threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    out, err = io.StringIO(), io.StringIO()
    try:
        if cwd is not None:
            os.chdir(cwd)
        if threads is not None:
            torch.set_num_threads(threads)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = call()
    except SystemExit as stop:
        code = stop.code
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(num_threads)
        for number, handler in handlers.items():
            signal.signal(number, handler)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
