"""Warm lazy imports once in the test process so every forked rank inherits them.

A backward pass with an explicit gradient imports torch.fx's symbolic-shapes machinery and
sympy (seconds of work, far more on a loaded machine); pay it once here instead of once per
rank per test.
"""

from __future__ import annotations

import torch
import torch.fx.experimental.symbolic_shapes  # noqa: F401

_x = torch.ones(2, requires_grad=True)
(_x * 2).backward(torch.ones(2))
