"""Write docs/flags.md, the table of every flag of train_full_sft.py, from its argument parser.

    python scripts/write_flags_doc.py

Run it after adding or changing a flag in trainer/args.py; tests/test_docs.py fails while
docs/flags.md differs from what this writes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import REPO_DIR, run_main  # noqa: E402
from trainer.args import flags_markdown  # noqa: E402

FLAGS_DOC = REPO_DIR / "docs" / "flags.md"


def main() -> None:
    FLAGS_DOC.write_text(flags_markdown(), encoding="utf-8", newline="\n")
    print(f"wrote {FLAGS_DOC.relative_to(REPO_DIR)}")


if __name__ == "__main__":
    run_main(main)
