"""TP styles for replicated modules whose outputs or parameters feed head- or width-sharded math.

A module left replicated over tp is correct only if each rank's gradient for it is the whole
gradient. Two kinds of module break that without any sharded parameter of their own:

- a replicated projection part of whose output every rank consumes only for its own heads
  (multi-head latent attention's ``kv_a_proj_with_mqa``: ``[latent | shared rope key]``, the rope
  key is expanded to the local heads only): the gradient of that part is a partial sum over tp
  ranks, and it flows on into the projection's weight and the residual stream;
- a module with parameters applied to a tp-sharded activation (xIELU's ``alpha_p``/``alpha_n``
  between a colwise and a rowwise linear): its parameter gradients are partial sums.

Both are summed over the tp group in backward here, so the math stays that of one process.

A third style keeps a rowwise linear's local output an ordinary tensor: models may update it in
place (Llama 4's MoE adds the routed experts into the shared expert's output with ``add_``), which
autograd forbids on the view ``DTensor.to_local`` returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, SequenceParallel

from automodel.fsdp2.torch_internals import rowwise_prepare_output


class _SumTailGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the last `width` features of the gradient over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        tail = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., : -ctx.width], tail], dim=-1), None, None


class SharedTailParallel(ParallelStyle):
    """A replicated linear whose last `width` output features every rank uses for its heads only.

    The weight stays whole on every rank (forward unchanged); the gradient reaching those output
    features is summed over the tp group, the rest (consumed by a colwise layer, whose input
    gradient torch already all-reduces) is left as it is. This is the HF plan style
    ``mla_kv_a_proj``: `width` is the rope part of a head (``qk_rope_head_dim``).
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        if width <= 0:
            raise ValueError(f"SharedTailParallel needs a positive width, got {width}")
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_features = getattr(module, "out_features", None)
        if out_features is not None and out_features <= self.width:
            raise ValueError(
                f"{type(module).__name__} has {out_features} outputs, not more than {self.width}"
            )
        group, width = device_mesh.get_group(), self.width

        def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            return _SumTailGradOverGroup.apply(output, width, group)

        module.register_forward_hook(hook)
        return module


class _LocalOwnedOutput(torch.autograd.Function):
    """``DTensor.to_local`` whose result is not a view (so it may be modified in place); no copy."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:  # noqa: ANN001
        ctx.mesh, ctx.placements, ctx.shape, ctx.stride = x.device_mesh, x.placements, x.shape, x.stride()
        # detach(): shares storage and the version counter (autograd still sees in-place updates of
        # anything saved), but is no view, which autograd forbids to update in a custom Function's output.
        return x.to_local().detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:  # noqa: ANN001
        return DTensor.from_local(
            grad, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape, stride=ctx.stride
        )


class RowwiseOwnedOutput(RowwiseParallel):
    """RowwiseParallel whose local output may be updated in place by the model."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        outputs = rowwise_prepare_output(output_layouts, False, mod, outputs, device_mesh)
        return _LocalOwnedOutput.apply(outputs) if use_local_output else outputs


def replicated_on_sharded_width() -> ParallelStyle:
    """A module with parameters applied to an activation sharded on its last dim (colwise output).

    Its parameters become replicated DTensors and its input a DTensor sharded on the last dim, so
    the parameters' gradients (partial sums over tp) are all-reduced by DTensor; the output goes
    on as the local shard the next (rowwise) layer expects.
    """
    return SequenceParallel(sequence_dim=-1, use_local_output=True)


__all__ = ["RowwiseOwnedOutput", "SharedTailParallel", "replicated_on_sharded_width"]
