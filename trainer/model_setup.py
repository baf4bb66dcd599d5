"""Steps 3 and 5: the initial weights (`--from_weight`), the tokenizer that goes with them, the
model config (from the weights, else from the flags), the model, its optimizer, torch.compile.
(The DDP / FSDP wrapper is trainer/parallel/, the dtype and loss scaling trainer/runtime/precision.py.)"""

import os

import torch
import torch.distributed as dist

from model import MiniMindConfig, MiniMindForCausalLM, count_config_parameters
from model.modeling_minimind import MiniMindBlock
from trainer.errors import ConfigError
from trainer.evaluation.evaluate import stop_token_ids
from trainer.runtime.distributed import processes_on_this_node
from trainer.weights.inference import empty_model, model_from_weights
from trainer.weights.read import Weights, build_config, minimind_pth_name, read_weights, resolve_minimind_name
from trainer.weights.tokenizer import check_vocab_fits, resolve_tokenizer
from trainer.weights.write import minimind_unsupported, pth_prefix_problem

# Architecture flags and the config field each sets. With --from_weight the field comes from the
# weights; a flag the user gave that says otherwise is refused.
ARCHITECTURE_FLAGS = {
    "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "use_moe": "use_moe", "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "rms_norm_eps": "rms_norm_eps", "aux_loss_coef": "router_aux_loss_coef",
}
MOE_ONLY_FLAGS = ("num_experts", "num_experts_per_tok", "aux_loss_coef")


def read_initial_weights(args, log=print) -> Weights | None:
    """The `--from_weight` weights (None: training from scratch). The log says which, unless a
    resume flag is given: whether a checkpoint is continued is known only later (`log_start_weights`)."""
    weights = None
    if args.from_weight not in ("none", ""):
        weights = read_weights(resolve_minimind_name(args.from_weight, args.save_dir, args.hidden_size,
                                                     bool(args.use_moe)))
    if not (args.resume_from or args.from_resume):
        log_start_weights(args, weights, None, log)
    return weights


def log_start_weights(args, weights: Weights | None, saved: dict | None, log=print) -> None:
    """One line: the weights the run starts from. A resume checkpoint wins over --from_weight, whose
    weights are then not loaded (they only set the architecture, which the checkpoint must match)."""
    if saved is not None:
        ignored = (f"; --from_weight {args.from_weight} is ignored: the resume checkpoint's weights win"
                   if weights is not None else "")
        log(f"weights: those of the resume checkpoint (step {saved['step']}){ignored}")
    elif weights is not None:
        log(f"weights: {weights.source}")
    else:
        log("weights: none, training from scratch")


def load_tokenizer_for_weights(args, weights: Weights | None, log=print):
    """(tokenizer, its directory): `--tokenizer_path`, else the weights' own, else the shipped one (None),
    by the resolver every entry point uses (trainer/weights/tokenizer.py): an explicit tokenizer that is
    not the weights' own (by fingerprint) is refused, and so is a recorded one that has changed since.
    The directory goes into the resume checkpoints with a copy of the tokenizer itself."""
    own = weights.tokenizer if weights is not None else None
    tokenizer, path, origin = resolve_tokenizer(own, args.tokenizer_path, weights.source if weights else "", log)
    log(f"tokenizer: {path or 'model/tokenizer'} ({origin}, {len(tokenizer)} tokens)")
    return tokenizer, path


def build_model_config(args, tokenizer, weights: Weights | None = None,
                       device: torch.device | None = None) -> MiniMindConfig:
    """From the flags, or (with --from_weight) from the weights, refusing flags that contradict them and
    a model the host's memory cannot hold (`device`: where it trains; None: it is not trained here)."""
    own_positions = weights.config.get("max_position_embeddings", CONFIG_POSITIONS) if weights else CONFIG_POSITIONS
    config = _model_config(args, tokenizer, weights, own_positions)
    check_host_memory(config, device, sharded=bool(getattr(args, "fsdp", 0)))
    check_gpu_memory(config, device, sharded=bool(getattr(args, "fsdp", 0)))
    check_moe_flags_act(args, config, from_weights=weights is not None)
    prefix = getattr(args, "save_weight", None)
    problem = pth_prefix_problem(prefix, "--save_dir") if prefix else None  # no prefix: no .pth
    if problem:
        raise ConfigError(problem)
    reason = minimind_unsupported(config) if prefix else None
    if reason:
        raise ConfigError(f"--save_weight: this model has no MiniMind .pth form: {reason}")
    if prefix and args.from_weight not in ("none", ""):
        check_pth_spares_the_start(args, config, prefix)
    check_position_tables(args, config, own_positions)
    return config


