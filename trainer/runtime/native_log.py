"""torch's C++ log lines without the C++ stack frames they carry.

While a process waits for its peers, torch's store client logs each failed attempt to reach the
rendezvous address ("[c10d] TCP client failed to connect ... retrying"), and each such line is
followed by the exception's native stack: twenty lines of `frame #N: c10::...` per attempt. The
headline says what happened; the frames say where in libtorch, which no user of the trainer acts
on. `native_frames_dropped` passes everything written to the process's stderr (fd 2, where the
C++ logger writes) through a filter that leaves those frames out, line by line as they come.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

NATIVE_FRAME = re.compile(rb"^(frame #\d+: |Exception raised from .* \(most recent call first\):|<omitting python frames>)")


def without_native_frames(lines):
    """The lines (bytes, each with its newline) less native stack frames and the blank line that
    closes a run of them."""
    in_frames = False
    for line in lines:
        if NATIVE_FRAME.match(line):
            in_frames = True
            continue
        if in_frames and not line.strip():
            in_frames = False
            continue
        in_frames = False
        yield line


@contextlib.contextmanager
def native_frames_dropped():
    """Within the block, fd 2 is a pipe; a thread writes what comes through it to the real stderr,
    native stack frames left out. Python's own writes to sys.stderr pass unchanged."""
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward():
        with os.fdopen(read_end, "rb") as pipe:
            for line in without_native_frames(pipe):
                try:
                    while line:
                        line = line[os.write(real, line):]
                except OSError:  # no stderr to write to: the pipe is still read, so no writer blocks
                    pass

    forwarder = threading.Thread(target=forward, name="native-log-filter", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the forwarder reads to its end
        forwarder.join()
        os.close(real)
