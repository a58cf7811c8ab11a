"""FlexAttention kernels: ``torch.nn.attention.flex_attention``'s higher-order ops as fused kernels.

``lower_flex(gm, opts, cpp)`` (``replace.py``) replaces each ``flex_attention`` and
``flex_attention_backward`` op of a post-grad graph by a call of a generated kernel: on the Triton
target a flash-attention forward (``triton_fwd.py``; a split-KV pair for decoding) and a three-kernel
backward (``triton_bwd.py``), launched by ``triton_module.py``; on the C++ target a forward
(``cpp.py``). The ops' ``score_mod``/``mask_mod`` subgraphs are translated into the kernels
(``translate.py``, ``mods.py``); the op's operands are parsed in ``hop.py``, tile sizes picked in
``config.py``. What cannot be written keeps the op (its dense implementation), with the reason logged.
"""
from kiln.codegen.flex.replace import lower_flex

__all__ = ["lower_flex"]
