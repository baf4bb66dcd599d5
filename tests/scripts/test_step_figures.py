"""scripts/step_figures.py: the dispatch counter counts exactly, and the command prints the figures
of the trainer's optimizer step for any trainer flags (tiny model, in process)."""

import json
import re
from pathlib import Path

import pytest
import torch

from scripts._dispatch_counts import DispatchCounter, flop_counter
from scripts.step_figures import main, with_trainer_defaults
from tests.helpers.overfitted import script_in_process

DEMO = Path(__file__).resolve().parents[2] / "dataset" / "demo" / "sft_train.jsonl"
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--max_seq_len", "64"]


def test_counter_counts_computing_ops_and_casts_but_not_views():
    x = torch.ones(4, 6)
    with DispatchCounter() as counter:
        y = x.view(6, 4).t()  # two views
        z = (y * 2).to(torch.bfloat16).float()  # mul + two casts
        z.sum()
    assert counter.total == 4
    assert counter.casts == 2
    assert counter.dispatches == 6


def test_help_names_the_trainer_flags_and_their_defaults_here(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    assert " ".join(capsys.readouterr().out.split()).endswith(
        "Every other flag is the trainer's (python train_full_sft.py --help), with --batch_size 4 and --dtype "
        "bfloat16 unless given.")


def test_trainer_defaults_are_batch_4_bf16_unless_given():
    assert with_trainer_defaults(["--packing", "1"]) == ["--batch_size", "4", "--dtype", "bfloat16", "--packing", "1"]
    assert with_trainer_defaults(["--batch_size=2", "--dtype", "float32"]) == ["--batch_size=2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("figures")
    with open(DEMO, encoding="utf-8") as source:
        (folder / "train.jsonl").write_text("".join(line for _, line in zip(range(48), source)), encoding="utf-8")
    return folder


def figures(capsys, data, *flags) -> dict:
    argv = [*TINY, "--data_path", str(data / "train.jsonl"), "--cache_dir", str(data / "cache"), "--json",
            "--steps", "2", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_prints_ops_casts_and_flops_of_every_counted_step(capsys, data):
    bf16 = figures(capsys, data)
    fp32 = figures(capsys, data, "--dtype", "float32")
    for result in (bf16, fp32):
        assert len(result["ops"]) == len(result["casts"]) == len(result["flops"]) == 2
        assert all(flops > 0 for flops in result["flops"])
        assert result["graph_breaks"] is None  # not compiled
    assert min(bf16["casts"]) > max(fp32["casts"])  # autocast casts; fp32 runs hardly any


def test_prints_the_moe_experts_flops_and_every_host_read_of_a_step(capsys, data, monkeypatch):
    """The experts' grouped GEMMs apart, as k/E of every expert on every token; the host reads of
    device values in each counted step: none in the trainer's, and one planted in the gradient
    clipping is named where the trainer calls it."""
    moe = ["--dtype", "float32", "--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2"]
    result = figures(capsys, data, *moe)
    assert (result["experts"], result["experts_per_token"]) == (4, 2)
    assert all(0 < experts < total for experts, total in zip(result["expert_flops"], result["flops"]))
    assert result["host_reads"] == [[], []]
    assert figures(capsys, data)["expert_flops"] == [0, 0] and figures(capsys, data)["experts"] is None
    clip = torch.nn.utils.clip_grad_norm_

    def clip_and_read(*args, **kwargs):
        norm = clip(*args, **kwargs)
        float(norm)
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_and_read)
    reads = figures(capsys, data)["host_reads"]
    assert len(reads) == 2 and all(len(step) == 1 for step in reads)
    assert re.fullmatch(r"item at trainer/parallel/ddp\.py:\d+ in clip_grad_norm", reads[0][0]), reads
    argv = [*TINY, "--data_path", str(data / "train.jsonl"), "--cache_dir", str(data / "cache"), "--steps", "1", *moe]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"MoE experts \(grouped GEMMs, top-2 of 4 per token\): GFLOP [\d.]+-[\d.]+, 2/4 of running "
                        r"every expert on every token \([\d.]+-[\d.]+\)", lines[-3]), lines
    assert lines[-2:] == ["host reads of device values per step: 1", f"  {reads[0][0]}"]


def recording_backend(graphs: list, calls: list | None = None):
    """A torch.compile backend that runs each graph as traced and records its placeholders' shapes,
    and in `calls` whether a dispatch mode (the counters) was on at each run of a compiled graph."""

    def backend(graph_module, example_inputs):
        graphs.append([tuple(example.shape) for example in example_inputs if isinstance(example, torch.Tensor)])
        if calls is None:
            return graph_module.forward

        def run(*args):
            calls.append(torch._C._len_torch_dispatch_stack() > 0)
            return graph_module.forward(*args)

        return run

    return backend


def test_code_compiled_inside_the_counters_is_compiled_and_its_ops_and_flops_counted():
    """Dynamo runs a frame eagerly under a dispatch mode that does not ignore compilation: the
    counters let it compile (a second shape compiles again, with a symbolic size) and count the
    ops and FLOPs of the compiled graphs."""
    torch._dynamo.reset()
    graphs, weight, inputs = [], torch.ones(4, 4), (torch.ones(3, 4), torch.ones(5, 4))
    function = torch.compile(lambda x: (x @ weight).sin(), backend=recording_backend(graphs))
    with flop_counter() as flops, DispatchCounter() as counter:
        for x in inputs:
            function(x)
    assert graphs == [[(3, 4), (4, 4)], [(5, 4), (4, 4)]]  # x, then the weight
    assert {str(op): count for op, count in counter.ops.items()} == {"aten.mm.default": 2, "aten.sin.default": 2}
    assert flops.get_total_flops() == 2 * 3 * 4 * 4 + 2 * 5 * 4 * 4


def test_compiled_step_is_compiled_by_the_backend_given(capsys, data):
    """--compile_backend reaches the trainer's compile call, and the counted steps run the compiled
    blocks: one graph (both layers share it), no graph break, nothing compiled after the first step
    (every batch is padded to 64 tokens, --max_seq_len); the graph runs for both layers in the warm-up
    step, outside the counters, and in each of the 2 counted steps, inside them."""
    graphs, calls = [], []
    torch._dynamo.reset()
    torch._dynamo.register_backend(recording_backend(graphs, calls), name="minisft_recording")
    result = figures(capsys, data, "--dtype", "float32", "--use_compile", "1", "--compile_backend", "minisft_recording")
    assert (result["frames"], result["graph_breaks"], result["recompiles"]) == (1, 0, 0)
    assert result["host_reads"] is None  # counted in eager steps only
    assert len(graphs) == 1
    assert calls == [False, False, True, True, True, True]


def test_a_backend_torch_compile_does_not_know_is_refused_before_the_run():
    done = script_in_process("step_figures.py", "--use_compile", "1", "--compile_backend", "nope")
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "error: --compile_backend nope: not a torch.compile backend (eager, inductor, ...: "
           "torch._dynamo.list_backends(exclude_tags=())) (see step_figures.py --help)\n")


def test_a_backend_without_use_compile_is_refused_not_ignored():
    done = script_in_process("step_figures.py", "--compile_backend", "eager")
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "error: --compile_backend needs --use_compile 1 (see step_figures.py --help)\n")
