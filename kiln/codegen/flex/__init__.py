"""FlexAttention kernels: ``flex_attention``'s higher-order ops as fused kernels (``lower_flex``): a Triton
forward (split-KV for decoding) and backward, a C++ forward; the ``score_mod``/``mask_mod`` subgraphs are
translated into them (``translate.py``, ``hop.py``). What cannot be written keeps the op, the reason logged.
"""
from kiln.codegen.flex.replace import lower_flex

__all__ = ["lower_flex"]
