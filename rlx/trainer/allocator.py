"""Memory allocators of worker processes: on the CPU, glibc's malloc told to keep what torch
frees for the next tensor, instead of handing it back to the kernel; on a GPU, torch's CUDA
allocator growing its segments in place (use_allocator_settings).

A training step on the CPU allocates and frees the same large tensors over and over
(activations, gradients, a decode step's temporaries, the key/value buffers as rows leave).
glibc serves a large request with a fresh mapping (mmap) or trims the top of its heap once
enough of it is free, so the next request of that size touches new pages and the kernel
zeroes each one on its first touch: tens of thousands of page faults a step (measured on
2 cores with bench/trainer.py's 4-layer hidden-256 model: 2,000-50,000 per update, none with
this; a generation of 16 responses of up to 192 tokens 0.69-0.75 s, 0.54-0.64 s with this).
Raising the mapping threshold and the trim threshold keeps those pages in the heap for the
next tensor; the process's peak is what it was, it just stays near it. Very large blocks
(model weights, above MMAP_THRESHOLD) are still mapped and unmapped as before. This is what
a caching allocator (jemalloc, tcmalloc, PyTorch's own on GPUs) does; glibc's two settings
give it without another library.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 * 2**20  # blocks from here up are mapped on their own, as before
TRIM_THRESHOLD = 2**30  # free memory at the heap's top kept up to this much
# Settings a user may have made that this leaves alone: glibc's own variables, or another
# allocator preloaded.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module's note);
    True when it did. Not where the process is not linked with glibc (no mallopt) or where
    the user set malloc up already (USER_SETTINGS)."""
    if not sys.platform.startswith("linux") or any(env.get(name) for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


# torch's CUDA allocator settings, read when a process first allocates on its GPU.
CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# Segments that grow in place instead of a new block for every new size: a learner's passes
# change size every step, and on an H100 the 1.5B learner without checkpointing
# (bench/gpu_check.py, docs/gpu.md) held 72.0 GiB for 58.4 allocated without them, 58.9 for
# 58.3 with them, at the same speed. vLLM's sleep mode allocates from a memory pool that
# expandable segments cannot serve, so a process that holds a vLLM engine keeps the default.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_allocator_settings(use_gpu: bool, holds_vllm: bool) -> str | None:
    """Set this process's CUDA allocator settings before its first allocation (a GPU worker
    that holds no vLLM engine: EXPANDABLE_SEGMENTS) unless the job's environment sets them;
    returns what the process runs with."""
    if use_gpu and not holds_vllm:
        os.environ.setdefault(CUDA_ALLOC_CONF, EXPANDABLE_SEGMENTS)
    return os.environ.get(CUDA_ALLOC_CONF)
