"""Layout hand-off for freezing: where convolution weights become channels-last constants.

Layout optimization (channels-last for convolution nets) is a later stage. Freezing calls
``convert_conv_weights`` on the ATen inference graph right after the parameters became constants and
before any folding, so that a later implementation only has to fill this function in:

    for each aten.convolution whose weight is a 4-D constant and layout_optimization picks channels-last:
        insert ``w2 = aten.clone(w, memory_format=torch.channels_last)`` and make the convolution read it

Constant folding then turns each ``clone`` into a channels-last constant (and conv-BN / binary folding
keep the layout, see ``fold.like``), so the compiled graph reads prepared weights at no runtime cost.
"""
from __future__ import annotations

import torch.fx as fx


def convert_conv_weights(gm: fx.GraphModule, opts) -> int:
    """Make convolution weights channels-last constants (in place); returns how many changed.

    Not implemented yet: the hook returns 0 and leaves ``gm`` as it is.
    """
    return 0
