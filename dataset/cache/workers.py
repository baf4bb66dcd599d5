"""Worker processes that run one function over a stream of tasks, each on pipes of its own.

``multiprocessing.Pool`` gives all its workers one task queue and one result queue, each guarded
by a lock the processes share. A worker killed while it holds one (a SIGTERM to the process
group that lands while it sends a result) leaves that lock taken for good, and
``Pool.terminate()`` then waits on it forever (the build's "signal to the group" test can hang
that way when workers send results often). Here nothing is shared:

- worker ``i`` reads its tasks from a pipe of its own and writes its results to another; task
  number ``n`` goes to worker ``n % size``, so each pipe carries its worker's results in order;
- one thread of the parent sends the tasks, in order, so the parent's main thread never waits
  on a full task pipe while that worker waits on its full result pipe;
- while the parent waits for a result it reads whatever any worker has ready;
- the workers ignore SIGTERM and SIGINT: stopping is the parent's decision (it kills them with
  SIGKILL, which cannot leave anything behind), and a worker whose parent is gone sees its task
  pipe end and exits;
- a worker that dies all the same (the kernel's out-of-memory killer, a crash) is seen as the
  end of its result pipe and raises ``WorkerDied`` in the parent, instead of a wait without end.

An exception raised by the function in a worker is raised again in the parent, with the worker's
traceback attached as its cause, as ``multiprocessing.Pool`` does. How many workers by default:
one per core this process may run on (``default_num_proc``, from ``usable_cores``).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import util
from multiprocessing.connection import wait

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_CAN_HOLD_SIGNALS = hasattr(signal, "pthread_sigmask")  # not on Windows


def usable_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity: a job's share of the machine)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return set(range(os.cpu_count() or 1))


def default_num_proc() -> int:
    """One worker process per core this process may run on."""
    return max(1, len(usable_cores()))


class WorkerDied(RuntimeError):
    """A worker process ended while it owed results (killed from outside, or crashed)."""

    def __init__(self, what: str, pid: int, exitcode: int | None):
        if exitcode is not None and exitcode < 0:
            how = f"was killed by {signal.Signals(-exitcode).name}"
            if -exitcode == signal.SIGKILL:
                how += " (out of memory?)"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"a worker process of {what} (pid {pid}) {how}; run the same command again")


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the cause of the one raised here)."""

    def __str__(self) -> str:
        return self.args[0]


