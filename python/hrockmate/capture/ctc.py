"""CTC loss in a traced iteration.

ATen's ``_ctc_loss`` has no fake kernel: its table of forward variables (``log_alpha``,
saved for the backward) is ``(batch, time, 2 * longest target + 1)``, and the longest target
is a value of ``target_lengths``. A traced iteration holds two ops of this module instead:
the same ATen kernels at run time, with fake kernels that size the table for the longest
target the ``targets`` tensor can hold (its second dimension for padded targets, all of it for
concatenated ones). The plan's memory is then an upper bound for every batch of those shapes,
whatever its lengths; the real table is smaller when the targets are (``SIZED_FOR_LONGEST``:
the cost model keeps the traced size).

The forward is substituted while tracing (``ValueReads``, in every try), below autograd, which
records ATen's backward of the call with the targets it was given; ``rewrite_backwards`` then
makes each backward of the captured joint graph this module's, with the arguments its forward
was given (the fixed-shape targets below).

Concatenated targets (1-D) may be longer than the lengths add up to: a trace gives them the
fixed shape of the labels they are selected from (``ValueReads``: transformers' CTC heads
select them with ``masked_select``), and the ops pass ATen the first ``sum(target_lengths)``,
which are the targets eager passes. ATen checks that size exactly.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

__all__ = ["BACKWARDS", "FORWARDS", "SIZED_FOR_LONGEST", "by_position", "ctc_loss",
           "ctc_loss_backward", "rewrite_backwards", "substitute"]


def _exact(targets: Tensor, target_lengths: Tensor) -> Tensor:
    """The targets eager would pass: concatenated ones cut to the lengths' sum."""
    if targets.dim() == 1:
        total = int(target_lengths.sum())
        if targets.shape[0] > total:
            return targets[:total]
    return targets


def _longest(targets: Tensor) -> int:
    """The longest target ``targets`` can hold."""
    return int(targets.shape[1] if targets.dim() == 2 else targets.shape[0])


@torch.library.custom_op("hrockmate::ctc_loss", mutates_args=())
def ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
             target_lengths: Tensor, blank: int, zero_infinity: bool
             ) -> tuple[Tensor, Tensor]:
    """``aten._ctc_loss`` (negative log likelihood per sample, ``log_alpha``)."""
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(
        log_probs, _exact(targets, target_lengths), input_lengths, target_lengths, blank,
        zero_infinity)
    return nll, log_alpha


@ctc_loss.register_fake
def _(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
      blank: int, zero_infinity: bool) -> tuple[Tensor, Tensor]:
    time, batch = log_probs.shape[0], log_probs.shape[1]
    return (log_probs.new_empty(batch),
            log_probs.new_empty(batch, time, 2 * _longest(targets) + 1))


@torch.library.custom_op("hrockmate::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                      target_lengths: Tensor, nll: Tensor, log_alpha: Tensor, blank: int,
                      zero_infinity: bool) -> Tensor:
    """``aten._ctc_loss_backward``: the gradient of ``log_probs``."""
    return torch.ops.aten._ctc_loss_backward.Tensor(
        grad, log_probs, _exact(targets, target_lengths), input_lengths, target_lengths, nll,
        log_alpha, blank, zero_infinity)


@ctc_loss_backward.register_fake
def _(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
      target_lengths: Tensor, nll: Tensor, log_alpha: Tensor, blank: int,
      zero_infinity: bool) -> Tensor:
    return torch.empty_like(log_probs)


_ATEN = torch.ops.aten
#: ATen's CTC forward (lengths as tensors, as int lists) and backward.
FORWARDS = (_ATEN._ctc_loss.Tensor, _ATEN._ctc_loss.default)
BACKWARDS = (_ATEN._ctc_loss_backward.Tensor, _ATEN._ctc_loss_backward.default)
#: Ops whose fake kernel sizes an output for the worst case of values it cannot see.
SIZED_FOR_LONGEST = (torch.ops.hrockmate.ctc_loss.default,)


def by_position(func: torch._ops.OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> tuple[object, ...]:
    """``func``'s arguments all by position, as its schema orders them, defaults filled in."""
    return (*args, *(kwargs.get(a.name, a.default_value)
                     for a in func._schema.arguments[len(args):]))


def substitute(args: tuple[object, ...], targets: Tensor) -> tuple[Tensor, Tensor]:
    """This module's forward for ATen's on ``args`` (all by position), with ``targets`` in
    place of the targets given; int-list lengths become tensors."""
    log_probs, _, *lengths = args[:4]
    lengths = [x if isinstance(x, Tensor) else torch.tensor(list(x), dtype=torch.long)
               for x in lengths]
    return torch.ops.hrockmate.ctc_loss.default(log_probs, targets, *lengths, *args[4:6])


def rewrite_backwards(joint: fx.GraphModule) -> None:
    """ATen's CTC backwards in ``joint`` whose ``log_alpha`` this module's forward made, as
    this module's backward with the targets and lengths that forward was given; nodes left
    unused by it (the targets as autograd saw them) are removed."""
    forward = torch.ops.hrockmate.ctc_loss.default
    backward = torch.ops.hrockmate.ctc_loss_backward.default
    for node in list(joint.graph.nodes):
        if node.op != "call_function" or node.target not in BACKWARDS:
            continue
        alpha = node.args[6]
        made = alpha.args[0] if isinstance(alpha, fx.Node) and alpha.args else None
        if not isinstance(made, fx.Node) or made.target is not forward:
            continue
        args = by_position(node.target, node.args, node.kwargs)
        old = [a for a in args[2:5] if isinstance(a, fx.Node)]
        node.args = (args[0], args[1], *made.args[1:4], *args[5:])
        node.kwargs = {}
        node.target = backward
        for a in old:
            _erase_unused(joint.graph, a)


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then its inputs while nothing uses them (pure ops only)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function" or n.is_impure():
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)
