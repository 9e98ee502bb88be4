"""transformers' ``Trainer`` over an ``HRockmate`` module.

The plain ``transformers.Trainer`` trains an ``HRockmate`` at its default arguments: it reads
the module's ``forward`` signature (the wrapped model's, ``hrockmate.integrations.calls``) to
keep the dataset's columns, passes ``num_items_in_batch`` (traced as an input), and scales
the returned loss in place. What it cannot do is save a model with tied weights: it saves
with ``save_pretrained`` only when ``Trainer.model`` is a ``PreTrainedModel`` (or one inside
a DDP/FSDP/compile wrapper it knows), and otherwise writes the bare state dict with
safetensors, which refuses tensors that share memory (GPT-2's ``transformer.wte.weight`` and
``lm_head.weight``). It also reads the label names and whether the model can return a loss
from the class of ``Trainer.model``.

``HRockmateTrainer`` is ``Trainer`` with those two read through to the wrapped model: it saves
the wrapped ``PreTrainedModel`` with its ``save_pretrained`` (config and tied weights as
transformers writes them, loadable with ``from_pretrained``) and takes the label names from
the wrapped class. ``make_trainer_class(SomeTrainer)`` does the same for a subclass of
``Trainer`` (TRL's trainers, a user's own).

``training_without_cache`` (``hrockmate.integrations.use_cache``, named here too) is the trace of
a model given a budget: transformers' decoders run without their cache of keys and values, as
transformers' own gradient checkpointing runs them in training.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from hrockmate.integrations.use_cache import training_without_cache

__all__ = ["HRockmateTrainer", "make_trainer_class", "training_without_cache", "unwrap"]

def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``HRockmate`` (itself when it is not one)."""
    from hrockmate.runtime.module import HRockmate

    return model.wrapped_model if isinstance(model, HRockmate) else model


@functools.lru_cache(maxsize=None)
def make_trainer_class(base: type) -> type:
    """A subclass of ``base`` (``transformers.Trainer`` or a subclass of it) that saves and
    introspects the model inside an ``HRockmate`` (see the module's docstring)."""
    from transformers.trainer import can_return_loss, find_labels

    class _Trainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = unwrap(self.model) if self.model is not None else None
            if inner is not None and inner is not self.model:
                if self.args.label_names is None:
                    self.label_names = find_labels(type(inner))
                self.can_return_loss = can_return_loss(type(inner))

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            wrapper = self.model
            inner = unwrap(wrapper)
            if inner is wrapper:
                return super()._save(output_dir, state_dict)
            # (the same parameters, so the same state dict: only the object saved differs)
            self.model = inner
            try:
                return super()._save(output_dir, state_dict)
            finally:
                self.model = wrapper

    _Trainer.__name__ = _Trainer.__qualname__ = f"HRockmate{base.__name__}"
    _Trainer.__doc__ = f"{base.__name__} over an HRockmate module (hrockmate.integrations." \
        "transformers)."
    return _Trainer


def __getattr__(name: str) -> Any:
    if name == "HRockmateTrainer":  # (transformers is imported only when asked for)
        from transformers import Trainer

        return make_trainer_class(Trainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
