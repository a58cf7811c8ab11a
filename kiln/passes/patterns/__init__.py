"""Pattern families, one file each (``mkldnn.py``: oneDNN convolution prepack and fusion)."""
