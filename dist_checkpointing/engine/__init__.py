"""The engine: how bytes reach storage and come back, safely.

Everything under this package is ours (not a Megatron-Core module path):

- :mod:`.storage`: file-system backends behind one interface, the item format
  (the ``torch.save``-compatible zip writer and parser), the bucketed writer's
  worker processes and the reader;
- :mod:`.checkpoint`: the checkpoint directory handle, the commit protocol
  and integrity manifests;
- :mod:`.safety`: restricted unpicklers for everything read from a checkpoint;
- :mod:`.async_save`: async requests, the callers that run them and the queue;
- :mod:`.collectives`: one way for every rank to agree and fail together;
- :mod:`.process`: child processes, exit descriptions, GC pauses;
- :mod:`.knobs`: tunables with documented defaults and environment overrides.

The public face (Megatron-Core's module paths: ``serialization``,
``strategies.*``, ...) imports from here; nothing here imports the face,
except the ground modules every layer shares (``errors``, ``mapping``,
``dict_utils``, ``_torch_compat``).
"""
