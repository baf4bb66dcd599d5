"""The samples repeated only to pad an epoch's end to a multiple of the world size count for nothing
(dataset/epoch_padding.py): an epoch's last step is the same on 2 ranks as on 1 (issue 14)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from dataset import FillerIndex, MarkFillers, ResumableDistributedSampler, SFTCollator, load_tokenizer
from model import MiniMindConfig, MiniMindForCausalLM
from model.flops import ModelFlops
from tests.helpers.trainer_launch import REPO
from trainer.args import parse_args
from trainer.data_setup import build_train_data
from trainer.runtime.distributed import DistContext
from dataset import model_inputs
from trainer.loop.loop import agree_on_step

CPU = torch.device("cpu")


def test_the_sampler_yields_the_padding_repeats_as_fillers():
    shards = [list(ResumableDistributedSampler(10, 3, rank, seed=0)) for rank in range(3)]
    order = ResumableDistributedSampler(10, 1, 0, seed=0).global_order().tolist()
    assert shards[1][-1] == order[0] and shards[2][-1] == order[1]  # repeats of the epoch's start ...
    fillers = [[isinstance(i, FillerIndex) for i in shard] for shard in shards]
    assert fillers == [[False] * 4, [False] * 3 + [True], [False] * 3 + [True]]  # ... and only they are fillers
    resumed = [list(ResumableDistributedSampler(10, 4, rank, seed=0, start_index=7)) for rank in range(4)]
    assert [[isinstance(i, FillerIndex) for i in shard] for shard in resumed] == [[False], [False], [False], [True]]
    assert not any(isinstance(i, FillerIndex) for i in ResumableDistributedSampler(10, 2, 1, seed=0))


def test_a_filler_row_keeps_its_tokens_but_has_no_labels_and_no_real_tokens():
    items = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    marked = MarkFillers(items)
    batch = SFTCollator(pad_token_id=0)([marked[0], marked[FillerIndex(1)]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 0]]
    assert batch["loss_positions"].tolist() == [0, 1]
    assert "filler" not in marked[1] and len(marked) == 2
    # through a DataLoader worker process (the indices travel pickled): rank 1 of 2 over 3 items gets 1, then 0 as filler
    loader = DataLoader(MarkFillers([*items, items[0]]), batch_size=2, sampler=ResumableDistributedSampler(3, 2, 1, shuffle=False),
                        collate_fn=SFTCollator(pad_token_id=0), num_workers=1)
    assert [b["attention_mask"].tolist() for b in loader] == [[[1, 1, 0], [0, 0, 0]]]


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    """5 demo conversations, all with loss tokens within 512 tokens (tokenized once for both tests below)."""
    path = tmp_path_factory.mktemp("five") / "five.jsonl"
    path.write_text("".join(open(f"{REPO}/dataset/demo/sft_train.jsonl", encoding="utf-8").readlines()[:5]),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("use_moe", [0, 1], ids=["dense", "moe"])
def test_the_last_step_of_an_odd_epoch_on_two_ranks_equals_one_rank(five, use_moe):
    """5 samples: 1 rank x 5 against 2 ranks x 3, whose last row is a filler. The ranks' step counts
    and summed gradients (what DDP's all-reduce adds) must equal the one rank's, to rounding. Before
    the fix the repeated sample was trained twice: its tokens counted, gradients differed by O(1e-2)."""
    tokenizer = load_tokenizer(None)
    common = ["--data_path", str(five), "--max_seq_len", "512", "--use_moe", str(use_moe),
              "--aux_loss_coef", "0.1"]
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, use_moe=bool(use_moe),
                                               num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1))

    def step(world_size, batch_size):
        """(summed StepTotals, summed gradients) of the epoch's one step, ranks simulated in turn."""
        args = parse_args([*common, "--batch_size", str(batch_size)])
        batches = [next(iter(build_train_data(args, tokenizer, DistContext(rank, rank, world_size, CPU, None)).loader))
                   for rank in range(world_size)]
        quiet = SimpleNamespace(preemption=SimpleNamespace(requested=False),
                                ctx=SimpleNamespace(distributed=False, device=CPU), model_flops=ModelFlops(model))
        totals = [sum(figures) for figures in zip(*(agree_on_step(quiet, [batch])[:3] for batch in batches))]
        model.zero_grad()
        for batch in batches:
            out = model(**model_inputs(batch, CPU), num_items_in_batch=totals[0], num_sequences_in_batch=totals[2],
                        skip_logits=True)
            (out.loss + out.aux_loss).backward()
        return totals, {name: p.grad.clone() for name, p in model.named_parameters()}, batches

    one_totals, one, _ = step(1, 5)
    two_totals, two, batches = step(2, 3)
    assert [len(b["input_ids"]) for b in batches] == [3, 3] and batches[1]["attention_mask"][-1].sum() == 0
    assert two_totals == one_totals  # loss tokens, real tokens, rows: the filler adds none
    for name in one:
        assert torch.allclose(two[name], one[name], atol=1e-6, rtol=0), f"{name}: {(two[name] - one[name]).abs().max():.3g}"
