"""The tests' `python SCRIPT ARGS` (the trainer, its fault-planting wrapper, the forked launcher) as a
process forked from one that imported the trainer once.

A fresh process spends about 6 CPU-seconds on the test machines importing torch and transformers
before the trainer's first line runs. A test process (each pytest-xdist worker) starts one server,
`python warm_start.py`, which imports the trainer and waits on a Unix socket; each run it is asked
for is forked from it, so the import is paid once per test process instead of once per run.

What a run sees is what `subprocess.Popen([sys.executable, script, *args], cwd=, env=, stdout=,
stderr=)` would give it: its own process (in a session of its own), `sys.argv`, the working
directory, the environment, stdin from /dev/null, stdout and stderr to their own files, the script
run as `__main__`, and the interpreter's exit (non-daemon threads joined, atexit handlers, exit
code; a signal that kills it reads as `-signal`, as Popen reports it). What it shares with the
server is what the import did: a run whose environment differs from the server's in a variable
read at import time (PYTHON*, locale, thread counts, CUDA_VISIBLE_DEVICES, ...), or that may see a
GPU, is started as a fresh process instead (`can_warm_start`).

`WarmProcess` answers as a `subprocess.Popen` does (`communicate`, `poll`, `wait`, `kill`)."""

import atexit
import io
import json
import locale
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Read when torch, transformers or the interpreter start: a run must match the server in these.
IMPORT_TIME = ("PYTHON", "LANG", "LC_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_", "TORCH_LOGS", "TRANSFORMERS",
               "HF_", "TOKENIZERS", "LD_", "MALLOC")


def import_time_variables(env: dict) -> dict:
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME)}


class Server:
    """This test process's warm server (started on first use, ended with this process)."""

    _lock = threading.Lock()
    _started: "Server | None" = None

    def __init__(self, env: dict):
        self.folder = tempfile.mkdtemp(prefix="warm-start-")
        self.address = os.path.join(self.folder, "socket")
        self.env = dict(env)
        # stdin: the server ends when it reads EOF there, that is when this process ends, however it ends.
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.address], cwd=REPO,
                                        env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm-start server did not start: {ready!r} (exit {self.process.poll()})")
        atexit.register(self.stop)

    @classmethod
    def get(cls, env: dict) -> "Server":
        """The server, started with `env` on first use."""
        with cls._lock:
            if cls._started is None or cls._started.process.poll() is not None:
                cls._started = Server(env)
            return cls._started

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def can_warm_start(env: dict, server_env: dict) -> bool:
    """Whether a run with `env` may fork from a server started with `server_env`: the same variables
    read at import time, and no GPU to see (a fork of a process whose import may have touched the
    CUDA driver cannot use it; the GPU tests, run with the GPUs shown, start fresh processes)."""
    return env.get("CUDA_VISIBLE_DEVICES") == "" and import_time_variables(env) == import_time_variables(server_env)


class WarmProcess:
    """`python script ARGS` forked from the warm server, with Popen's interface for waiting on it."""

    def __init__(self, server: Server, script: str, args: list[str], cwd: str, env: dict, stdout=None, stderr=None):
        self.args = [sys.executable, script, *args]
        self.returncode = None
        self._files = [stdout or tempfile.TemporaryFile(), stderr or tempfile.TemporaryFile()]
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.connect(server.address)
        request = json.dumps({"script": script, "args": list(args), "cwd": os.path.abspath(cwd), "env": dict(env)})
        socket.send_fds(self._socket, [request.encode()], [file.fileno() for file in self._files])
        self.pid = int(self._socket.recv(64))

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._socket], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._socket], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        status = self._socket.recv(64)
        self._socket.close()
        # no status: the supervising fork itself was killed; the run's end is unknown
        self.returncode = int(status) if status else -signal.SIGKILL

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._text(self._files[0]), self._text(self._files[1])

    @staticmethod
    def _text(file) -> str:
        # as subprocess's text mode reads a pipe: the locale's encoding, universal newlines
        file.seek(0)
        return io.TextIOWrapper(file, encoding=locale.getpreferredencoding(False)).read()

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        """SIGKILL to the run's session (the run and the processes it started)."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(script: str, args: list[str], cwd: str, env: dict, server_env: dict, stdout=None, stderr=None):
    """`python script ARGS` in `cwd` with `env`, in a session of its own: a WarmProcess where the
    server's import fits `env`, else a fresh `subprocess.Popen`. Its stdout and stderr go to the
    files `stdout` and `stderr` where given, else `communicate` returns them as text. `server_env`:
    the environment the server starts with on first use (the runs' usual one)."""
    if can_warm_start(env, server_env):  # else no server is started for it
        server = Server.get(server_env)
        if can_warm_start(env, server.env):
            return WarmProcess(server, script, args, cwd, env, stdout, stderr)
    return subprocess.Popen([sys.executable, script, *args], cwd=cwd, env=env, stdout=stdout or subprocess.PIPE,
                            stderr=stderr or subprocess.PIPE, text=True, start_new_session=True)


def run(script: str, args: list[str], cwd: str, env: dict, server_env: dict,
        timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, script, *args], cwd=, env=, capture_output=True, text=True,
    timeout=)` through `start`: a run still going at `timeout` is killed and TimeoutExpired raised."""
    process = start(script, args, cwd, env, server_env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


# --- the server side: `python warm_start.py SOCKET` ---------------------------------------------

def serve(address: str) -> None:
    sys.path[0] = REPO  # this file's folder, as a fresh run's sys.path would not hold it
    import train_full_sft  # noqa: F401  (the import every run shares)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    supervisors = set()
    while True:
        readable = select.select([listener, sys.stdin], [], [], 1.0)[0]
        # Ended supervising forks are waited for, so that the runs' CPU time adds up in the test
        # process's, as a fresh process's does (SIGCHLD ignored would discard it).
        supervisors -= {pid for pid in supervisors if os.waitpid(pid, os.WNOHANG)[0]}
        if sys.stdin in readable:  # EOF: the test process that started this server has ended
            for pid in supervisors:
                os.waitpid(pid, 0)
            return
        if listener in readable:
            connection, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                listener.close()
                supervise(connection)
            supervisors.add(pid)
            connection.close()


def supervise(connection: socket.socket) -> None:
    """In a fork of the server: fork the run, tell the client its pid, wait for it, send its exit code."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_request(request, fds)
    for fd in fds:
        os.close(fd)
    connection.send(str(pid).encode())
    _, status = os.waitpid(pid, 0)
    connection.send(str(os.waitstatus_to_exitcode(status)).encode())
    os._exit(0)


def exit_code(stop: SystemExit) -> int:
    """The exit code the interpreter gives an uncaught `stop`; a message (not a number) goes to stderr first."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run_request(request: dict, fds: list[int]) -> None:
    """In the run's fork: become `python script ARGS` and end as the interpreter would."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(source, target)
    for fd in (null, *fds):
        os.close(fd)
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(sys.argv[1])
