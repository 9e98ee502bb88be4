"""Capture: tracing one training iteration of a torch model into a graph (``tracing``), the
values a trace reads and the guards on them (``values``), op times and workspaces
(``costs``), peak-memory measurement by the budget's definition (``memory``), and the kernels
that trace and runtime both call (``kernels``)."""
