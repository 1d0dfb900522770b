"""The inference engine.

Importing it asks PyTorch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE=1, as
PyTorch's CPU performance tuning guide recommends) unless the environment already sets that
variable. Tensors of 2 MB and more (the weights, the KV pools, a step's logits) are then aligned
to 2 MB and advised as huge pages, so a decode step that streams the weights and the KV cache
from memory walks 512 times fewer pages. PyTorch reads the variable once, at the process's first
allocation, which is why it is set on import. `THP_MEM_ALLOC_ENABLE=0 python -m
evals.bench_step` against `python -m evals.bench_step` measures what it gives.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
