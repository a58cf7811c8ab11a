"""Pattern families, one file each, and the built-in pattern passes by stage.

``BUILTIN[stage]`` lists the ``PatternMatcherPass`` objects kiln runs on its own at ``stage``
('joint' or 'post_grad') when ``Options.pattern_matcher`` is on. Families that need more context run
from their own stage instead: ``mkldnn.prepack_convolutions`` runs from freezing (it needs constant
weights), and ``mkldnn.fuse_conv_relu`` is opt-in.
"""
from __future__ import annotations

BUILTIN: dict = {"joint": [], "post_grad": []}
