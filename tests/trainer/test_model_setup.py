"""trainer/model_setup.py in a run: which weights a run starts from (--from_weight against a
resume checkpoint) and which tokenizer goes with them."""

import os
import shutil

import pytest

from tests.helpers.trainer_launch import flags, run_trainer, run_trainer_in_process


def test_a_resume_checkpoint_wins_over_from_weight_and_the_log_says_so(data, tmp_path):
    # one-process runs whose printed lines are checked: train_full_sft.main in this process
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "2", "--save_interval", "1"), check=True)
    other = tmp_path / "other"  # weights of the same architecture, saved elsewhere
    run_trainer_in_process(flags(data, other, "--batch_size", "8", "--max_steps", "1", "--seed", "7"), check=True)
    resumed = run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "3", "--from_resume", "1",
                                           "--from_weight", str(other / "model")), check=True)
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("weights: ")]
    assert lines == [f"weights: those of the resume checkpoint (step 2); --from_weight {other / 'model'} is ignored: "
                     "the resume checkpoint's weights win"]
    # --from_resume 1 with no checkpoint yet: a fresh run from those weights, and the line says that instead
    fresh = run_trainer_in_process(flags(data, tmp_path / "fresh", "--batch_size", "8", "--max_steps", "1",
                                         "--from_resume", "1", "--from_weight", str(other / "model")), check=True)
    assert [line for line in fresh.stdout.splitlines() if line.startswith("weights: ")] == [
        f"weights: qwen3 model {other / 'model'}"]
    assert os.path.isdir(tmp_path / "fresh" / "model")


def custom_tokenizer(folder):
    """The shipped tokenizer with another chat template (a Jinja comment): the same vocabulary and
    size, another fingerprint."""
    from dataset import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = tokenizer.chat_template + "{#- a template of its own -#}"
    tokenizer.save_pretrained(str(folder))
    return folder


def tokenizer_of(argv):
    from trainer.args import parse_args
    from trainer.model_setup import load_tokenizer_for_weights, read_initial_weights

    args = parse_args(argv)
    messages = []
    weights = read_initial_weights(args, messages.append)
    tokenizer, path = load_tokenizer_for_weights(args, weights, messages.append)
    return tokenizer, path, messages


def test_from_weight_of_a_resume_checkpoint_follows_the_tokenizer_its_run_recorded(data, tmp_path):
    import shutil

    import pytest
    import torch

    from dataset import load_tokenizer
    from dataset.rendering import DEFAULT_TOKENIZER_DIR, tokenizer_fingerprint
    from tests.helpers.trainer_launch import checkpoint_at
    from trainer.errors import ConfigError

    tok = custom_tokenizer(tmp_path / "tok")
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "1", "--tokenizer_path", str(tok)),
                           check=True)
    step_1 = checkpoint_at(run, 1)
    base = ["--from_weight", step_1, "--save_dir", str(tmp_path / "next")]
    tokenizer, path, messages = tokenizer_of(base)
    assert path == str(tok) and tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(load_tokenizer(tok))
    assert messages[-1] == f"tokenizer: {tok} (recorded by the resume checkpoint's run, {len(tokenizer)} tokens)"
    # the shipped tokenizer has the same vocabulary and size but not the same template: refused, by fingerprint
    with pytest.raises(ConfigError) as refused:
        tokenizer_of([*base, "--tokenizer_path", str(DEFAULT_TOKENIZER_DIR)])
    assert str(refused.value) == (
        f"--tokenizer_path {DEFAULT_TOKENIZER_DIR} has another chat template or other special tokens than the "
        f"tokenizer recorded by the resume checkpoint's run ({tok}); leave --tokenizer_path out to use that one")
    # the same for an HF directory that holds its tokenizer (the run's model/), compared by vocabulary before
    with pytest.raises(ConfigError, match="has another chat template or other special tokens than the tokenizer "
                                          "saved with the weights"):
        tokenizer_of(["--from_weight", str(run / "model"), "--tokenizer_path", str(DEFAULT_TOKENIZER_DIR)])

    # A checkpoint without a copy of its tokenizer whose recorded one is gone: one line, exit 2, before any
    # data is read; --tokenizer_path stands in for it, checked by the fingerprint the checkpoint recorded.
    state = torch.load(step_1, weights_only=True)
    del state["tokenizer"]
    torch.save(state, step_1)
    shutil.move(str(tok), str(tmp_path / "moved"))
    gone = run_trainer(flags(data, tmp_path / "next", "--max_steps", "1", "--cache_dir", str(tmp_path / "cache"),
                             *base), check=False)
    assert gone.returncode == 2 and gone.stderr.strip().splitlines() == [
        f"error: resume checkpoint {step_1}: the tokenizer its run recorded, {tok}, is gone; give --tokenizer_path "
        "DIR (that tokenizer or a copy of it)"]
    assert not os.path.exists(tmp_path / "cache")
    tokenizer, path, messages = tokenizer_of([*base, "--tokenizer_path", str(tmp_path / "moved")])
    assert path == str(tmp_path / "moved") and messages[-2] == (
        f"note: resume checkpoint {step_1}: the tokenizer its run recorded, {tok}, is gone; --tokenizer_path "
        f"{tmp_path / 'moved'} has the fingerprint the weights recorded")


