"""The loop IR: indexed expressions over a kernel's iteration space (``loops``), index arithmetic (``indexing``)."""
