"""Capture: one training iteration of a torch model traced into a graph.

By job: ``trace`` (``trace_model``: the orchestration, and the tracing contract), ``joint``
(AOTAutograd's joint graph, the sample and the loss, ``Traced``), ``build`` (joint graph -> IR),
``randomness`` (random draws and their replay), ``regions`` (LayerDrop regions, with
``decisions``), ``failures`` (why a trace failed); the values a trace reads and the guards on
them (``values``), op times and workspaces (``costs``), peak-memory measurement by the budget's
definition (``memory``), plain PyTorch's peak that a fractional budget is of (``baseline``),
the model layouts that can be traced (``layout``), and the kernels that trace and runtime both
call (``kernels``).
"""