def test_a_max_seq_len_whose_rope_tables_do_not_fit_is_one_line_before_tokenizing(data, tmp_path, monkeypatch):
    import pytest

    import trainer.model_setup as model_setup
    from dataset import load_tokenizer
    from trainer.args import parse_args
    from trainer.errors import ConfigError

    monkeypatch.setattr(model_setup, "host_memory_bytes", lambda: 16 << 30)
    tokenizer = load_tokenizer(None)
    config = model_setup.build_model_config(parse_args(["--max_seq_len", "1000000"]), tokenizer)
    assert config.max_position_embeddings == 1000000 and config.head_dim == 96  # 1.4 GiB: accepted
    with pytest.raises(ConfigError) as refused:
        model_setup.build_model_config(parse_args(["--max_seq_len", "10000000"]), tokenizer)
    assert str(refused.value) == ("--max_seq_len 10000000: the RoPE tables for 10000000 positions need 14.3 GiB, more "
                                  "than a quarter of this machine's 16.0 GiB; --max_seq_len is the longest sample in "
                                  "tokens (default 512)")
    wide = ["--hidden_size", "12288", "--num_attention_heads", "1", "--num_key_value_heads", "1",
            "--num_hidden_layers", "1"]  # 32,768 positions of 12,288 dimensions: 6 GiB
    for longest in ("512", "32768"):  # the heads are too wide at any --max_seq_len
        with pytest.raises(ConfigError) as refused:
            model_setup.build_model_config(parse_args([*wide, "--max_seq_len", longest]), tokenizer)
        assert str(refused.value) == (
            "heads of 12288 dimensions (hidden_size 12288 / 1 attention heads): the RoPE tables for 32768 positions "
            "need 6.0 GiB, more than a quarter of this machine's 16.0 GiB; give more --num_attention_heads or a "
            "smaller --hidden_size")
    monkeypatch.undo()  # the run reads this machine's memory
    far = run_trainer_in_process(flags(data, tmp_path / "run", "--max_seq_len", str(10**12), "--cache_dir",
                                       str(tmp_path / "cache")))
    assert far.returncode == 2 and far.stderr.strip().splitlines()[-1].startswith(f"error: --max_seq_len {10**12}: ")
    assert "Traceback" not in far.stderr and not os.path.exists(tmp_path / "cache")
    assert not os.path.exists(tmp_path / "run" / "model")


