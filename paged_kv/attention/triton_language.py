"""Triton's language, ``tl``, in a mode this machine can run, for lesson 12's kernels and their checks.

``from paged_kv.attention.triton_language import tl`` is how lesson 12, its exercise and its grader
import Triton. Triton fixes its mode, compiler or interpreter, when it is first imported, from
``TRITON_INTERPRET``; so this module first sets ``TRITON_INTERPRET=1`` where there is no CUDA
device and triton is not imported yet (the kernel then runs in Triton's interpreter, on CPU tensors,
with numpy), and leaves the variable alone where there is a GPU (Triton compiles). An import of this
module is a statement the grader keeps (it runs only a notebook's imports and definitions), so a
learner's kernel is graded in the same mode as it ran in the notebook.

Where triton cannot be imported (it publishes Linux wheels only), :data:`MISSING` says why and
``tl`` is a stand-in: a kernel written with it can still be defined (its ``tl.constexpr``
annotations exist), and any other use of it raises ``ImportError`` with that reason.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Why triton cannot be imported here, or ``""`` where it can.
MISSING = ""


class _NoTriton:
    """What ``tl`` is where triton cannot be imported: only ``constexpr`` exists, for signatures."""

    constexpr = "constexpr"

    def __getattr__(self, name: str):
        raise ImportError(MISSING)


try:
    import triton.language as tl
except ImportError:
    MISSING = (
        "triton is not installed here: it publishes Linux wheels only, so lesson 12's kernels cannot run"
    )
    tl = _NoTriton()

__all__ = ["MISSING", "tl"]
