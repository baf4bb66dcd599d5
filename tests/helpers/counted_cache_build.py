"""Run train_full_sft.py with a line on stderr, "rank R built the token cache of NAME", each time
this process builds or reuses a token cache itself (dataset/cache/node.py: local rank 0 of each
node does; the node's other ranks wait for it)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from dataset.cache import node as node_build

    original = node_build.build_or_reuse

    def counted_build(path, *args, **kwargs):
        print(f"rank {os.environ['RANK']} built the token cache of {path.name}", file=sys.stderr, flush=True)
        return original(path, *args, **kwargs)

    node_build.build_or_reuse = counted_build

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
