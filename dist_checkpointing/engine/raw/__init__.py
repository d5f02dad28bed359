"""The ``raw_bytes`` layout: tensor bytes at aligned offsets, a binary index.

- :mod:`.index`: the ``.raw_index`` format (JSON header, numpy tables), bounded parsing;
- :mod:`.writer`: placing a rank's chunks in its data files and writing them;
- :mod:`.save`: one save as an async request (plan, stage, write, index at finalize);
- :mod:`.load_plan`: which stored bytes land where, for any requested layout;
- :mod:`.reshard_plan`: the part of that plan where the layout changed (flat ranges,
  boxes, staged reads);
- :mod:`.reader`: coalesced ``preadv`` reads straight into the targets, verified;
- :mod:`.load`: one load (index, plan, read, copies, objects) and the metadata views.
"""
