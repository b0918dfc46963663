"""Installs the copy ledger (copyledger.py, next to this file) in every Python process that
starts with this folder first on PYTHONPATH and RLX_COPY_LEDGER naming a folder to write to;
without RLX_COPY_LEDGER it does nothing. bench/weight_sync.py sets both for the processes of
a measured push (Ray's and vLLM's included, which inherit the environment)."""

import os

if os.environ.get("RLX_COPY_LEDGER"):
    try:
        import copyledger

        copyledger.install()
    except Exception as exc:  # a broken ledger must not break the process it watches
        import sys

        print(f"copy ledger not installed: {exc!r}", file=sys.stderr)
