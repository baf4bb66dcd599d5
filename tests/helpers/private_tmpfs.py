"""Whether this machine lets a test mount a small tmpfs in a private user and mount namespace (a full disk)."""

import shutil
import subprocess


def can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0
