"""trainer/runtime/preemption.py: the stop flag the signal handlers set."""

import signal

import pytest

from trainer.runtime import preemption
from trainer.runtime.preemption import EXIT_INTERRUPTED, PreemptionFlag


class Exited(Exception):
    pass


def test_a_second_ctrl_c_stops_now_also_after_a_sigterm(monkeypatch, capfd):
    """A SIGTERM (a scheduler, a launcher passing a Ctrl-C on) asks for a save at the next step; the
    user's Ctrl-C then asks the same, and a second Ctrl-C stops the process at once."""
    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(preemption.os, "_exit", exit_now)
    flag = PreemptionFlag()
    flag._handle(signal.SIGTERM, None)
    flag._handle(signal.SIGINT, None)
    assert (flag.requested, flag.reason) == (True, "SIGTERM")
    with pytest.raises(Exited) as stopped:
        flag._handle(signal.SIGINT, None)
    assert stopped.value.args == (EXIT_INTERRUPTED,)
    assert capfd.readouterr().err.splitlines() == [
        "Ctrl-C: stopping at the next step boundary and saving (press Ctrl-C again to stop now)",
        "error: interrupted again (Ctrl-C): stopped now, without saving the steps since the last checkpoint"]