def check_moe_flags_act(args, config: MiniMindConfig, from_weights: bool) -> None:
    """MoE flags given for a dense model would change nothing: said, not dropped without a word."""
    given = [flag for flag in MOE_ONLY_FLAGS if flag in getattr(args, "explicit_flags", ())]
    if given and not config.use_moe:
        flags = ", ".join(f"--{flag}" for flag in given)
        act, them = ("acts", "it") if len(given) == 1 else ("act", "them")
        dense = "the --from_weight weights are dense" if from_weights else "this one is dense"
        fix = f"leave {them} out" if from_weights else f"give --use_moe 1, or leave {them} out"
        raise ConfigError(f"{flags} only {act} on a mixture-of-experts model, and {dense}: {fix}")


def check_pth_spares_the_start(args, config: MiniMindConfig, prefix: str) -> None:
    """The run's MiniMind .pth (`--save_weight`) must not be the `--from_weight` file: every save
    would write over the weights the run starts from (`--from_weight full_sft --save_weight full_sft`)."""
    target = os.path.join(args.save_dir, minimind_pth_name(prefix, config.hidden_size, config.use_moe))
    start = resolve_minimind_name(args.from_weight, args.save_dir, args.hidden_size, bool(args.use_moe))
    if os.path.isfile(target) and os.path.samefile(target, start):
        raise ConfigError(f"--save_weight {prefix} would write over {target}, the --from_weight weights this run "
                          "starts from: give another --save_weight")


def model_summary(config: MiniMindConfig, parameters: int) -> str:
    """The model as the memory refusals name it: its shape and its parameters."""
    return (f"hidden {config.hidden_size} x {config.num_hidden_layers} layers, vocabulary {config.vocab_size}: "
            f"{parameters / 1e9:.2f} B parameters")


def new_model_config(**fields) -> MiniMindConfig:
    """MiniMindConfig(**fields) of flags: a shape it refuses (heads that do not divide the width) is the
    user's error, one line."""
    try:
        return MiniMindConfig(**fields)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(config: MiniMindConfig, device: torch.device | None, sharded: bool) -> None:
    """Each process builds a fresh fp32 model in host memory before it moves to its device (one from
    --from_weight or a resume checkpoint is allocated on the device: there the bound is conservative);
    training on the CPU unsharded adds the gradients and AdamW's two moments there (16 bytes a
    parameter). A model that cannot fit even that lower bound would be killed by the OOM killer
    without a word: refused in one line, before the data is tokenized."""
    parameters = count_config_parameters(config)
    processes = processes_on_this_node(os.environ) or 1
    on_cpu = device is not None and device.type == "cpu" and not sharded
    each, memory = parameters * (16 if on_cpu else 4), host_memory_bytes()
    if each * processes <= memory:
        return
    if on_cpu:
        what = " to train on the CPU (fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter)"
    else:
        what = ": its fp32 weights, built on the host before they move to the GPU (4 bytes a parameter)"
    needed = f"{each / 2**30:.1f} GiB of host memory{what}"
    if processes > 1:
        needed = (f"{each / 2**30:.1f} GiB of host memory in each of the node's {processes} processes "
                  f"({each * processes / 2**30:.1f} GiB in all){what}")
    model = model_summary(config, parameters)
    raise ConfigError(f"the model ({model}) needs at least {needed}, more than this machine's "
                      f"{memory / 2**30:.1f} GiB")


