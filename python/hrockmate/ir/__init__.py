"""The intermediate representation: training graphs (``graph``), schedules and the simulator
that judges them (``schedule``, in Rust), plans (``plan``) and memory budgets (``budget``).
Nothing here imports torch."""
