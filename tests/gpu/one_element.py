"""The preflight's one-element Triton kernel.

At module level because compiled Triton resolves a kernel's names (``tl``) in its
module's globals, not in an enclosing function's locals (no ``from __future__``
either, as in ``engine/model/triton_attention.py``); imported only after
``tests.gpu.device`` has chosen whether Triton interprets.
"""

import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)