def test_rope_tables_of_a_from_weight_model_blame_its_positions_or_max_seq_len(monkeypatch):
    """The --from_weight model's own positions (not the flags' 32,768) decide whether --max_seq_len is to
    blame: lowering it helps only where those fit."""
    from types import SimpleNamespace

    import pytest

    import trainer.model_setup as model_setup
    from model import MiniMindConfig
    from trainer.errors import ConfigError

    monkeypatch.setattr(model_setup, "host_memory_bytes", lambda: 16 << 30)  # tables of 2**21 positions x 128 fit

    def refusal(own: int, longest: int) -> str:
        config = MiniMindConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                max_position_embeddings=max(own, longest))
        args = SimpleNamespace(max_seq_len=longest, from_weight="start")
        with pytest.raises(ConfigError) as refused:
            model_setup.check_position_tables(args, config, own)
        return str(refused.value)

    assert refusal(2**20, 3000000) == (
        "--max_seq_len 3000000: the RoPE tables for 3000000 positions need 5.7 GiB, more than a quarter of this "
        "machine's 16.0 GiB; --max_seq_len is the longest sample in tokens (default 512)")
    assert refusal(2**22, 5000000) == (
        "heads of 128 dimensions: the RoPE tables for 5000000 positions need 9.5 GiB, more than a quarter of this "
        "machine's 16.0 GiB; the --from_weight model sets its heads and at least 4194304 positions: it cannot be "
        "trained on this machine")


def test_flags_that_do_nothing_here_are_said_and_a_run_ends_naming_its_model(data, tmp_path):
    """--warmup_steps beyond the run, --fsdp 1 and --backend in one process, --tf32 1 on a CPU, wandb's flags
    without wandb and --local_rank without a launcher are warned; a resume with nothing left says so; the
    last line names model/ and the next command; --dtype float16 on a CPU and a --save_weight path are
    refused before the data is read."""
    run = tmp_path / "run"
    first = run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "2", "--fsdp", "1", "--backend",
                                         "gloo", "--tf32", "1", "--wandb_project", "p", "--wandb_run_name", "r",
                                         "--local_rank", "0"), check=True)  # main() in this process: its lines are checked
    lines = first.stdout.splitlines()
    assert [line for line in lines if line.startswith("warning: --") and line.split()[1] in (
        "--tf32", "--wandb_project", "--wandb_run_name", "--local_rank")] == [
        "warning: --tf32 1 on cpu: TF32 is a mode of CUDA tensor cores, so it is not used",
        "warning: --wandb_project p without --use_wandb 1: nothing is logged to wandb, so it is not used",
        "warning: --wandb_run_name r without --use_wandb 1: nothing is logged to wandb, so it is not used",
        "warning: --local_rank 0 without a launcher: it is set by `python -m torch.distributed.launch`; this "
        "process is the only one, so it is not used"]
    assert "warning: --fsdp 1 in one process: there is nothing to shard over, the model trains unsharded (start " \
           "several processes with torchrun or --world_size N to shard it)" in lines
    assert "warning: --backend gloo in one process: no process group is created, so it is not used" in lines
    assert ("warning: --warmup_steps 10 is longer than the run's 2 optimizer steps: the learning rate ends at 0.0006, "
            "below --learning_rate 0.003") in lines
    assert lines[-1] == f"done: the model is in {run / 'model'}; talk to it with: python scripts/chat.py --model_path {run}"
    again = run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "2", "--from_resume", "1"),
                                   check=True)
    assert ("nothing left to train: the checkpoint is at step 2 and the run ends at step 2 (--epochs 1, --max_steps 2); "
            "raise --epochs or --max_steps to train further") in again.stdout.splitlines()
    assert not [line for line in again.stdout.splitlines() if line.startswith("training ")]  # it says only that
    assert not [line for line in again.stdout.splitlines() if line.startswith("warning: --warmup_steps")]
    shutil.rmtree(run / "model")  # the last line names no folder that is not there
    gone = run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "2", "--from_resume", "1"),
                                  check=True)
    assert gone.stdout.splitlines()[-1] == f"done: {run} holds no model/ (nothing was trained in this run)"
    for extra, message in ((["--dtype", "float16"], "error: --dtype float16 needs a GPU; on CPU use float32 or bfloat16"),
                           (["--save_weight", "../x"], "error: --save_weight ../x: a name for the .pth file inside "
                                                       "--save_dir (e.g. full_sft), not a path")):
        refused = run_trainer_in_process([*flags(data, tmp_path / "other", "--cache_dir", str(tmp_path / "cache")),
                                          *extra])
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [message]
        assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "x_32.pth")


