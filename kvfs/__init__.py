"""kvfs: keeps LLM KV-cache chunks out of the recompute path.

The core package (this one) holds the on-disk format, the backing store, the index and the
I/O queues. It imports neither torch nor pyfuse3: the mount daemon (``kvfs.mount``) runs on
storage nodes without a GPU stack, and the connector (``kvfs.connector``) in engine processes
without FUSE.
"""

__version__ = "0.1.0"
