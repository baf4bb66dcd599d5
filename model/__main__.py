"""`python -m model [--hidden_size N --num_hidden_layers N ...]`: print a config's parameter count."""

import argparse

from model import MiniMindConfig, MiniMindForCausalLM, format_parameter_count

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--hidden_size", type=int, default=768)
parser.add_argument("--num_hidden_layers", type=int, default=8)
parser.add_argument("--use_moe", type=int, default=0)
args = parser.parse_args()
config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe))
print(format_parameter_count(MiniMindForCausalLM(config)))
