"""The loop-level IR: indexed expressions over a kernel's iteration space (``loops``) and index
arithmetic (``indexing``)."""
