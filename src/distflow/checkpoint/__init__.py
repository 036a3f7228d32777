"""Checkpoints: sharded, atomic torch.distributed.checkpoint (DCP) saves that each rank writes and
reads its own part of (checkpointer), the restricted reader that loads one as data, unpickling
only what DCP writes (reader), and the export to a plain HF folder (export)."""
