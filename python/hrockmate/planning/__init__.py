"""Planning: from a training graph and a budget to a schedule (a ``Plan``).

The hierarchical solver (method ``"hrockmate"``) follows H-Rockmate:

1. the Rust core partitions the graph (``clusters``, partitioner ``contiguous``): the forward
   ops, in a topological order, are cut into contiguous blocks of a few ops where few bytes
   cross; blocks are grouped again, level by level, until the top has at most ``top_size``;
   every backward op joins a block by the owner rule of docs/hierarchy.md (so the blocks'
   backward parts form a DAG);
2. bottom-up, each block is a level problem (``level``, modelled in ``ilp``) over its children
   (ops at the bottom, blocks above), whose *options* come from solving that level at several
   limits on its peak and on what it saves between forward and backward (``hierarchy``; other
   solvers may take a level: ``level_solvers``);
3. the top level is solved at the user's budget and its stages expanded into IR steps;
4. the schedule is refined (``refine``): recomputations that the memory left under the budget
   allows to skip are dropped.

The pipeline of one solve: ``api`` (the entry points ``solve``, ``solve_graph``, ``pareto``:
arguments, the budgets that need no search) -> ``search`` (the leaf-size sweep and the op-level
retry) -> ``methods`` (every method by name, ``solve(graph, budget, ctx) -> Candidate |
Infeasible``) -> ``policy`` (one try of a method, and what replaces it when it finds nothing or
loses to a simple strategy: ``strategies``, block and selective checkpointing, greedy eviction,
Checkmate's MILP; ``literature``, Rotor and TW-Remat from the Rust core). ``context`` holds the
frozen ``SolveContext`` every try gets and the time and search constants. ``entry`` is the
runtime's planning entry (a plan that fits with the runtime's own bytes), ``cache`` the on-disk
plan cache. Every plan is checked by the simulator before it is returned. docs/solver.md
describes the models and options.
"""
