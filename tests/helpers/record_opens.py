"""Run train_full_sft.py while recording every file this process opens, for writing and for reading.

Used by the tests as the torchrun entry point: an audit hook (no mock, the real trainer runs)
collects the paths written (opened for writing, renamed, made, removed), which each rank dumps into
$MINISFT_WRITE_REPORT/rank<RANK>.json on exit, and writes each path opened for reading to
rank<RANK>.reads.txt as it is opened, one a line (a refused distributed run leaves by os._exit:
what was read is there).
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

RANK = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # srun's tasks have SLURM_PROCID alone
written: set[str] = set()


def _audit(event: str, args) -> None:
    if event == "open" and isinstance(args[0], str):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags and flags & (os.O_WRONLY | os.O_RDWR)):
            written.add(os.path.abspath(args[0]))
        else:
            reads.write(os.path.abspath(args[0]) + "\n")
            reads.flush()
    elif event in ("os.rename", "os.mkdir", "os.remove", "shutil.rmtree"):
        for path in args[:2]:
            if isinstance(path, (str, bytes)):
                written.add(os.path.abspath(os.fsdecode(path)))


if __name__ == "__main__":
    report = os.environ["MINISFT_WRITE_REPORT"]
    reads = open(os.path.join(report, f"rank{RANK}.reads.txt"), "w", encoding="utf-8")
    sys.addaudithook(_audit)
    import train_full_sft

    code = 1
    try:
        code = train_full_sft.main(sys.argv[1:])
    finally:
        with open(os.path.join(report, f"rank{RANK}.json"), "w") as handle:
            json.dump(sorted(written), handle)
    sys.exit(code)