def check_gpu_memory(config: MiniMindConfig, device: torch.device | None, sharded: bool) -> None:
    """Training on a GPU holds the fp32 weights, their gradients and AdamW's two moments there (16
    bytes a parameter) before any activation; under --fsdp 1 each of N processes a 1/N share, but
    each first builds the whole fp32 model on its GPU (4 bytes a parameter). A model past that lower
    bound runs out of memory where it moves to the GPU (a traceback), or at the first step, where the
    moments are allocated and the one line blames the batch: refused in one line, before the data is
    tokenized. A device torch cannot ask (no CUDA here) is left to the device check that refuses it."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return
    parameters = count_config_parameters(config)
    processes = dist.get_world_size() if sharded and dist.is_available() and dist.is_initialized() else 1
    needed = max(4 * parameters, 16 * parameters // processes)
    memory = torch.cuda.get_device_properties(device).total_memory
    if needed <= memory:
        return
    model = model_summary(config, parameters)
    if processes == 1:
        held = ("fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter; with several GPUs "
                "--fsdp 1 shards them")
    elif 16 * parameters // processes > 4 * parameters:
        held = (f"its share of the fp32 weights, gradients and AdamW's two moments over {processes} processes "
                "(--fsdp 1); more processes shard them further")
    else:
        held = "the whole fp32 model that each process builds before --fsdp 1 shards it: 4 bytes a parameter"
    raise ConfigError(f"the model ({model}) needs at least {needed / 2**30:.1f} GiB of GPU memory to train ({held}), "
                      f"more than the {memory / 2**30:.1f} GiB of {device}")


# Positions a config made from the flags covers at least (--max_seq_len sets more).
CONFIG_POSITIONS = 32768


def check_position_tables(args, config: MiniMindConfig, own_positions: int) -> None:
    """The model's RoPE tables cover max_position_embeddings (the config's own positions,
    `own_positions`, or --max_seq_len where it is more) in fp32 and are computed in host memory, at
    about four tables' size at the peak (and once per process of a node): tables that need more than
    a quarter of it are refused in one line, before the data is tokenized and before a config that
    would make chat and export allocate them again is written. The line blames --max_seq_len where
    the own positions would fit, else the heads' width (or the --from_weight model, which sets both)."""
    memory = host_memory_bytes()

    def peak(positions: int) -> int:  # four fp32 tables of positions x head_dim
        return 4 * positions * config.head_dim * 4

    positions = config.max_position_embeddings
    if peak(positions) <= memory // 4:
        return
    tables = (f"the RoPE tables for {positions} positions need {peak(positions) / 2**30:.1f} GiB, more than a "
              f"quarter of this machine's {memory / 2**30:.1f} GiB")
    if args.max_seq_len > own_positions and peak(own_positions) <= memory // 4:
        raise ConfigError(f"--max_seq_len {args.max_seq_len}: {tables}; --max_seq_len is the longest sample in tokens "
                          "(default 512)")
    width = f"heads of {config.head_dim} dimensions"
    if config.hidden_size == config.head_dim * config.num_attention_heads:
        width += f" (hidden_size {config.hidden_size} / {config.num_attention_heads} attention heads)"
    if getattr(args, "from_weight", "none") not in ("none", ""):
        fix = (f"the --from_weight model sets its heads and at least {own_positions} positions: it cannot be "
               "trained on this machine")
    else:
        fix = "give more --num_attention_heads or a smaller --hidden_size"
    raise ConfigError(f"{width}: {tables}; {fix}")


def _model_config(args, tokenizer, weights: Weights | None, own_positions: int) -> MiniMindConfig:
    flags = dict(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=max(own_positions, args.max_seq_len),
        rms_norm_eps=args.rms_norm_eps,
        use_moe=bool(args.use_moe),
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        router_aux_loss_coef=args.aux_loss_coef,
    )
    stop_ids = stop_token_ids(tokenizer)  # the template's end-of-turn token first, then eos if another one
    tokens = dict(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else stop_ids,  # generation_config.json stops at each
    )
    if weights is None:
        return new_model_config(**flags, **tokens, dropout=args.dropout)
    config = build_config(weights, **flags)  # the weights win; the flags fill what a .pth does not record
    config.dropout = args.dropout  # training-only: never part of the weights
    config.max_position_embeddings = max(config.max_position_embeddings, args.max_seq_len)
    for name, value in tokens.items():
        setattr(config, name, value)
    check_flags_against_weights(args, config, weights.source)
    check_vocab_fits(tokenizer, config.vocab_size, weights.tokenizer, weights.source)
    return config


