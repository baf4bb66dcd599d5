"""The token cache: a data file tokenized once into memory-mapped files, reused while nothing that
decides its tokens changes.

The one entry: ``build_or_reuse`` gives the directory of a file's finished cache (building it, or
continuing a killed build, when it is missing), then ``open_finished`` opens it (``TokenCache``),
building nothing: a cache that is not finished raises ``CacheNotBuilt``. The training script's data
setup builds every cache as a step of its own (``build_or_reuse_on_node``: local rank 0 of each
node builds, the node's other ranks wait); a dataset then only opens a finished cache.

Inside, named by what each part is:

* ``key``        what names a cache: the data's digest, tokenizer, template, ``max_seq_len``, versions
* ``build``      build or reuse one cache: chunks of lines, parsed and encoded through ``dataset.tokens``
                 (in worker processes), into a resumable build, then ``meta.json``; open the finished one
* ``resumable``  the build that survives being killed (committed rows, ``progress.json``, the lock)
* ``workers``    the worker processes (one pipe pair each; a dead worker raises ``WorkerDied``)
* ``node``       under ``torch.distributed``: local rank 0 builds with every core of the node, the others wait
* ``waiting``    what a process waiting for another one's build prints, and how often it looks
* ``finished``   a finished cache: the one check of its files for damage, ``TokenCache`` (opened for reading)

From ``build_or_reuse`` to token ids: ``build`` hands each chunk to ``tokens``, the seam, which
hands the conversations to its encoder; ``workers`` only runs ``build``'s chunk function in other
processes.
"""

from .build import BuildInterrupted, CacheNotBuilt, build_or_reuse, open_finished
from .finished import TokenCache
from .key import TOKENS_VERSION, default_cache_root, measurement_key
from .node import build_or_reuse_on_node
from .resumable import CacheWriteError
from .workers import WorkerDied, default_num_proc

__all__ = ["BuildInterrupted", "CacheNotBuilt", "CacheWriteError", "TOKENS_VERSION", "TokenCache",
           "WorkerDied", "build_or_reuse", "build_or_reuse_on_node", "default_cache_root", "default_num_proc",
           "measurement_key", "open_finished"]