def compiled_epoch(batches_of_items: list[list[dict]], dtype: str = "float32") -> tuple[list[int], set, dict]:
    """--use_compile 1's blocks (dynamo's "eager" backend: it counts what inductor would compile)
    over an epoch of these batches of dataset items, collated as the trainer does, a 3-layer model
    trained under autocast to `dtype`: the frames compiled after each optimizer step, the batches'
    shapes and the graph breaks."""
    import torch
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from dataset import SFTCollator
    from tests.trainer.loop.test_loop_syncs import tiny_run
    from trainer.loop.loop import agree_on_step, optimizer_step
    from trainer.model_setup import COMPILE_PAD_MULTIPLE, compile_model

    torch._dynamo.reset()
    counters.clear()
    run = tiny_run(torch.device("cpu"), dtype=getattr(torch, dtype), layers=3)
    compiled = CompileCounter()
    assert compile_model(run.model, torch.device("cpu"), backend=compiled) is run.model
    collate = SFTCollator(pad_token_id=0, pad_to_multiple_of=COMPILE_PAD_MULTIPLE,
                          max_length=run.model.config.max_position_embeddings)
    frames, shapes = [], set()
    for items in batches_of_items:
        micro_batches = [collate(items)]
        shapes.add(tuple(micro_batches[0]["input_ids"].shape))
        optimizer_step(run, micro_batches, agree_on_step(run, micro_batches), 1e-3)
        frames.append(compiled.frame_count)
    return frames, shapes, dict(counters["graph_break"])


def random_samples(count: int, low: int, high: int) -> list[dict]:
    """`count` samples of lengths in [low, high), the first third of each without labels (tiny_model: 97 tokens)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in torch.randint(low, high, (count,), generator=generator).tolist():
        ids = torch.randint(1, 97, (length,), generator=generator)
        labels = ids.clone()
        labels[: length // 3] = -100
        samples.append({"input_ids": ids.numpy(), "labels": labels.numpy()})
    return samples


def shuffled_batches(items: list, size: int) -> list[list]:
    import random

    batches = [items[start:start + size] for start in range(0, len(items), size)]
    random.Random(0).shuffle(batches)
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_blocks_run_an_epoch_of_lengths_without_graph_breaks_and_two_recompiles(dtype):
    """--use_compile 1 compiles each block on its own; over an epoch of length-grouped batches
    (lengths 5-127 padded to a multiple of 64, the last batch smaller) the compiled code has no
    graph break and is compiled again at most twice after the first step (the length, then the
    batch size, become symbols). One graph serves every layer, also under bf16 autocast, where
    each block casts its fp32 weights (a guard on a parameter's identity would compile a graph per
    layer)."""
    samples = sorted(random_samples(30, 5, 128), key=lambda sample: len(sample["input_ids"]))
    frames, shapes, graph_breaks = compiled_epoch(shuffled_batches(samples, 4), dtype)
    assert shapes == {(4, 64), (4, 128), (2, 128)}
    assert graph_breaks == {}
    assert frames[0] == 1 and frames[-1] - frames[0] <= 2, frames


@pytest.mark.slow
def test_compiled_blocks_run_an_epoch_of_packed_rows_without_graph_breaks_and_two_recompiles():
    """--use_compile 1 --packing 1 on the CPU (the bucketed attention, one op per layer): over an
    epoch of 6 batches of packed rows whose documents fall into 1 to 4 buckets (the plan's sizes
    change every batch; one batch of 2 rows) no graph break and at most two compilations again
    after the first step (the buckets' sizes, then the batch size, become symbols)."""
    from dataset.packing import PackedSFTDataset

    class Samples:  # the SFTDataset that PackedSFTDataset reads
        prompt_room = None

        def __init__(self, samples):
            self.samples, self.lengths = samples, [len(sample["input_ids"]) for sample in samples]

        def item(self, index, capacity):
            return {key: value.copy() for key, value in self.samples[index].items()}

    rows = PackedSFTDataset(Samples(random_samples(100, 3, 50)), max_seq_len=128)
    frames, shapes, graph_breaks = compiled_epoch(shuffled_batches([rows[i] for i in range(len(rows))], 4))
    assert len(frames) == 6 and shapes == {(4, 128), (2, 128)}
    assert graph_breaks == {}
    assert frames[0] == 1 and frames[-1] - frames[0] <= 2, frames


def test_a_save_weight_that_names_the_from_weight_file_is_refused(tmp_path):
    """`--from_weight pretrain --save_weight pretrain` (or the .pth's path) would write the run's weights over the
    file it starts from at the first save; refused before the data is read, the file kept."""
    import torch

    from model import MiniMindConfig, MiniMindForCausalLM
    from tests.helpers.tiny_weights import setup
    from trainer.errors import ConfigError

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2))
    source = tmp_path / "pretrain_32.pth"
    torch.save(model.state_dict(), source)
    for name in ("pretrain", str(source)):
        with pytest.raises(ConfigError) as refused:
            setup(["--from_weight", name, "--save_weight", "pretrain", "--save_dir", str(tmp_path), "--hidden_size", "32"])
        assert str(refused.value) == (f"--save_weight pretrain would write over {source}, the --from_weight weights "
                                      "this run starts from: give another --save_weight")
    config = setup(["--from_weight", "pretrain", "--save_weight", "full_sft", "--save_dir", str(tmp_path),
                    "--hidden_size", "32"])
    assert config.hidden_size == 32


