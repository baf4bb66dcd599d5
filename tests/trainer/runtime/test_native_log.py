"""trainer/runtime/native_log.py: torch's C++ log lines reach stderr without their native stack frames."""

import os
import subprocess
import sys

from tests.helpers.trainer_launch import REPO
from trainer.runtime.native_log import native_frames_dropped, without_native_frames

ATTEMPT = (
    "[W1126 22:54:51.452101093 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
    "127.0.0.1:29519 - retrying (try=0, timeout=3000ms, delay=3152ms): The client socket has timed out\n"
    "Exception raised from throwTimeoutError at /__w/pytorch/torch/csrc/distributed/c10d/socket.cpp:1030 "
    "(most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f80ca579b8d in libc10.so)\n"
    "frame #1: <unknown function> + 0x1630503 (0x7f80b7030503 in libtorch_cpu.so)\n"
    "<omitting python frames>\n"
    "frame #37: _start + 0x21 (0x55e9d4440081 in python)\n"
    "\n"
)
TIMED_OUT = "[E1126 22:54:57.601238567 TCPStore.cpp:328] [c10d] TCP client failed - timed out (try=1)\n"


def test_frames_and_the_blank_line_after_them_are_left_out_and_every_other_line_kept():
    lines = (ATTEMPT + ATTEMPT + "\n" + TIMED_OUT + "error: rank 1: ...\n").encode().splitlines(keepends=True)
    assert b"".join(without_native_frames(lines)).decode() == (
        ATTEMPT.splitlines(keepends=True)[0] * 2 + "\n" + TIMED_OUT + "error: rank 1: ...\n")


def test_what_is_written_to_fd_2_within_the_block_comes_out_filtered_and_in_order(capfd):
    with native_frames_dropped():
        os.write(2, ATTEMPT.encode())
        os.write(2, TIMED_OUT.encode())
    os.write(2, b"after\n")
    assert capfd.readouterr().err == ATTEMPT.splitlines(keepends=True)[0] + TIMED_OUT + "after\n"


def test_a_stderr_that_takes_nothing_fails_no_writer_within_the_block():
    """The real stderr a closed pipe: the forwarder keeps reading its pipe, so 100 KB written to fd 2
    within the block (more than a pipe holds) neither block the writer nor fail it."""
    code = (
        "import os\n"
        "from trainer.runtime.native_log import native_frames_dropped\n"
        "read_end, write_end = os.pipe(); os.close(read_end); os.dup2(write_end, 2)\n"
        "with native_frames_dropped():\n"
        "    for _ in range(100):\n"
        "        os.write(2, b'x' * 1023 + b'\\n')\n"
        "print('done')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "done\n")
