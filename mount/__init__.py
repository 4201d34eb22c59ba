"""The kvfs FUSE daemon (pyfuse3 + trio). Run it with ``kvfs mount``."""
