"""MiniMind model: config, causal LM, and their registration with the transformers Auto classes.

Importing this package registers `minimind` with `AutoConfig` / `AutoModelForCausalLM`, and
marks both classes for remote code, so `save_pretrained(dir)` also writes the two source files
and an `auto_map` into `dir`: a plain transformers install can then load it with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_minimind import MiniMindConfig
from .modeling_minimind import MiniMindForCausalLM, MiniMindModel
from .param_count import count_config_parameters, count_parameters, format_parameter_count

AutoConfig.register("minimind", MiniMindConfig, exist_ok=True)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)
MiniMindConfig.register_for_auto_class()
MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "MiniMindConfig",
    "MiniMindForCausalLM",
    "MiniMindModel",
    "count_config_parameters",
    "count_parameters",
    "format_parameter_count",
]
