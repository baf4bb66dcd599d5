"""What the data teaches, for ``scripts/inspect_data.py`` and the training script's data summary.

* ``segments``    which part of a conversation each token comes from (system, tools block, reply, ...)
* ``report``      per source: rows sampled evenly, tokens and supervised tokens per segment, drops, warnings
* ``token_view``  the terminal and HTML views of rows, token by token
"""