def test_moe_flags_for_a_dense_model_are_refused(tmp_path):
    """--num_experts / --num_experts_per_tok / --aux_loss_coef act only on a mixture of experts: for a dense model
    (no --use_moe 1, or dense --from_weight weights) the run would train without them and without a word."""
    import torch

    from model import MiniMindConfig, MiniMindForCausalLM
    from tests.helpers.tiny_weights import setup
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        setup(["--num_experts", "8", "--aux_loss_coef", "0.1"])
    assert str(refused.value) == ("--num_experts, --aux_loss_coef only act on a mixture-of-experts model, and this one "
                                  "is dense: give --use_moe 1, or leave them out")
    assert setup(["--num_experts", "8", "--use_moe", "1"]).num_experts == 8
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2))
    torch.save(dense.state_dict(), tmp_path / "dense.pth")
    with pytest.raises(ConfigError) as refused:
        setup(["--from_weight", str(tmp_path / "dense.pth"), "--num_experts_per_tok", "2"])
    assert str(refused.value) == ("--num_experts_per_tok only acts on a mixture-of-experts model, and the --from_weight "
                                  "weights are dense: leave it out")


def test_a_model_too_large_for_host_memory_is_one_line_before_tokenizing(data, tmp_path, monkeypatch):
    import torch

    import trainer.model_setup as model_setup
    from dataset import load_tokenizer
    from trainer.args import parse_args
    from trainer.errors import ConfigError

    monkeypatch.setattr(model_setup, "host_memory_bytes", lambda: 8 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    tokenizer = load_tokenizer(None)
    wide = parse_args(["--hidden_size", "4096", "--num_attention_heads", "32", "--num_key_value_heads", "8"])
    # 8 layers of 3 x 4096 x 12928 (SwiGLU) and 4096 x 10240 (q, k, v, o), a 6400 x 4096 embedding: 1.63 B
    assert model_setup.build_model_config(wide, tokenizer, device=torch.device("cuda", 0)).hidden_size == 4096  # 6.1 GiB
    with pytest.raises(ConfigError) as refused:
        model_setup.build_model_config(wide, tokenizer, device=torch.device("cpu"))
    assert str(refused.value) == ("the model (hidden 4096 x 8 layers, vocabulary 6400: 1.63 B parameters) needs at "
                                  "least 24.3 GiB of host memory to train on the CPU (fp32 weights, gradients and "
                                  "AdamW's two moments: 16 bytes a parameter), more than this machine's 8.0 GiB")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as refused:  # the fp32 model is built on the host by each process
        model_setup.build_model_config(wide, tokenizer, device=torch.device("cuda", 0))
    assert str(refused.value) == ("the model (hidden 4096 x 8 layers, vocabulary 6400: 1.63 B parameters) needs at "
                                  "least 6.1 GiB of host memory in each of the node's 4 processes (24.3 GiB in all): "
                                  "its fp32 weights, built on the host before they move to the GPU (4 bytes a "
                                  "parameter), more than this machine's 8.0 GiB")
    deep = parse_args(["--num_hidden_layers", "100000"])  # counted from two shallow models, not built: at once
    with pytest.raises(ConfigError) as refused:
        model_setup.build_model_config(deep, tokenizer, device=torch.device("cuda", 0))
    assert "(hidden 768 x 100000 layers, vocabulary 6400: 737.46 B parameters)" in str(refused.value)
    monkeypatch.undo()  # the run reads this machine's memory and the test's own environment
    huge = run_trainer_in_process(flags(data, tmp_path / "run", "--hidden_size", "1048576", "--cache_dir",
                                        str(tmp_path / "cache")))
    assert huge.returncode == 2 and "Traceback" not in huge.stderr
    assert huge.stderr.strip().splitlines()[-1].startswith("error: the model (hidden 1048576 x 2 layers")
    assert "GiB of host memory to train on the CPU" in huge.stderr
    assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "run" / "model")


