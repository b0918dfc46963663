"""rlx: one recipe for multi-node RL post-training of language models."""

__version__ = "0.1.0"

import os as _os

# oneDNN's caches of product shapes, bounded before torch loads (it reads one of them as it
# does): rlx/trainer/model/cpu_linear.py says why. A value already set is left as it is.
ONEDNN_CACHES = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
for _name, _entries in ONEDNN_CACHES.items():
    _os.environ.setdefault(_name, _entries)
