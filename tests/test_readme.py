"""The README stays true: every flag is documented (docs/flags.md, linked from the README), and CI runs
the README's two commands verbatim."""

import os
import re

from trainer.args import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as handle:
        return handle.read()


def test_every_flag_of_the_trainer_is_documented():
    flags_doc = read("docs/flags.md")
    assert "](docs/flags.md)" in read("README.md"), "README.md does not link to docs/flags.md"
    flags = [option for action in build_parser()._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"]
    missing = [flag for flag in flags if f"`{flag}`" not in flags_doc]
    assert not missing, f"flags missing from docs/flags.md: {missing}"


def test_ci_runs_the_two_readme_commands_verbatim():
    readme, ci = read("README.md"), read(".ci/run")
    section = readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)[:2]
    assert len(commands) == 2 and all("pip install -r requirements.txt" in c for c in commands), commands
    for command in commands:
        assert command.strip() in ci, f"not in .ci/run: {command}"


def test_the_readme_stays_a_newcomers_page():
    """At most 15,000 bytes: reference tables belong in docs/, each in one place."""
    size = os.path.getsize(os.path.join(REPO, "README.md"))
    assert size <= 15_000, f"README.md is {size} bytes; move reference material to docs/"


def test_ci_keeps_an_earlier_demo_model_and_says_so(tmp_path):
    """.ci/run trains into out/demo as the README does: where a model is already there it stops
    before installing anything, and the model stays."""
    import shutil
    import subprocess

    (tmp_path / ".ci").mkdir()
    shutil.copy(os.path.join(REPO, ".ci", "run"), tmp_path / ".ci" / "run")
    (tmp_path / "out" / "demo").mkdir(parents=True)
    (tmp_path / "out" / "demo" / "metrics.jsonl").write_text("{}\n")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: out/demo exists (an earlier run's model): move it away, then run .ci/run again\n"
    assert (tmp_path / "out" / "demo" / "metrics.jsonl").read_text() == "{}\n"
