"""Run train_full_sft.py while recording every file this process opens for writing.

Used by the tests as the torchrun entry point: an audit hook (no mock, the real trainer runs)
collects written paths under the save dir, and each rank dumps its list into
$MINISFT_WRITE_REPORT/rank<RANK>.json on exit.
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

written: set[str] = set()


def _audit(event: str, args) -> None:
    if event == "open" and isinstance(args[0], str):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags and flags & (os.O_WRONLY | os.O_RDWR)):
            written.add(os.path.abspath(args[0]))
    elif event in ("os.rename", "os.mkdir", "os.remove", "shutil.rmtree"):
        for path in args[:2]:
            if isinstance(path, (str, bytes)):
                written.add(os.path.abspath(os.fsdecode(path)))


if __name__ == "__main__":
    sys.addaudithook(_audit)
    import train_full_sft

    code = 1
    try:
        code = train_full_sft.main(sys.argv[1:])
    finally:
        report = os.environ["MINISFT_WRITE_REPORT"]
        with open(os.path.join(report, f"rank{os.environ.get('RANK', '0')}.json"), "w") as handle:
            json.dump(sorted(written), handle)
    sys.exit(code)
