"""A resume checkpoint whose model tensors are not the run's model's (some left out, some added): one line
counting and naming them, from the check every weights loader shares (trainer/weights/read.py:misfit)."""

import pytest
import torch

from model import MiniMindForCausalLM
from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from trainer.errors import CheckpointError
from trainer.weights.read import EMBED, LM_HEAD, build_config, load_into, read_weights


def test_a_checkpoint_without_a_layer_or_with_an_extra_tensor_is_one_line_naming_them(data, tmp_path):
    run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "8", "--max_steps", "1"), check=True)
    saved = torch.load(checkpoint_at(tmp_path / "run", 1), weights_only=True)
    left_out = [key for key in saved["model"] if key.startswith("model.layers.1.")]
    for key in left_out:
        del saved["model"][key]
    saved["model"]["model.extra.weight"] = torch.zeros(2)
    damaged = tmp_path / "damaged.pt"
    torch.save(saved, damaged)
    problems = (f"missing {len(left_out)} tensors ({', '.join(left_out[:3])}, ...); unexpected 1 tensor "
                "(model.extra.weight)")
    assert len(left_out) > 3
    refused = run_trainer_in_process(flags(data, tmp_path / "resumed", "--batch_size", "8", "--max_steps", "2",
                                           "--resume_from", str(damaged)))
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == f"error: resume checkpoint does not fit this run: {problems}"
    weights = read_weights(str(damaged))  # --from_weight, chat, eval and export: the same parts
    with pytest.raises(CheckpointError) as caught:
        load_into(MiniMindForCausalLM(build_config(weights)), weights)
    assert str(caught.value) == f"resume checkpoint {damaged} does not fit its model config: {problems}"


def test_a_tied_checkpoint_resumes_into_a_tied_model_and_a_tie_that_the_tensors_or_the_model_break_is_one_line(
        data, tmp_path):
    run_trainer_in_process(flags(data, tmp_path / "tied", "--batch_size", "8", "--max_steps", "1"), check=True)
    saved = torch.load(checkpoint_at(tmp_path / "tied", 1), weights_only=True)
    assert saved["model_config"]["tie_word_embeddings"] and torch.equal(saved["model"][LM_HEAD], saved["model"][EMBED])
    resume = ["--batch_size", "8", "--max_steps", "2", "--resume_from"]

    # Without its lm_head.weight (the embedding, for a tied model): resumed, the head is the embedding.
    torch.save({**saved, "model": {k: v for k, v in saved["model"].items() if k != LM_HEAD}}, tmp_path / "headless.pt")
    run_trainer_in_process(flags(data, tmp_path / "headless", *resume, str(tmp_path / "headless.pt")), check=True)
    final = torch.load(checkpoint_at(tmp_path / "headless", 2), weights_only=True)["model"]
    assert torch.equal(final[LM_HEAD], final[EMBED])

    # A config that ties an lm_head.weight of its own to the embedding: one line, not one of the two lost.
    apart = {**saved["model"], LM_HEAD: saved["model"][LM_HEAD] + 1}
    torch.save({**saved, "model": apart}, tmp_path / "apart.pt")
    refused = run_trainer_in_process(flags(data, tmp_path / "apart", *resume, str(tmp_path / "apart.pt")))
    assert (refused.returncode, refused.stderr.splitlines()) == (2, [
        "error: resume checkpoint does not fit this run: lm_head.weight differs from model.embed_tokens.weight, "
        "which is the same tensor in a model with tie_word_embeddings"])

    # A tied checkpoint into an untied model (--from_weight of untied weights), and the reverse: one line.
    torch.save(apart, tmp_path / "untied.pt")
    untied = ["--from_weight", str(tmp_path / "untied.pt")]
    into_untied = run_trainer_in_process(flags(data, tmp_path / "into_untied", *untied, *resume,
                                               checkpoint_at(tmp_path / "tied", 1)))
    run_trainer_in_process(flags(data, tmp_path / "untied", *untied, "--batch_size", "8", "--max_steps", "1"),
                           check=True)
    into_tied = run_trainer_in_process(flags(data, tmp_path / "into_tied", *resume, checkpoint_at(tmp_path / "untied", 1)))
    for result, (before, now) in ((into_untied, (True, False)), (into_tied, (False, True))):
        assert (result.returncode, result.stderr.splitlines()) == (2, [
            f"error: checkpoint model config differs from the flags: tie_word_embeddings (checkpoint {before}, "
            f"flags {now})"])


def test_a_resume_whose_optimizer_state_runs_out_of_device_memory_says_so_not_that_it_does_not_fit(
        data, tmp_path, monkeypatch):
    """The moments move to the device last, where another process may hold the memory they need: the
    one line of a device out of memory (exit 1), not a checkpoint that does not fit (exit 2). On the CPU
    (torch's CPU allocator's error) it names no GPU tool and no sharding over processes that share the host."""
    from trainer.parallel.ddp import Replicated

    run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "8", "--max_steps", "1"), check=True)

    def out_of_memory(self, optimizer, saved):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(Replicated, "load_training_state", out_of_memory)
    refused = run_trainer_in_process(flags(data, tmp_path / "resumed", "--batch_size", "8", "--max_steps", "2",
                                           "--resume_from", checkpoint_at(tmp_path / "run", 1)))
    assert (refused.returncode, refused.stderr.splitlines()) == (1, [
        "error: loading the resume checkpoint's optimizer state ran out of memory on cpu (DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)): the "
        "weights, their gradients and AdamW's moments need about 16 bytes a parameter there; another process may "
        "hold the rest of its memory (top shows which)"])


def test_a_resume_out_of_gpu_memory_names_nvidia_smi_and_sharding_over_more_gpus():
    from trainer.loop.out_of_memory import resume_out_of_memory

    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.06 GiB is free. Including non-PyTorch memory, this process has 12.00 GiB memory in use.")
    assert resume_out_of_memory(torch.device("cuda", 0), error) == (
        "loading the resume checkpoint's optimizer state ran out of memory on cuda:0 (CUDA out of memory. "
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free.): the "
        "weights, their gradients and AdamW's moments need about 16 bytes a parameter there; another process may "
        "hold the rest of its memory (nvidia-smi shows which), or train with more processes and --fsdp 1 to shard "
        "them")
