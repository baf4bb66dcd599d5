"""Files that survive a crash: atomic writes (temporary name, fsync, rename) and the one safe reader
of torch files (`torch.load(weights_only=True)`, never runs code stored in a file).

A crash or a full disk in the middle of a write never damages the file that was already there;
temporary files that a killed process left behind (`*.tmp.<pid>`) are removed by the next save."""

import os
import pickle
import re
import zipfile

import torch

from trainer.errors import CheckpointError, first_line


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def default_file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file: 0o666 less this process's umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:  # reads the umask without changing it
            for line in handle:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: the only other way to read it is to set it (and back at once)
    os.umask(mask)
    return 0o666 & ~mask


def settle_files(folder: str) -> None:
    """Give every file in `folder` the mode of a plainly created file and fsync it, before the folder
    is renamed into place. Some writers (safetensors) create their files 0600, which would keep
    every other user from reading a model meant to be shared."""
    mode = default_file_mode()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, mode)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


class _WriteErrorRecorder:
    """A write-only file wrapper for `torch.save`, which reports a failed write (disk full, file size
    limit) only as "unexpected pos ..."; this keeps the OSError so the message can name the cause."""

    def __init__(self, handle):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.handle.flush()


def write_failure(error: BaseException) -> str | None:
    """The one-line reason when `error` is a failed write (disk full, file size limit, permissions),
    else None. Besides OSError, the Rust writers report one as a bare Exception or SafetensorError
    whose message ends in "(os error N)": tokenizers' `Tokenizer.save`, safetensors' `save_file`."""
    if isinstance(error, OSError):
        return error.strerror or first_line(error)
    found = re.search(r"\(os error (\d+)\)", str(error)) if isinstance(error, Exception) else None
    if found:
        return os.strerror(int(found.group(1)))
    if type(error).__name__ == "SafetensorError":
        return first_line(error)
    return None


def remove_stale_temporaries(folder: str) -> None:
    """Delete `*.tmp.<pid>` files of saves that a crash (kill -9, power loss) interrupted."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if ".tmp." in name:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def atomic_torch_save(obj, path: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    recorder = None
    try:
        with open(tmp, "wb") as handle:
            recorder = _WriteErrorRecorder(handle)
            torch.save(obj, recorder)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(folder)
    except BaseException as error:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = (recorder.error if recorder else None) or error
        if isinstance(cause, OSError):
            raise CheckpointError(f"could not write {path}: {cause.strerror or cause}") from error
        raise




def safe_torch_load(path: str, label: str = "", mmap: bool | None = None):
    """`torch.load(weights_only=True)` of `path` with one-line errors; `label` names the kind of file
    in them (e.g. "resume checkpoint "). A zip archive (what torch.save writes) is memory-mapped
    unless `mmap` says otherwise."""
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{label}{path} is empty")
    archive = zipfile.is_zipfile(path)  # anything else is a raw pickle at best
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=archive if mmap is None else mmap and archive)
    except pickle.UnpicklingError as error:
        if names_a_forbidden_object(str(error)):
            raise CheckpointError(
                f"refused to load {path}: it contains Python objects that a safe (weights_only) load does "
                "not allow; it is not a minisft checkpoint and may be malicious"
            ) from error
        raise CheckpointError(f"{label}{path} is corrupt or truncated ({_damage(error, archive)})") from error
    except Exception as error:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{label}{path} is corrupt or truncated ({_damage(error, archive)})") from error


def names_a_forbidden_object(message: str) -> bool:
    """Whether the weights-only unpickler stopped at a real global or reduce (a pickled object that
    would run code), not at bytes that are no pickle at all (a JSON or text file, say)."""
    return "Weights only load failed" in message and any(
        marker in message for marker in ("GLOBAL", "REDUCE", "reduce", "Can only create new object", "Can only build"))


def _damage(error: BaseException, archive: bool) -> str:
    if not archive:
        return "not a torch checkpoint: no complete zip archive in it"
    return f"{type(error).__name__}: {first_line(error, 160)}"
