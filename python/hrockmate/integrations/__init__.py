"""HRockmate inside the training scripts users already have.

- ``calls``: the module's call surface: the wrapped model's ``forward`` signature (which
  transformers' ``Trainer`` reads to keep dataset columns), keyword arguments the sample lacked
  (``num_items_in_batch``), and ``torch.compile`` of a wrapped module;
- ``transformers``: ``HRockmateTrainer``, a ``transformers.Trainer`` that saves the wrapped
  ``PreTrainedModel`` (tied weights included) and reads its labels from the wrapped class;
- ``hrockmate.runtime.distributed``: every rank of a process group runs rank 0's plan.

docs/training-scripts.md describes what holds in each case and what it costs.
"""
