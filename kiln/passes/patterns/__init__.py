"""Pattern families, one file each (``mkldnn.pack_conv_weights`` runs from freezing)."""
