"""Imported first by the harness's fork server (never by pytest itself): torch in the
fork server runs on one thread.

The fork server imports every test module the session collected (so that ranks start
without importing them). A module that computes a sizable tensor at import would start
torch's OpenMP thread pool there, and every rank forked afterwards would hang in its
first parallel operation (a forked child inherits a pool whose threads it does not have).
With one thread no pool is started; each rank sets its own thread count after the fork.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