def check_flags_against_weights(args, config: MiniMindConfig, source: str) -> None:
    explicit = set(getattr(args, "explicit_flags", ()))
    contradictions = []
    for flag, field in ARCHITECTURE_FLAGS.items():
        if flag not in explicit or (flag in MOE_ONLY_FLAGS and not config.use_moe):
            continue
        given, saved = getattr(args, flag), getattr(config, field)
        if (bool(given) if field == "use_moe" else given) != saved:
            contradictions.append(f"--{flag} {given} but {field} is {saved!r}")
    if contradictions:
        raise ConfigError(f"flags contradict the --from_weight architecture ({source}): " + "; ".join(contradictions)
                          + "; leave those flags out (the weights define the architecture)")


def build_model(args, config: MiniMindConfig, device: torch.device, weights: Weights | None = None,
                resumed: bool = False) -> MiniMindForCausalLM:
    """The fp32 model on `device`: from `weights` (see read_initial_weights) where given, or left for the
    resume checkpoint to fill (`resumed`), each allocated on `device` and never initialised at random
    (trainer/weights/inference.py `empty_model`: no float32 copy on the host); else a fresh model
    initialised on the host (seeded by the caller) and moved."""
    if weights is not None:
        model = model_from_weights(config, weights, device)
    elif resumed:
        model = empty_model(config, device)
    else:
        model = MiniMindForCausalLM(config).to(device)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


# --use_compile 1 pads every batch to a multiple of this many tokens (trainer/data_setup.py): few
# distinct lengths over an epoch of length-grouped batches, and GPU-friendly matrix sizes.
COMPILE_PAD_MULTIPLE = 64


def compile_model(model, device: torch.device, backend="inductor"):
    """--use_compile 1: each transformer block compiled on its own (`module.compile()`), as torchtitan
    does; `model` (and what wraps it: DDP, FSDP2) stays the object it was.

    One compiled block serves every layer (the same code; the weights are graph inputs). The
    embeddings, the RoPE rows, the mask and the chunked loss run eagerly between the blocks, and
    FSDP2's per-block hooks run outside the compiled code, so none of them breaks a graph. The
    batch length varies: dynamo compiles the first length as a constant and the second as a
    symbol (automatic dynamic shapes), after which the compiled code serves every length
    (tests/trainer/test_model_setup.py counts the recompiles over an epoch).

    On CPU inductor's C++ code is generated without SIMD vectorization: in torch 2.13 its
    vectorized kernels for int64-indexed gathers under dynamic shapes (the loss positions' targets,
    the RoPE rows of packed position ids) wrote out-of-range indices with ATEN_CPU_CAPABILITY=avx2
    and corrupted the heap ("free(): invalid pointer") with AVX-512 (tests/e2e/test_trainer.py::
    test_torch_compile_trains_like_eager, test_compiled_cpu_gathers_equal_eager). The compiled
    graph still fuses; CUDA (Triton) is not affected."""
    if device.type == "cpu" and backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = 1
    for module in model.modules():  # through any wrapper: DDP, FSDP2, a benchmark's objective
        if isinstance(module, MiniMindBlock):
            module.compile(backend=backend)
    return model


def build_optimizer(model: MiniMindForCausalLM, args, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms). Fused kernels on every device: they take
    `found_inf`, which skips a non-finite step on the device without the host reading anything
    (trainer/loop/loop.py: step_unless)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=True)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (all but its parameters): what `build_optimizer` made of this run's flags."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def keep_run_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """After a resume: loading an optimizer state takes each group's settings from the checkpoint (the
    --weight_decay, `fused` and `foreach` of the run that wrote it); back to this run's `settings`
    (`group_settings` before the load), so that --weight_decay acts as --learning_rate does, and back to
    fused AdamW, whose step counters live on the parameters' device in float32."""
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
