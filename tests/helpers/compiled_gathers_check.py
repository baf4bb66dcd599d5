"""Run by tests/model/test_compile.py in a fresh process (a miscompiled kernel may corrupt the heap):
a tiny model compiled with trainer.model_setup.compile_model, on packed and padded batches of
three lengths (so torch.compile recompiles with dynamic shapes), gives the eager loss and
gradients. Prints the largest differences as JSON."""

import copy
import json

import torch

from model import MiniMindConfig, MiniMindForCausalLM
from trainer.model_setup import compile_model


def batch(length: int, packed: bool, generator: torch.Generator) -> dict:
    input_ids = torch.randint(0, 256, (2, length), generator=generator)
    labels = input_ids.clone()
    labels[:, : length // 3] = -100
    inputs = {"input_ids": input_ids, "labels": labels, "skip_logits": True}
    if packed:  # two documents per row
        half = length // 2
        inputs["position_ids"] = torch.cat([torch.arange(half), torch.arange(length - half)]).repeat(2, 1)
    else:
        inputs["attention_mask"] = torch.ones(2, length, dtype=torch.long)
        inputs["attention_mask"][1, -3:] = 0
    return inputs


def main() -> None:
    torch.manual_seed(0)
    config = MiniMindConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128)
    eager = MiniMindForCausalLM(config)
    compiled = compile_model(copy.deepcopy(eager), torch.device("cpu"))  # compiles its blocks in place
    generator = torch.Generator().manual_seed(1)
    worst_loss, worst_grad = 0.0, 0.0
    for packed in (False, True):
        for length in (37, 50, 61):
            inputs = batch(length, packed, generator)
            results = []
            for model in (eager, compiled):
                model.zero_grad()
                loss = model(**inputs).loss
                loss.backward()
                results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
            (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
            worst_loss = max(worst_loss, abs(eager_loss - compiled_loss))
            worst_grad = max(worst_grad, max((a - b).abs().max().item() for a, b in zip(eager_grads, compiled_grads)))
    print(json.dumps({"loss": worst_loss, "grad": worst_grad}))


if __name__ == "__main__":
    main()
