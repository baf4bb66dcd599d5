"""A model built for weights that are loaded next (--from_weight, a resume, chat / eval / export):
allocated where it is used, in the dtype it is used in, and never initialised at random
(trainer/weights/inference.py `empty_model`, trainer/model_setup.py `build_model`)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers.tiny_model import tiny_model
from trainer.model_setup import build_model
from trainer.weights.inference import load_model_for_inference, model_from_weights
from trainer.weights.read import Weights, build_config, read_weights

RANDOM_FILLS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_")


class Made(TorchDispatchMode):
    """The random fills of real tensors and the bytes of the tensors every op makes, by device and dtype."""

    def __init__(self):
        super().__init__()
        self.random_fills, self.bytes = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in RANDOM_FILLS and not args[0].is_meta:
            self.random_fills.append((name, tuple(args[0].shape)))
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:  # what an op makes, not what it fills
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    key = (tensor.device.type, tensor.dtype)
                    self.bytes[key] = self.bytes.get(key, 0) + tensor.nbytes
        return out


def weights_of(model) -> Weights:
    state = {key: value.clone() for key, value in model.state_dict().items() if key != "lm_head.weight"}
    return Weights(state, {}, "test weights")


def parameter_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters())


def test_a_model_built_for_its_weights_is_never_initialised_at_random():
    """Qwen3-0.6B on two CPU threads: 35 of the 38 s of its build are nn.Linear's and _init_weights'
    random fills (197 uniform_, 199 normal_), on every rank, all overwritten by the weights."""
    source = tiny_model()
    args = SimpleNamespace(gradient_checkpointing=0)
    for resumed, weights in ((False, weights_of(source)), (True, None)):
        made = Made()  # the clones of weights_of made outside
        with made:
            model = build_model(args, source.config, torch.device("cpu"), weights, resumed=resumed)
        assert made.random_fills == []
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(p.dtype == torch.float32 for p in model.parameters())
    loaded = build_model(args, source.config, torch.device("cpu"), weights_of(source))
    expected = source.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
    for name in ("freqs_cos", "freqs_sin"):
        assert torch.equal(getattr(loaded.model, name), getattr(source.model, name))
    fresh = Made()
    with fresh:
        build_model(args, source.config, torch.device("cpu"))  # from scratch: initialised, as before
    assert fresh.random_fills


def test_weights_for_a_device_are_never_a_float32_model_on_the_host():
    """--from_weight on a GPU (the meta device stands in for it): the model is allocated there, not built
    in float32 on the host of every rank first (Qwen3-1.7B: 8.1 GB a rank, 65 GB for 8 ranks)."""
    source = tiny_model()
    weights, made = weights_of(source), Made()
    with made:
        model = build_model(SimpleNamespace(gradient_checkpointing=0), source.config, torch.device("meta"), weights)
    assert model.model.embed_tokens.weight.is_meta
    assert made.bytes.get(("cpu", torch.float32), 0) < parameter_bytes(source) / 4  # the RoPE tables alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_loaded_for_inference_in_half_precision_has_no_float32_copy(tmp_path, dtype):
    """chat.py / eval_sft.py --dtype bfloat16: built in bfloat16, each weight cast as it is copied; not a
    float32 model (Qwen3-1.7B: 8.1 GB of host memory), initialised at random, then cast."""
    source = tiny_model()
    path = tmp_path / "step_00000001.pt"
    torch.save({"format": "minisft-resume", "format_version": 1, "model_config": source.config.to_dict(),
                "model": source.state_dict()}, path)
    made = Made()
    with made:
        model = load_model_for_inference(path, dtype=dtype)
    assert made.random_fills == []
    weights, built = read_weights(str(path)), Made()  # the read checks every value (a float32 temporary each)
    with built:
        model_from_weights(build_config(weights), weights, torch.device("cpu"), dtype)
    assert built.bytes.get(("cpu", torch.float32), 0) < parameter_bytes(source) / 4  # the RoPE tables alone
    state = model.state_dict()
    for key, value in source.state_dict().items():
        assert state[key].dtype == dtype and torch.equal(state[key], value.to(dtype)), key
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.training
    assert model.config.dtype == dtype
    for name in ("freqs_cos", "freqs_sin"):
        assert torch.equal(getattr(model.model, name), getattr(source.model, name))  # float32, as computed