def _rebuild(exc: BaseException, text: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(text)
    return exc


class _Carried:
    """An exception and its formatted traceback, unpickled as the exception with that cause."""

    def __init__(self, exc: BaseException):
        self.exc, self.text = exc, "".join(traceback.format_exception(exc))

    def __reduce__(self):
        return _rebuild, (self.exc, self.text)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGTERM/SIGINT stay pending (not lost) while workers are forked and threads started.

    A signal that lands during ``fork()`` runs its Python handler in the first Python code after
    it: an at-fork callback (``logging``'s ``_releaseLock``), whose exceptions CPython prints as
    "Exception ignored" and drops, so the handler's exception was lost. Held back, the signal is
    handled when the mask is restored. The sender thread keeps the mask (such signals then reach
    the main thread only); the workers ignore both signals before they lift it.
    """
    if not _CAN_HOLD_SIGNALS:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _serve(function: Callable, initializer: Callable | None, initargs: tuple, tasks, results, parent_ends) -> None:
    """A worker's life: tasks in, results out, until the task pipe ends."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if _CAN_HOLD_SIGNALS:  # forked with them held back (stop_signals_held)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for connection in parent_ends:  # else this worker's task pipe would not end with the parent
        connection.close()
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            task = tasks.recv()
        except EOFError:  # the parent closed it, or is gone
            return
        try:
            reply = (True, function(task))
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            reply = (False, _Carried(exc))
        try:
            results.send(reply)
        except OSError:  # the parent is gone
            return


def _default_context():
    """Fork where available (fast, no re-import of the caller's main module; the workers inherit
    what the parent decided before), else spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


class _Pending:
    def __init__(self, pool: WorkerPool, ticket: int):
        self.pool, self.ticket = pool, ticket

    def get(self):
        return self.pool.get(self.ticket)


class WorkerPool:
    """``size`` worker processes running ``function``; ``initializer(*initargs)`` runs in each first.

    ``submit(task).get()`` and ``imap(tasks)`` as with ``multiprocessing.Pool`` (one function);
    ``context``: a multiprocessing context (default: fork where available, else spawn);
    ``close()`` ends the workers (always call it: the workers are killed, nothing waits on them).
    """

    def __init__(self, function: Callable, size: int, initializer: Callable | None = None, initargs: tuple = (),
                 context=None, what: str = "the pool"):
        context = context or _default_context()
        self.size, self.what = size, what
        self._processes, self._task_pipes, self._result_pipes, self._threads = [], [], [], []
        self._owed: list[collections.deque] = [collections.deque() for _ in range(size)]
        self._done: dict[int, tuple[bool, object]] = {}
        self._submitted = 0
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_error: BaseException | None = None
        # Run before multiprocessing's exit handler, which would SIGTERM and join the workers: they
        # ignore SIGTERM, so a pool never closed (an exception on its way out) would hang the exit.
        self._finalizer = util.Finalize(self, _shut_down, exitpriority=10, args=(
            self._processes, self._task_pipes, self._result_pipes, self._outbox, self._threads))
        try:
            with stop_signals_held():  # a signal held back is raised when this block ends
                for _ in range(size):
                    task_reader, task_writer = context.Pipe(duplex=False)
                    result_reader, result_writer = context.Pipe(duplex=False)
                    self._task_pipes.append(task_writer)
                    self._result_pipes.append(result_reader)
                    parent_ends = self._task_pipes + self._result_pipes  # a worker closes its copies
                    process = context.Process(target=_serve, daemon=True, args=(
                        function, initializer, initargs, task_reader, result_writer, parent_ends))
                    self._processes.append(process)
                    process.start()
                    task_reader.close()
                    result_writer.close()
                self._threads.append(threading.Thread(target=self._send_tasks, name="worker-pool-sender", daemon=True))
                self._threads[0].start()
        except BaseException:
            self.close()
            raise

    def _send_tasks(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            ticket, task = item
            try:
                self._task_pipes[ticket % self.size].send(task)
            except OSError:  # that worker is gone: get() finds its result pipe ended
                pass
            except BaseException as exc:  # noqa: BLE001 - e.g. a task that cannot be pickled: get() raises it
                self._send_error = exc
                return

    def submit(self, task) -> _Pending:
        ticket = self._submitted
        self._submitted += 1
        self._owed[ticket % self.size].append(ticket)
        self._outbox.put((ticket, task))
        return _Pending(self, ticket)

    def get(self, ticket: int):
        """The result of task ``ticket``, reading every worker's ready results while it waits."""
        while ticket not in self._done:
            if self._send_error is not None:
                raise self._send_error
            busy = {self._result_pipes[i]: i for i in range(self.size) if self._owed[i]}
            for pipe in wait(list(busy), timeout=1.0):
                worker = busy[pipe]
                try:
                    reply = pipe.recv()
                except (EOFError, OSError):  # ended, or ended inside a message
                    process = self._processes[worker]
                    process.join(timeout=5)
                    raise WorkerDied(self.what, process.pid, process.exitcode) from None
                self._done[self._owed[worker].popleft()] = reply
        ok, value = self._done.pop(ticket)
        if not ok:
            raise value
        return value

    def imap(self, tasks: Iterable, window: int | None = None) -> Iterator:
        """The results of ``tasks`` in order, at most ``window`` tasks (default: two per worker) ahead."""
        window = window or 2 * self.size
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(self.submit(task))
            if len(pending) >= window:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        """Kill the workers and wait for them; results not taken are dropped."""
        self._finalizer()


def _shut_down(processes: list, task_pipes: list, result_pipes: list, outbox: queue.SimpleQueue, threads: list) -> None:
    outbox.put(None)
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            process.kill()
    for process in processes:
        if process.pid is not None:
            process.join()
    for thread in threads:
        if thread.ident is not None:
            thread.join()  # its sends to the killed workers fail at once
    for pipe in task_pipes + result_pipes:
        pipe.close()
