"""scripts/chat.py with --prompt prints exactly the answer the model was trained on."""

from tests.helpers.overfitted import CONVERSATIONS, script


def test_chat_prompt_prints_exactly_the_trained_answer(trained):
    system, question, answer = (m["content"] for m in CONVERSATIONS[0])
    result = script("chat.py", "--model_path", str(trained["run_dir"]), "--prompt", question, "--system", system,
                    "--temperature", "0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer + "\n"
