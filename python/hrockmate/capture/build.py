"""IR building: the joint graph -> the graph IR (``hrockmate.ir.graph``), with where each IR
op and tensor comes from in the joint graph (``Traced``): roles of the results, storages and
their aliases (from the fake tensors and the op schemas), phases and the forward op each
backward op differentiates.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from hrockmate.capture.joint import Traced, TraceError, node_module
from hrockmate.capture.kernels import target_name
from hrockmate.capture.randomness import is_random
from hrockmate.ir.graph import Graph, Op, Tensor

__all__ = ["CUDA_BLOCK_BYTES", "allocated_bytes", "build_ir", "forward_results_first",
           "refuse_sparse_tensors", "starts_backward"]


def starts_backward(node: fx.Node) -> bool:
    """Whether ``node`` is part of the backward pass by itself: marked so by autograd, or
    reading a tangent (the phase of the IR starts at the first such node)."""
    from torch._functorch._aot_autograd import descriptors as d

    return bool(node.meta.get("autograd_backward")) or any(
        a.op == "placeholder" and isinstance(a.meta.get("desc"), d.TangentAOTInput)
        for a in node.all_input_nodes)


def forward_results_first(graph: fx.Graph) -> None:
    """Move ahead of the backward pass the nodes after its start that compute only results of
    the forward call from forward values (no tangent, no backward node in their inputs, used
    only by the graph's output or by such nodes). AOTAutograd can emit an output's view there
    (transformers' MobileBERT: its logits reshaped and detached after the gradients); the IR's
    phase starts at the first backward node, so such an output would be "produced by a backward
    op", which no schedule can return from the forward segment."""
    nodes = list(graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.op == "call_function"
                  and starts_backward(n)), None)
    if start is None:
        return
    backward: set[fx.Node] = set()
    later = [n for n in nodes[start:] if n.op == "call_function"]
    for n in later:
        if starts_backward(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    results: set[fx.Node] = set()
    for n in reversed(later):
        if n not in backward and n.users and all(u.op == "output" or u in results
                                                 for u in n.users):
            results.add(n)
    # (only those whose inputs come before the backward's start or move too)
    after_start = set(later)
    moved: list[fx.Node] = []
    for n in later:
        if n in results and all(a not in after_start or a in results
                                for a in n.all_input_nodes):
            moved.append(n)
        else:
            results.discard(n)
    first = nodes[start]
    for n in moved:
        first.prepend(n)  # (in order: each lands right before the backward's first node)


# ---- model outputs ------------------------------------------------------------------------------
#: What ``loss_fn`` may be: a function of the model's output, or the key / attribute name (str)

#: ``torch.cuda.memory_allocated`` counts; the CPU allocator's events report the requested size.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes a storage of ``nbytes`` occupies on ``device`` by the allocator's own count."""
    if device.type == "cuda" and nbytes > 0:
        return -(-int(nbytes) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return int(nbytes)


def _tensor_members(val: Any) -> list[tuple[int | None, torch.Tensor]]:
    if isinstance(val, torch.Tensor):
        return [(None, val)]
    if isinstance(val, (tuple, list)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _schema_alias_arg(node: fx.Node, index: int | None) -> fx.Node | None:
    """The input node that the op schema says output ``index`` aliases (``Tensor(a)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    rets = schema.returns
    ret = rets[0] if (index is None or len(rets) == 1) else rets[index]
    info = ret.alias_info
    if info is None:
        return None
    sets = set(info.before_set)
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & sets:
            if isinstance(value, fx.Node):
                return value
    for arg in schema.arguments:
        if arg.alias_info is not None and set(arg.alias_info.before_set) & sets:
            value = node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                return value
    return None


def _alias_source(
    node: fx.Node,
    index: int | None,
    val: torch.Tensor,
    tensor_of: dict[tuple[fx.Node, int | None], int],
    storage_owner: dict[Any, int],
) -> int | None:
    """The IR tensor whose storage output ``index`` of ``node`` shares, or None if it owns a new
    one. The schema's alias annotation names the input; ops that share storage without an
    annotation (``_unsafe_view``, ``unsafe_split``...) are caught by comparing the fake
    tensors' storages, preferring an input of the op, else the storage's first owner."""
    src = _schema_alias_arg(node, index)
    if src is not None:
        return tensor_of[(src, None)]
    key = _storage_key(val)
    owner = storage_owner.get(key)
    if owner is None:
        return None
    for a in _arg_nodes(node):
        if _storage_key(a.meta["val"]) == key:
            return tensor_of[(a, None)]
    return owner


def _insert_alias(gm: fx.GraphModule, src: fx.Node, where: fx.Node, *, before: bool,
                  backward: bool) -> fx.Node:
    ctx = gm.graph.inserting_before(where) if before else gm.graph.inserting_after(where)
    with ctx:
        node = gm.graph.call_function(torch.ops.aten.alias.default, (src,))
    node.meta = {k: v for k, v in src.meta.items() if k in ("nn_module_stack", "seq_nr")}
    node.meta["val"] = src.meta["val"]
    if backward:
        node.meta["autograd_backward"] = True
    return node


def refuse_sparse_tensors(gm: fx.GraphModule) -> None:
    """The IR sizes dense storages; a sparse tensor's (a sparse embedding's gradient) has
    none to size (``Cannot access storage of SparseTensorImpl`` was all a user saw)."""
    for node in gm.graph.nodes:
        for val in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor) and val.layout != torch.strided:
                what = (f"op {node.target}" if node.op == "call_function"
                        else f"input {node.name}")
                raise TraceError(
                    f"the training step has a {val.layout} tensor ({what}): hrockmate plans "
                    "dense (strided) tensors only. A sparse gradient comes from "
                    "nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True): build them "
                    "with sparse=False (the default; the gradient is then dense, and any "
                    "optimizer takes it)")


def build_ir(
    gm: fx.GraphModule,
    flat_kinds: list[tuple[str, Any]],
    flat_real: list[torch.Tensor],
    n_user_outputs: int,
    name: str,
    device: torch.device,
) -> Traced:
    """The IR of a joint graph (``gm``, edited in place: see the mapping in ``capture.trace``).
    ``flat_kinds[i]``: what the i-th placeholder of the primals is (("param", name),
    ("buffer", name) or ("input", leaf index)), ``flat_real[i]`` its real tensor;
    ``n_user_outputs``: how many of the joint graph's first outputs are the model's."""
    results = _Results.of(gm, flat_kinds, flat_real, n_user_outputs)
    forward_results_first(gm.graph)
    results.give_own_nodes(gm)
    # (the graph passes before this one edit the graph only: its code is made once, here;
    # the joint graph is run node by node, ``run_joint``, never as code)
    gm.recompile()
    ir = _IRBuilder(Graph(name=name), flat_kinds, device)
    ir.add_placeholders(gm.graph, flat_real)
    ir.add_nodes(gm, results.roles(flat_kinds, ir.input_tensor))
    return ir.traced(gm, results, flat_kinds)


class _Results:
    """Which joint-graph outputs play which role, by position: the model's outputs (and the
    bases of its views), gradients of primals, and in-place updates of buffers and inputs."""

    def __init__(self, n_user_outputs: int) -> None:
        self.n_user_outputs = n_user_outputs
        self.user_out: dict[int, fx.Node] = {}
        self.grads: dict[int, fx.Node] = {}  # flat input index -> its gradient
        self.mutations: dict[int, fx.Node] = {}  # flat input index -> its new value
        # outputs that are views of one intermediate: AOTAutograd differentiates that base (an
        # extra output, after the model's) and makes the views from it (the runtime does too)
        self.base_position: dict[Any, int] = {}

    @classmethod
    def of(cls, gm: fx.GraphModule, flat_kinds: list[tuple[str, Any]],
           flat_real: list[torch.Tensor], n_user_outputs: int) -> "_Results":
        from torch._functorch._aot_autograd import descriptors as d

        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        out_vals = list(out_node.args[0])
        out_descs = out_node.meta.get("desc")
        if out_descs is None or len(out_descs) != len(out_vals):
            raise TraceError(
                "this PyTorch version does not annotate AOTAutograd's joint graph outputs; "
                "hrockmate needs torch >= 2.9"
            )
        found = cls(n_user_outputs)
        for val, desc in zip(out_vals, out_descs):
            if val is None:
                continue
            if isinstance(desc, d.PlainAOTOutput):
                found.user_out[desc.idx] = val
            elif isinstance(desc, d.IntermediateBaseAOTOutput):
                found.base_position[desc] = n_user_outputs + len(found.base_position)
                found.user_out[found.base_position[desc]] = val
            elif isinstance(desc, d.GradAOTOutput):
                found.grads[_input_index(desc.grad_of)] = val
            elif isinstance(desc, d.InputMutationAOTOutput):
                idx = _input_index(desc.mutated_input)
                kind, key = flat_kinds[idx]
                if kind not in ("buffer", "input") or (
                        kind == "input" and flat_real[idx].requires_grad):
                    raise TraceError(
                        f"the model modifies its {kind} {key!r} in place during the forward "
                        "pass; hrockmate supports in-place updates of buffers (e.g. BatchNorm "
                        "running statistics) and of inputs that need no gradient (a QA head's "
                        "start_positions.clamp_()) only: make that update out of place"
                    )
                found.mutations[idx] = val
            elif isinstance(desc, d.MetadataMutationAOTOutput):
                raise TraceError(
                    "the model changes the shape or strides of one of its inputs in place "
                    "(e.g. x.t_() on an argument); use an out-of-place view instead"
                )
            # other bookkeeping outputs are not results of the iteration
        return found

    def give_own_nodes(self, gm: fx.GraphModule) -> None:
        """Required results that are placeholders or shared with another result get an alias
        node, so that every required result is produced by its own op."""
        from torch._functorch._aot_autograd import descriptors as d

        graph = gm.graph
        claimed: set[fx.Node] = set()
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        last_op = next(n for n in graph.nodes if n.op == "output").prev

        def own(node: fx.Node) -> fx.Node:
            if node.op == "placeholder":
                if isinstance(node.meta.get("desc"), d.TangentAOTInput):
                    node = _insert_alias(gm, node, last_op, before=False, backward=True)
                else:
                    node = _insert_alias(gm, node, first_op, before=True, backward=False)
            elif node in claimed:
                node = _insert_alias(gm, node, node, before=False,
                                     backward=bool(node.meta.get("autograd_backward")))
            claimed.add(node)
            return node

        for table in (self.user_out, self.grads, self.mutations):
            for k in sorted(table):
                table[k] = own(table[k])

    def roles(self, flat_kinds: list[tuple[str, Any]], input_tensor: dict[int, int]
              ) -> dict[fx.Node, tuple[str, int | None, int | None]]:
        """Result node -> (role, grad_of, updates) of its IR tensor."""
        role_of: dict[fx.Node, tuple[str, int | None, int | None]] = {}
        for n in self.user_out.values():
            role_of[n] = ("output", None, None)
        for idx, n in self.grads.items():
            kind, _key = flat_kinds[idx]
            role_of[n] = ("param_grad" if kind == "param" else "input_grad", input_tensor[idx],
                          None)
        for idx, n in self.mutations.items():
            role_of[n] = ("buffer_update", None, input_tensor[idx])
        return role_of


class _IRBuilder:
    """The IR's tensors and ops, made node by node, with where each comes from in the joint
    graph."""

    def __init__(self, ir: Graph, flat_kinds: list[tuple[str, Any]], device: torch.device
                 ) -> None:
        self.ir = ir
        self.flat_kinds = flat_kinds
        self.device = device
        self.tensor_of: dict[tuple[fx.Node, int | None], int] = {}
        self.tensor_nodes: list[tuple[fx.Node, int | None]] = []
        self.sources: dict[int, tuple[str, Any]] = {}
        self.op_nodes: list[fx.Node] = []
        self.used_names: set[str] = set()
        self.storage_owner: dict[Any, int] = {}
        self.input_tensor: dict[int, int] = {}  # flat input index -> its IR tensor

    def unique(self, base: str) -> str:
        cand, i = base, 1
        while cand in self.used_names:
            i += 1
            cand = f"{base}_{i}"
        self.used_names.add(cand)
        return cand

    def add_tensor(self, node: fx.Node, index: int | None, t: Tensor, val: torch.Tensor) -> int:
        tid = self.ir.add_tensor(t)
        self.tensor_of[(node, index)] = tid
        self.tensor_nodes.append((node, index))
        if t.alias_of is None:
            self.storage_owner.setdefault(_storage_key(val), tid)
        return tid

    def add_placeholders(self, graph: fx.Graph, flat_real: list[torch.Tensor]) -> None:
        """The pre-existing tensors: parameters, buffers, inputs and tangents."""
        from torch._functorch._aot_autograd import descriptors as d

        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            desc = node.meta.get("desc")
            val = node.meta["val"]
            if isinstance(desc, d.TangentAOTInput):
                role, src = "tangent", ("tangent", desc.output)
                tname = f"tangent:{node.name}"
                nbytes = int(val.untyped_storage().nbytes())
            else:
                if not isinstance(desc, d.PlainAOTInput):
                    raise TraceError(
                        f"unsupported input kind {type(desc).__name__} in the joint graph: two "
                        "inputs, parameters or buffers share memory (one is a view of "
                        "another); pass independent tensors"
                    )
                kind, key = self.flat_kinds[desc.idx]
                role = {"param": "parameter", "buffer": "buffer", "input": "input"}[kind]
                src = (kind, key)
                tname = f"{kind}:{key}"
                nbytes = int(flat_real[desc.idx].untyped_storage().nbytes())
            tid = self.add_tensor(
                node, None,
                Tensor(self.unique(tname), nbytes, role, shape=list(val.shape),
                       dtype=_dtype(val)), val,
            )
            self.sources[tid] = src  # (a tangent's is fixed up to an index into output_ids)
            if role != "tangent":
                self.input_tensor[desc.idx] = tid

    def add_nodes(self, gm: fx.GraphModule,
                  role_of: dict[fx.Node, tuple[str, int | None, int | None]]) -> None:
        """The ops, in the joint graph's order, and the tensors they make."""
        # Phase: everything from the first node marked as part of the backward pass on.
        backward = False
        first_fwd_of_seq: dict[int, int] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self._add_constant(gm, node)
            elif node.op != "call_function":
                continue
            elif node.target is operator.getitem:
                self._add_member(node, role_of)
            elif _tensor_members(node.meta.get("val")):
                # (a node that computes no tensor, e.g. a symbolic size, has nothing to
                # schedule)
                backward = backward or starts_backward(node)
                self._add_op(node, role_of, backward, first_fwd_of_seq)
        # A multi-output member selected by a getitem carries the getitem's role.
        for n, r in role_of.items():
            tid = self.tensor_of.get((n, None))
            if tid is not None and self.ir.tensors[tid].role == "activation":
                _apply_role(self.ir.tensors[tid], r)
        mutates_fix = {t for t, ten in enumerate(self.ir.tensors) if ten.role == "buffer_update"}
        for op in self.ir.ops:
            if any(o in mutates_fix for o in op.outputs):
                op.mutates_buffer = True

    def _add_constant(self, gm: fx.GraphModule, node: fx.Node) -> None:
        """A real tensor the model or loss_fn closes over, stored on the graph module."""
        val = getattr(gm, node.target)
        if not isinstance(val, torch.Tensor):
            return
        if val.requires_grad:
            raise TraceError(
                f"the model or loss_fn uses a tensor of shape {tuple(val.shape)} that "
                "requires grad but is neither a parameter, a buffer nor an input, so "
                "its gradient would be lost; register it as an nn.Parameter or pass "
                "it in the sample"
            )
        tid = self.add_tensor(node, None, Tensor(
            self.unique(f"constant:{node.target}"), int(val.untyped_storage().nbytes()),
            "buffer", shape=list(val.shape), dtype=_dtype(val)), node.meta.get("val", val))
        self.sources[tid] = ("constant", node.target)

    def _add_member(self, node: fx.Node,
                    role_of: dict[fx.Node, tuple[str, int | None, int | None]]) -> None:
        """A getitem selects a member of a multi-output op: no op, the member's tensor renamed
        after it."""
        parent, i = node.args[0], node.args[1]
        tid = self.tensor_of.get((parent, i))  # type: ignore[arg-type]
        if tid is None:
            raise TraceError(f"internal: getitem {node.name} selects an unknown tensor")
        self.tensor_of[(node, None)] = tid
        self.used_names.discard(self.ir.tensors[tid].name)
        self.ir.tensors[tid].name = self.unique(node.name)
        if node in role_of:
            _apply_role(self.ir.tensors[tid], role_of[node])

    def _add_op(self, node: fx.Node, role_of: dict[fx.Node, tuple[str, int | None, int | None]],
                backward: bool, first_fwd_of_seq: dict[int, int]) -> None:
        ir = self.ir
        inputs = [self.tensor_of[(a, None)] for a in _arg_nodes(node)]
        outputs: list[int] = []
        mutates = False
        for index, val in _tensor_members(node.meta.get("val")):
            alias = _alias_source(node, index, val, self.tensor_of, self.storage_owner)
            tname = node.name if index is None else f"{node.name}.{index}"
            t = Tensor(
                self.unique(tname),
                0 if alias is not None else allocated_bytes(val.untyped_storage().nbytes(),
                                                            self.device),
                "activation",
                alias_of=alias,
                shape=list(val.shape),
                dtype=_dtype(val),
            )
            if index is None and node in role_of:
                _apply_role(t, role_of[node])
            if t.role == "buffer_update":
                mutates = True
            outputs.append(self.add_tensor(node, index, t, val))
        seq = node.meta.get("seq_nr")
        phase = "backward" if backward else "forward"
        differentiates = None
        module = node_module(node)
        op_id = len(ir.ops)
        if phase == "forward":
            if seq is not None:
                first_fwd_of_seq.setdefault(seq, op_id)
        elif seq is not None and seq in first_fwd_of_seq:
            differentiates = first_fwd_of_seq[seq]
            module = module or ir.ops[differentiates].module
        ir.add_op(
            Op(
                name=node.name,
                phase=phase,
                time=0.0,
                inputs=inputs,
                outputs=outputs,
                target=target_name(node.target),
                workspace=0,
                differentiates=differentiates,
                random=is_random(node),
                mutates_buffer=mutates,
                module=module,
            )
        )
        self.op_nodes.append(node)

    def traced(self, gm: fx.GraphModule, results: _Results, flat_kinds: list[tuple[str, Any]]
               ) -> Traced:
        """The ``Traced`` of the built IR (the fields of the call: output and input
        structure, device, guards... are the caller's to fill)."""
        from torch._functorch._aot_autograd import descriptors as d

        tensor_of, sources = self.tensor_of, self.sources
        n_outputs = results.n_user_outputs + len(results.base_position)
        output_ids = [tensor_of[(results.user_out[k], None)] for k in range(n_outputs)
                      if k in results.user_out]
        if len(output_ids) != n_outputs:
            raise TraceError("internal: some model outputs are missing from the joint graph")
        for tid, (kind, key) in list(sources.items()):
            if kind == "tangent":
                if isinstance(key, d.PlainAOTOutput):
                    sources[tid] = ("tangent", key.idx)
                elif key in results.base_position:
                    sources[tid] = ("tangent", results.base_position[key])
                else:
                    raise TraceError(f"internal: tangent of an unexpected output kind {key}")

        def by_kind(table: dict[int, fx.Node], kind: str) -> dict[Any, int]:
            return {flat_kinds[i][1]: tensor_of[(n, None)] for i, n in table.items()
                    if flat_kinds[i][0] == kind}

        return Traced(
            graph=self.ir,
            gm=gm,
            op_nodes=self.op_nodes,
            tensor_nodes=self.tensor_nodes,
            sources=sources,
            output_ids=output_ids,
            output_spec=(pytree.tree_flatten(())[1], []),  # filled by the caller
            param_grads=by_kind(results.grads, "param"),
            input_grads=by_kind(results.grads, "input"),
            buffer_updates=by_kind(results.mutations, "buffer"),
            input_updates={int(k): v for k, v in by_kind(results.mutations, "input").items()},
            input_spec=pytree.tree_flatten(())[1],
            input_meta=[],
        )


def _input_index(desc: Any) -> int:
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, d.PlainAOTInput):
        return desc.idx
    raise TraceError(
        f"unsupported input kind {type(desc).__name__}: two inputs, parameters or buffers "
        "share memory; pass independent tensors"
    )


def _apply_role(t: Tensor, role: tuple[str, int | None, int | None]) -> None:
    t.role, t.grad_of, t.updates = role


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued fx nodes among an op's arguments, in argument order (repeats kept)."""
    found: list[fx.Node] = []
    pytree.tree_map(
        lambda a: found.append(a) if isinstance(a, fx.Node) else None,
        (node.args, node.kwargs),
    )
    return [a for a in found if isinstance(a.meta.get("val"), torch.Tensor)]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