def test_a_model_too_large_for_the_gpu_to_train_is_one_line_before_tokenizing(monkeypatch):
    """A GPU of 16 GiB (torch.cuda as on a GPU machine): the 1.63 B-parameter model needs 24.3 GiB for
    its fp32 weights, gradients and AdamW's moments in one process; under --fsdp 1 over 2 processes
    12.2 GiB each fits; on a 4 GiB GPU over 8 processes the share (3.0 GiB) fits, the whole fp32 model
    each builds first (6.1 GiB) does not."""
    from types import SimpleNamespace

    import torch

    import trainer.model_setup as model_setup
    from dataset import load_tokenizer
    from trainer.args import parse_args
    from trainer.errors import ConfigError

    gpu, processes = SimpleNamespace(total_memory=16 << 30), [1]
    monkeypatch.setattr(model_setup, "host_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: processes[0] > 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: processes[0])
    tokenizer, cuda = load_tokenizer(None), torch.device("cuda", 1)
    wide = ["--hidden_size", "4096", "--num_attention_heads", "32", "--num_key_value_heads", "8"]  # 1.63 B
    model = "the model (hidden 4096 x 8 layers, vocabulary 6400: 1.63 B parameters) needs at least"
    assert model_setup.build_model_config(parse_args([]), tokenizer, device=cuda).hidden_size == 768
    for flags in (wide, [*wide, "--fsdp", "1"]):  # --fsdp 1 in one process shards nothing
        with pytest.raises(ConfigError) as refused:
            model_setup.build_model_config(parse_args(flags), tokenizer, device=cuda)
        assert str(refused.value) == (
            f"{model} 24.3 GiB of GPU memory to train (fp32 weights, gradients and AdamW's two moments: 16 bytes a "
            "parameter; with several GPUs --fsdp 1 shards them), more than the 16.0 GiB of cuda:1")
    processes[0] = 2
    assert model_setup.build_model_config(parse_args([*wide, "--fsdp", "1"]), tokenizer, device=cuda).hidden_size == 4096
    with pytest.raises(ConfigError):  # DDP: every process holds all of it
        model_setup.build_model_config(parse_args(wide), tokenizer, device=cuda)
    sharded_refusals = {  # (GPU memory, processes): what --fsdp 1 says
        (8 << 30, 2): f"{model} 12.2 GiB of GPU memory to train (its share of the fp32 weights, gradients and AdamW's "
                      "two moments over 2 processes (--fsdp 1); more processes shard them further), more than the "
                      "8.0 GiB of cuda:1",
        (4 << 30, 8): f"{model} 6.1 GiB of GPU memory to train (the whole fp32 model that each process builds before "
                      "--fsdp 1 shards it: 4 bytes a parameter), more than the 4.0 GiB of cuda:1",
    }
    for (memory, count), message in sharded_refusals.items():
        gpu.total_memory, processes[0] = memory, count
        with pytest.raises(ConfigError) as refused:
            model_setup.build_model_config(parse_args([*wide, "--fsdp", "1"]), tokenizer, device=cuda)
        assert str(refused.value) == message
    assert model_setup.build_model_config(parse_args(wide), tokenizer, device=torch.device("cpu")).hidden_size == 4096
