"""`python -m model [--hidden_size N --num_hidden_layers N ...]`: print a config's parameter count."""

from . import MiniMindConfig, MiniMindForCausalLM, format_parameter_count
from scripts._common import ArgumentParser, fail, run_main


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, prog="python -m model")
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--use_moe", type=int, choices=(0, 1), default=0)
    args = parser.parse_args(argv)
    try:
        config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                use_moe=bool(args.use_moe))
    except ValueError as error:  # the config's own check of the sizes: one line naming the size
        fail(str(error))
    print(format_parameter_count(MiniMindForCausalLM(config)))
    return 0


if __name__ == "__main__":
    run_main(main)
