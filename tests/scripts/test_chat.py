"""scripts/chat.py with --prompt prints exactly the answer the model was trained on; a bad --temperature is one line."""

from tests.helpers.overfitted import CONVERSATIONS, script, script_in_process


def test_chat_prompt_prints_exactly_the_trained_answer(trained):
    system, question, answer = (m["content"] for m in CONVERSATIONS[0])
    result = script("chat.py", "--model_path", str(trained["run_dir"]), "--prompt", question, "--system", system,
                    "--temperature", "0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer + "\n"


def test_a_temperature_that_is_not_a_finite_number_is_refused_before_the_model_loads(tmp_path):
    # nan would decode greedily (nan > 0 is false) and inf sample every token uniformly.
    for value in ("nan", "inf", "-1"):
        done = script_in_process("chat.py", "--model_path", str(tmp_path / "none"), "--prompt", "hi",
                                 "--temperature", value)
        assert (done.returncode, done.stderr) == (2, f"error: --temperature must be a finite number >= 0, got "
                                                     f"{float(value)}\n")


def test_a_seed_or_a_token_count_outside_the_trainers_range_is_refused_in_one_line(tmp_path):
    # torch.manual_seed would raise "Overflow when unpacking long long"
    done = script_in_process("chat.py", "--model_path", str(tmp_path / "none"), "--prompt", "hi", "--seed", str(2**64))
    assert (done.returncode, done.stderr) == (2, f"error: --seed must be <= {2**32 - 1} (got {2**64})\n")
    done = script_in_process("chat.py", "--model_path", str(tmp_path / "none"), "--prompt", "hi", "--max_new_tokens", "0")
    assert (done.returncode, done.stderr) == (2, "error: --max_new_tokens must be >= 1 (got 0)\n")


def test_a_temperature_between_0_and_the_least_one_is_refused_before_the_model_loads(tmp_path):
    # 1e-40 overflows the logits divided by it to inf: a torch error at the first token, not an answer
    for value in ("1e-40", "0.009"):
        done = script_in_process("chat.py", "--model_path", str(tmp_path / "none"), "--prompt", "hi",
                                 "--temperature", value)
        assert (done.returncode, done.stderr) == (2, f"error: --temperature must be 0 (greedy decoding) or at least "
                                                     f"0.01, got {float(value)}\n")
