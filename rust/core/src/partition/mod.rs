//! Hierarchical partitioning of a training graph into clusters (see docs/hierarchy.md).
//!
//! The FORWARD ops are partitioned; each backward op then joins a leaf by [`backward_owners`]
//! (the leaf of the forward op it differentiates, else the latest leaf whose forward values it
//! reads, never later than a backward op it reads from), or the root when there is no leaf.
//! Partitioning proceeds in rounds: every round a [`Partitioner`] groups the current
//! top-level units (ops in the first round, clusters after) into convex groups of at most
//! `max_size` units, adding one hierarchy level, until at most `top_max_size` units remain.
//! The driver here checks what partitioners return (disjoint, in range, size limits, acyclic
//! quotient), so partitioners only have to propose good groups.

mod bottom_up;
mod contiguous;
pub mod synthetic;
mod topo_interval;

pub use bottom_up::BottomUp;
pub use contiguous::Contiguous;
pub use topo_interval::TopoInterval;

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::graph::{Graph, Op, OpId, Phase, Role, TensorId};

/// Limits and score parameters shared by all partitioners.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionConfig {
    /// Most children of any cluster below the root (H-Rockmate's estimate: 20).
    pub max_size: usize,
    /// Most children of the root (30).
    pub top_max_size: usize,
    /// Size exponent of the bottom-up score `-(in + out) * |G|^alpha`.
    pub alpha: f64,
    /// Safety bound on the number of rounds.
    pub max_rounds: usize,
    /// Target ops per leaf of the contiguous partitioner (groups span 0.6x to 1.4x of it).
    pub leaf_size: usize,
    /// Target children per cluster above the leaves, for the contiguous partitioner.
    pub group_size: usize,
}

impl Default for PartitionConfig {
    fn default() -> Self {
        PartitionConfig { max_size: 20, top_max_size: 30, alpha: 0.5, max_rounds: 200, leaf_size: 6, group_size: 4 }
    }
}

/// Errors of partitioning (bad configuration or a graph the partitioner cannot handle).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    #[error("invalid partition configuration: {0}")]
    Config(String),
    #[error("unknown partitioner '{0}'; use one of: contiguous, bottom_up, topo_interval")]
    UnknownPartitioner(String),
    #[error("the operation was cancelled")]
    Cancelled,
}

/// One tensor that crosses units at the current level (forward-produced, counted bytes).
#[derive(Debug, Clone)]
pub struct BoundaryTensor {
    pub tensor: TensorId,
    /// The owner of its storage (itself unless it is a view).
    pub storage: TensorId,
    /// Bytes of its storage (0 for storages that existed before the iteration).
    pub bytes: u64,
    pub producer: usize,
    /// Units whose forward ops read it (dependencies of the unit DAG), deduplicated.
    pub fwd_consumers: Vec<usize>,
    /// Units whose backward ops read it (not dependencies, but they make it an interface).
    pub bwd_consumers: Vec<usize>,
    /// Read by something outside every unit (root backward ops) or a required result.
    pub external: bool,
}

/// The DAG of the current top-level units, with the tensors that cross them.
#[derive(Debug, Clone)]
pub struct UnitDag {
    pub n: usize,
    pub succ: Vec<Vec<usize>>,
    pub pred: Vec<Vec<usize>>,
    /// A topological order of the units, and each unit's position in it.
    pub topo: Vec<usize>,
    pub pos: Vec<usize>,
    pub tensors: Vec<BoundaryTensor>,
    /// Indices into `tensors`: produced by / read by (forward or backward) each unit.
    pub produces: Vec<Vec<usize>>,
    pub consumes: Vec<Vec<usize>>,
    /// A structural hash per unit, equal for units that look alike (repeated layers): the op's
    /// signature, or a hash of the children's kinds. Set by the driver (0 otherwise).
    pub kinds: Vec<u64>,
    /// 0 while the units are ops, then 1, 2, ... per grouping round.
    pub round: usize,
}

impl UnitDag {
    /// Build from boundary tensors; units are 0..n and their preferred order is their index.
    pub fn new(n: usize, tensors: Vec<BoundaryTensor>) -> UnitDag {
        UnitDag::build(n, tensors, false)
    }

    /// As [`UnitDag::new`], with `topo` the index order itself (which must be topological).
    pub fn in_index_order(n: usize, tensors: Vec<BoundaryTensor>) -> UnitDag {
        UnitDag::build(n, tensors, true)
    }

    fn build(n: usize, tensors: Vec<BoundaryTensor>, index_order: bool) -> UnitDag {
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut pred: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut produces: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut consumes: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, t) in tensors.iter().enumerate() {
            produces[t.producer].push(i);
            for &c in &t.fwd_consumers {
                if c != t.producer {
                    succ[t.producer].push(c);
                    pred[c].push(t.producer);
                }
            }
            for &c in t.fwd_consumers.iter().chain(&t.bwd_consumers) {
                if c != t.producer && consumes[c].last() != Some(&i) {
                    consumes[c].push(i);
                }
            }
        }
        for v in succ.iter_mut().chain(pred.iter_mut()) {
            v.sort_unstable();
            v.dedup();
        }
        let topo = if index_order {
            debug_assert!(succ.iter().enumerate().all(|(u, s)| s.iter().all(|&v| v > u)));
            (0..n).collect()
        } else {
            dfs_topo_order(n, &succ, &pred)
        };
        let mut pos = vec![0; n];
        for (i, &u) in topo.iter().enumerate() {
            pos[u] = i;
        }
        UnitDag { n, succ, pred, topo, pos, tensors, produces, consumes, kinds: vec![0; n], round: 0 }
    }

    /// Bytes of the tensors entering and leaving a group (each distinct tensor once).
    pub fn interface_bytes(&self, group: &[usize], scratch: &mut ScoreScratch) -> u64 {
        let ScoreScratch { mark, entering } = scratch;
        if mark.len() < self.n {
            mark.resize(self.n, false);
        }
        for &u in group {
            mark[u] = true;
        }
        let mut total = 0u64;
        entering.clear();
        for &u in group {
            for &ti in &self.produces[u] {
                let t = &self.tensors[ti];
                let leaves = t.external
                    || t.fwd_consumers.iter().chain(&t.bwd_consumers).any(|&c| !mark[c]);
                if leaves {
                    total += t.bytes;
                }
            }
            entering.extend(self.consumes[u].iter().copied().filter(|&ti| !mark[self.tensors[ti].producer]));
        }
        // an entering tensor counts once however many members read it
        entering.sort_unstable();
        entering.dedup();
        total += entering.iter().map(|&ti| self.tensors[ti].bytes).sum::<u64>();
        for &u in group {
            mark[u] = false;
        }
        total
    }

    /// H-Rockmate's score of a candidate group: -(in + out) * |G|^alpha (higher is better).
    pub fn score(&self, group: &[usize], alpha: f64, scratch: &mut ScoreScratch) -> f64 {
        -(self.interface_bytes(group, scratch) as f64) * (group.len() as f64).powf(alpha)
    }
}

/// Buffers reused across [`UnitDag::interface_bytes`] calls (start from `Default`).
#[derive(Debug, Default)]
pub struct ScoreScratch {
    mark: Vec<bool>,
    entering: Vec<usize>,
}

/// Reverse postorder of a depth-first search (sources and successors taken lowest index
/// first): a topological order that keeps chains and branches contiguous, so that groups of
/// neighbouring units occupy short spans of it.
fn dfs_topo_order(n: usize, succ: &[Vec<usize>], pred: &[Vec<usize>]) -> Vec<usize> {
    let mut visited = vec![false; n];
    let mut post = Vec::with_capacity(n);
    let mut stack: Vec<(usize, usize)> = Vec::new();
    // roots in decreasing index so that the lowest root's tree ends up first after reversal
    for r in (0..n).rev().filter(|&u| pred[u].is_empty()) {
        visited[r] = true;
        stack.push((r, succ[r].len()));
        while let Some(&mut (u, ref mut next)) = stack.last_mut() {
            if *next == 0 {
                post.push(u);
                stack.pop();
                continue;
            }
            // successors in decreasing index, so the lowest one is finished last
            *next -= 1;
            let v = succ[u][*next];
            if !visited[v] {
                visited[v] = true;
                stack.push((v, succ[v].len()));
            }
        }
    }
    assert_eq!(post.len(), n, "unit DAG must be acyclic");
    post.reverse();
    post
}

/// Kahn's algorithm preferring the smallest ready index; None when there is a cycle.
pub(crate) fn topo_sort(n: usize, succ: &[Vec<usize>], pred: &[Vec<usize>]) -> Option<Vec<usize>> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut indeg: Vec<usize> = pred.iter().map(|p| p.len()).collect();
    let mut heap: BinaryHeap<Reverse<usize>> =
        (0..n).filter(|&i| indeg[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse(u)) = heap.pop() {
        order.push(u);
        for &s in &succ[u] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                heap.push(Reverse(s));
            }
        }
    }
    (order.len() == n).then_some(order)
}

/// A strategy that proposes one round of grouping.
pub trait Partitioner: Send + Sync {
    fn name(&self) -> &'static str;
    /// Propose disjoint convex groups of 2..=max_size units, best first. Units left out stay
    /// as they are. The driver drops groups that would make the quotient cyclic.
    fn group(&self, dag: &UnitDag, max_size: usize, cfg: &PartitionConfig) -> Vec<Vec<usize>>;
    /// Whether the units' order is their index order (the forward ops' topological order,
    /// then the order of the groups) rather than a depth-first order; a partitioner that cuts
    /// intervals of that order asks for it.
    fn index_order(&self) -> bool {
        false
    }
}

/// The partitioner called `name` ("contiguous", "bottom_up" or "topo_interval").
pub fn partitioner_by_name(name: &str) -> Result<Box<dyn Partitioner>, PartitionError> {
    match name {
        "contiguous" => Ok(Box::new(Contiguous)),
        "bottom_up" => Ok(Box::new(BottomUp)),
        "topo_interval" => Ok(Box::new(TopoInterval)),
        other => Err(PartitionError::UnknownPartitioner(other.to_string())),
    }
}

/// A node of the hierarchy. Op and tensor ids refer to the partitioned graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub id: usize,
    /// 1 for leaves (children are ops); 1 + the highest child level otherwise.
    pub level: usize,
    pub is_leaf: bool,
    /// Child cluster ids, or the forward op ids of a leaf; in topological order.
    pub children: Vec<usize>,
    pub parent: Option<usize>,
    /// Every forward / backward op inside the cluster (all levels below), sorted by id.
    pub fwd_ops: Vec<OpId>,
    pub bwd_ops: Vec<OpId>,
    /// Backward ops owned by this cluster but by none of its child clusters (all of a leaf's;
    /// at the root, backward ops with no forward dependency).
    pub own_bwd_ops: Vec<OpId>,
    /// Tensors read by the cluster's ops that none of them produces, excluding tensors that
    /// exist before the iteration (inputs, parameters, buffers, tangents); sorted.
    pub inputs: Vec<TensorId>,
    /// Tensors produced inside that are read outside, or are `output`s; sorted.
    pub outputs: Vec<TensorId>,
    /// Hash of the canonical form (ops' targets, phases, times, workspaces, flags, tensor
    /// sizes and roles, internal edges, child classes). Equal hash and equal class => same
    /// options up to renaming.
    pub canon_hash: u64,
    /// Id of the first cluster with the same canonical form (itself if it is the first).
    pub representative: usize,
}

/// Op and tensor renaming between two equivalent clusters.
pub type Correspondence = (HashMap<OpId, OpId>, HashMap<TensorId, TensorId>);

/// Clusters of a graph; `clusters[root]` contains everything.
#[derive(Debug, Clone, PartialEq)]
pub struct Hierarchy {
    pub clusters: Vec<Cluster>,
    pub root: usize,
    /// The leaf cluster of each op (the root for backward ops without a forward anchor).
    pub op_cluster: Vec<usize>,
    pub partitioner: String,
}

impl Hierarchy {
    pub fn leaves(&self) -> impl Iterator<Item = &Cluster> {
        self.clusters.iter().filter(|c| c.is_leaf)
    }

    pub fn depth(&self) -> usize {
        self.clusters[self.root].level
    }

    /// Ops of a cluster in canonical order (forward by id, then backward by id): equivalent
    /// clusters correspond position by position in this order.
    pub fn canonical_ops(&self, cluster: usize) -> Vec<OpId> {
        let c = &self.clusters[cluster];
        c.fwd_ops.iter().chain(&c.bwd_ops).copied().collect()
    }

    /// Op and tensor correspondence from cluster `from` to cluster `to`, which must have the
    /// same representative. Tensors are those the cluster's ops read or write.
    pub fn correspondence(
        &self,
        g: &Graph,
        from: usize,
        to: usize,
    ) -> Result<Correspondence, String> {
        let (a, b) = (&self.clusters[from], &self.clusters[to]);
        if a.representative != b.representative {
            return Err(format!(
                "clusters {from} and {to} are not equivalent (representatives {} and {})",
                a.representative, b.representative
            ));
        }
        let (oa, ob) = (self.canonical_ops(from), self.canonical_ops(to));
        let ops: HashMap<OpId, OpId> = oa.iter().copied().zip(ob.iter().copied()).collect();
        let mut tensors = HashMap::new();
        for (&x, &y) in oa.iter().zip(&ob) {
            let (ox, oy) = (&g.ops[x], &g.ops[y]);
            for (&tx, &ty) in ox.inputs.iter().zip(&oy.inputs).chain(ox.outputs.iter().zip(&oy.outputs)) {
                tensors.insert(tx, ty);
            }
        }
        Ok((ops, tensors))
    }
}

impl Hierarchy {
    /// Check that, inside every non-leaf cluster, the children's forward and backward
    /// fragments can run atomically: the graph whose nodes are (child, phase) plus the
    /// cluster's own backward ops, with the data dependencies between them and
    /// "forward before backward" for each child, has no cycle. Err names a cluster on a cycle.
    pub fn check_fragment_order(&self, g: &Graph) -> Result<(), String> {
        self.fragment_cycle(g, &g.producers())
            .map_err(|c| format!("cluster {c}: its children's fragments depend on each other in a cycle"))
    }

    /// Err(cluster id) of a cluster whose children's fragments form a cycle. Each data edge
    /// between two leaves is charged to the lowest common ancestor of the leaves, between the
    /// two children of that ancestor that contain them.
    fn fragment_cycle(&self, g: &Graph, producer: &[Option<OpId>]) -> Result<(), usize> {
        let n = self.clusters.len();
        let mut depth = vec![0usize; n];
        let mut child_pos = vec![0usize; n];
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&c| std::cmp::Reverse(self.clusters[c].level));
        for &c in &order {
            if let Some(p) = self.clusters[c].parent {
                depth[c] = depth[p] + 1;
            }
            if !self.clusters[c].is_leaf {
                for (k, &ch) in self.clusters[c].children.iter().enumerate() {
                    child_pos[ch] = k;
                }
            }
        }
        let mut own_pos: HashMap<OpId, usize> = HashMap::new();
        for c in &self.clusters {
            for (i, &o) in c.own_bwd_ops.iter().enumerate() {
                if !c.is_leaf {
                    own_pos.insert(o, i);
                }
            }
        }
        // node of an op inside cluster `lca`, reached from below through child `below`
        let node = |lca: usize, below: Option<usize>, op: OpId| -> usize {
            match below {
                Some(ch) => 2 * child_pos[ch] + (g.ops[op].phase == Phase::Backward) as usize,
                None => 2 * self.clusters[lca].children.len() + own_pos[&op],
            }
        };
        let mut edges: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
        for (o, op) in g.ops.iter().enumerate() {
            for &t in &op.inputs {
                let Some(p) = producer[t] else { continue };
                let (mut a, mut b) = (self.op_cluster[p], self.op_cluster[o]);
                if a == b && self.clusters[a].is_leaf {
                    continue;
                }
                let (mut below_a, mut below_b) = (None, None);
                while depth[a] > depth[b] {
                    below_a = Some(a);
                    a = self.clusters[a].parent.unwrap();
                }
                while depth[b] > depth[a] {
                    below_b = Some(b);
                    b = self.clusters[b].parent.unwrap();
                }
                while a != b {
                    below_a = Some(a);
                    below_b = Some(b);
                    a = self.clusters[a].parent.unwrap();
                    b = self.clusters[b].parent.unwrap();
                }
                let (na, nb) = (node(a, below_a, p), node(a, below_b, o));
                if na != nb {
                    edges.entry(a).or_default().push((na, nb));
                }
            }
        }
        let mut ids: Vec<usize> = edges.keys().copied().collect();
        ids.sort_unstable();
        for c in ids {
            let cl = &self.clusters[c];
            let k = 2 * cl.children.len() + if cl.is_leaf { 0 } else { cl.own_bwd_ops.len() };
            let mut succ = vec![Vec::new(); k];
            let mut pred = vec![Vec::new(); k];
            for i in 0..cl.children.len() {
                succ[2 * i].push(2 * i + 1);
                pred[2 * i + 1].push(2 * i);
            }
            for &(x, y) in &edges[&c] {
                succ[x].push(y);
                pred[y].push(x);
            }
            for v in succ.iter_mut().chain(pred.iter_mut()) {
                v.sort_unstable();
                v.dedup();
            }
            if topo_sort(k, &succ, &pred).is_none() {
                return Err(c);
            }
        }
        Ok(())
    }
}

/// The block each backward op belongs to, given the blocks of the forward ops
/// (`block_of_fwd[o]`; `usize::MAX` for ops outside every block): the block of the forward op it
/// differentiates; without that link (operator logs of other tools carry none) the latest block
/// whose forward values (their storages' producers) it reads, or `last` when it reads none; and
/// never a later block than a backward op it reads from. A view of gradients (an op that
/// reads no forward value, reads backward ones and makes only views) joins the latest block it
/// may, that of those it reads from: it needs nothing its own forward op left, and run later
/// it would keep their storage alive across other blocks' backward parts (e.g. the transpose
/// making a weight's gradient differentiates the forward `t(weight)`, which a cut may put in an
/// earlier block than the matmul; placed there, the matmul's gradient would wait through
/// another block's backward).
/// When the blocks are intervals of a
/// topological order of the forward ops, numbered in that order, block numbers then never
/// increase along backward data flow, so the blocks' backward parts form a DAG. Forward ops get
/// `usize::MAX`. The hierarchy's leaves and block checkpointing both use this rule.
pub fn backward_owners(g: &Graph, block_of_fwd: &[usize], last: usize) -> Vec<usize> {
    let producer = g.producers();
    let roots = g.storage_roots();
    let order = crate::io::topo_order(g, &producer);
    let block = |o: OpId| block_of_fwd.get(o).copied().filter(|&b| b != usize::MAX && g.ops[o].phase == Phase::Forward);
    let mut owner = vec![usize::MAX; g.ops.len()];
    for &o in &order {
        let op = &g.ops[o];
        if op.phase == Phase::Forward {
            continue;
        }
        let made_by = |phase: Phase| {
            op.inputs.iter().any(|&t| producer[roots[t]].is_some_and(|p| g.ops[p].phase == phase))
        };
        // (views only, the case found: an op making new storage from gradients alone, run
        // earlier, may hold that storage longer; not measured)
        let view_of_gradients = !made_by(Phase::Forward)
            && made_by(Phase::Backward)
            && op.outputs.iter().all(|&t| g.tensors[t].alias_of.is_some());
        let mut want = match op.differentiates.filter(|&d| d < g.ops.len()) {
            Some(d) if !view_of_gradients => block(d).unwrap_or(last),
            _ => op.inputs.iter().filter_map(|&t| producer[roots[t]]).filter_map(block).max().unwrap_or(last),
        };
        // backward producers come earlier in `order`, so their owners are known
        for &t in &op.inputs {
            if let Some(p) = producer[t] {
                if owner[p] != usize::MAX {
                    want = want.min(owner[p]);
                }
            }
        }
        owner[o] = want;
    }
    owner
}

/// Anchor of each op: forward ops anchor to themselves; a backward op to the forward op
/// [`backward_owners`] gives it when every forward op is a block of its own, in topological
/// order; None when the graph has no forward op.
pub fn backward_anchors(g: &Graph) -> Vec<Option<OpId>> {
    let order = crate::io::topo_order(g, &g.producers());
    let fwd: Vec<OpId> = order.iter().copied().filter(|&o| g.ops[o].phase == Phase::Forward).collect();
    let mut pos = vec![usize::MAX; g.ops.len()];
    for (i, &o) in fwd.iter().enumerate() {
        pos[o] = i;
    }
    let Some(last) = fwd.len().checked_sub(1) else { return vec![None; g.ops.len()] };
    let owner = backward_owners(g, &pos, last);
    (0..g.ops.len())
        .map(|o| Some(if g.ops[o].phase == Phase::Forward { o } else { fwd[owner[o]] }))
        .collect()
}

/// Bytes counted for each tensor's storage (0 for views and pre-existing storages).
pub(crate) fn counted_bytes(g: &Graph, roots: &[TensorId]) -> Vec<u64> {
    g.tensors
        .iter()
        .enumerate()
        .map(|(t, x)| {
            let r = roots[t];
            if r == t && !x.role.is_preexisting() {
                x.bytes
            } else {
                0
            }
        })
        .collect()
}

/// Partition `g` with `partitioner` and build the full hierarchy (interfaces, canonical hashes).
pub fn build_hierarchy(
    g: &Graph,
    partitioner: &dyn Partitioner,
    cfg: &PartitionConfig,
) -> Result<Hierarchy, PartitionError> {
    build_hierarchy_cancellable(g, partitioner, cfg, &|| false)
}

/// As [`build_hierarchy`], polling `cancelled` between rounds.
pub fn build_hierarchy_cancellable(
    g: &Graph,
    partitioner: &dyn Partitioner,
    cfg: &PartitionConfig,
    cancelled: &(dyn Fn() -> bool + Sync),
) -> Result<Hierarchy, PartitionError> {
    if cfg.max_size < 2 {
        return Err(PartitionError::Config(format!(
            "max_size must be at least 2 (got {}); it bounds the children of a cluster",
            cfg.max_size
        )));
    }
    if cfg.leaf_size < 1 || cfg.group_size < 2 {
        return Err(PartitionError::Config(format!(
            "leaf_size must be at least 1 and group_size at least 2 (got {} and {})",
            cfg.leaf_size, cfg.group_size
        )));
    }
    if cfg.top_max_size < 1 {
        return Err(PartitionError::Config("top_max_size must be at least 1".into()));
    }
    if !cfg.alpha.is_finite() {
        return Err(PartitionError::Config(format!("alpha must be finite (got {})", cfg.alpha)));
    }
    let producer = g.producers();
    let roots = g.storage_roots();
    let bytes = counted_bytes(g, &roots);
    let anchors = backward_anchors(g);
    let order = crate::io::topo_order(g, &producer);
    let fwd: Vec<OpId> = order.iter().copied().filter(|&o| g.ops[o].phase == Phase::Forward).collect();

    // Level-0 units: forward ops, numbered in topological order.
    let mut unit_of_op: Vec<usize> = vec![usize::MAX; g.ops.len()];
    for (i, &o) in fwd.iter().enumerate() {
        unit_of_op[o] = i;
    }
    let mut tensors = Vec::new();
    let consumers = g.consumers();
    for (t, x) in g.tensors.iter().enumerate() {
        let Some(p) = producer[t] else { continue };
        if g.ops[p].phase != Phase::Forward {
            continue;
        }
        let mut fc = Vec::new();
        let mut bc = Vec::new();
        let mut external = x.role == Role::Output || (x.role.is_required() && consumers[t].is_empty());
        for &c in &consumers[t] {
            match (g.ops[c].phase, anchors[c]) {
                (Phase::Forward, _) => fc.push(unit_of_op[c]),
                (Phase::Backward, Some(a)) => bc.push(unit_of_op[a]),
                (Phase::Backward, None) => external = true,
            }
        }
        fc.sort_unstable();
        fc.dedup();
        bc.sort_unstable();
        bc.dedup();
        tensors.push(BoundaryTensor {
            tensor: t,
            storage: roots[t],
            bytes: bytes[roots[t]],
            producer: unit_of_op[p],
            fwd_consumers: fc,
            bwd_consumers: bc,
            external,
        });
    }

    // Each current unit is either an op (before the first round) or a cluster id.
    let mut clusters: Vec<Cluster> = Vec::new();
    let mut unit_items: Vec<usize> = fwd.clone();
    let new_dag = |n: usize, tensors: Vec<BoundaryTensor>, kinds: Vec<u64>, round: usize| {
        let mut dag = if partitioner.index_order() { UnitDag::in_index_order(n, tensors) } else { UnitDag::new(n, tensors) };
        dag.kinds = kinds;
        dag.round = round;
        dag
    };
    let mut dag = new_dag(unit_items.len(), tensors, fwd.iter().map(|&o| op_signature(g, &g.ops[o])).collect(), 0);
    let mut round = 0usize;
    let mut mark = vec![false; dag.n];
    loop {
        if cancelled() {
            return Err(PartitionError::Cancelled);
        }
        let first = round == 0;
        if !first && dag.n <= cfg.top_max_size {
            break;
        }
        if round >= cfg.max_rounds {
            break;
        }
        let proposed = partitioner.group(&dag, cfg.max_size, cfg);
        let mut groups = checked_groups(&dag, proposed, cfg.max_size, &mut mark);
        // Too little progress (fewer than a tenth of the units merged away): use topological
        // intervals for this round instead, so that the hierarchy stays shallow.
        let merged_away: usize = groups.iter().map(|grp| grp.len() - 1).sum();
        if !first && merged_away * 10 < dag.n.saturating_sub(cfg.top_max_size).min(dag.n) {
            let fallback = checked_groups(&dag, TopoInterval.group(&dag, cfg.max_size, cfg), cfg.max_size, &mut mark);
            let fallback_away: usize = fallback.iter().map(|grp| grp.len() - 1).sum();
            if fallback_away > merged_away {
                groups = fallback;
            }
        }
        if groups.is_empty() && !first {
            // no progress: fall back to topological intervals, which always exist
            groups = checked_groups(&dag, TopoInterval.group(&dag, cfg.max_size, cfg), cfg.max_size, &mut mark);
            if groups.is_empty() {
                break;
            }
        }
        // new units: groups first, then ungrouped units, ordered by topological position
        let mut new_of_old = vec![usize::MAX; dag.n];
        let mut new_units: Vec<(usize, Vec<usize>)> = Vec::new(); // (min pos, members)
        for grp in &groups {
            let min_pos = grp.iter().map(|&u| dag.pos[u]).min().unwrap();
            new_units.push((min_pos, grp.clone()));
        }
        let mut grouped = vec![false; dag.n];
        for grp in &groups {
            for &u in grp {
                grouped[u] = true;
            }
        }
        for (u, _) in grouped.iter().enumerate().filter(|(_, &in_group)| !in_group) {
            new_units.push((dag.pos[u], vec![u]));
        }
        new_units.sort_by_key(|(p, _)| *p);
        let mut new_items = Vec::with_capacity(new_units.len());
        let mut new_kinds = Vec::with_capacity(new_units.len());
        for (i, (_, members)) in new_units.iter().enumerate() {
            let mut members = members.clone();
            members.sort_by_key(|&u| dag.pos[u]);
            for &u in &members {
                new_of_old[u] = i;
            }
            new_kinds.push(if members.len() == 1 {
                dag.kinds[members[0]]
            } else {
                let mut h = DefaultHasher::new();
                members.iter().map(|&u| dag.kinds[u]).collect::<Vec<u64>>().hash(&mut h);
                h.finish()
            });
            // in the first round every op ends in a leaf (singletons included)
            if first || members.len() > 1 {
                let id = clusters.len();
                let children: Vec<usize> = members.iter().map(|&u| unit_items[u]).collect();
                let level = if first {
                    1
                } else {
                    1 + children.iter().map(|&c| clusters[c].level).max().unwrap()
                };
                for &c in &children {
                    if !first {
                        clusters[c].parent = Some(id);
                    }
                }
                clusters.push(empty_cluster(id, level, first, children));
                new_items.push(id);
            } else {
                new_items.push(unit_items[members[0]]);
            }
        }
        // boundary tensors of the new level (renumbered in place): drop those that became internal
        let remap = |v: &mut Vec<usize>| {
            for u in v.iter_mut() {
                *u = new_of_old[*u];
            }
            v.sort_unstable();
            v.dedup();
        };
        let tensors: Vec<BoundaryTensor> = std::mem::take(&mut dag.tensors)
            .into_iter()
            .filter_map(|mut t| {
                t.producer = new_of_old[t.producer];
                remap(&mut t.fwd_consumers);
                remap(&mut t.bwd_consumers);
                let p = t.producer;
                let crosses = t.external || t.fwd_consumers.iter().chain(&t.bwd_consumers).any(|&c| c != p);
                crosses.then_some(t)
            })
            .collect();
        unit_items = new_items;
        round += 1;
        dag = new_dag(unit_items.len(), tensors, new_kinds, round);
        mark = vec![false; dag.n];
    }

    // root
    let root = clusters.len();
    let level = 1 + unit_items.iter().map(|&c| clusters[c].level).max().unwrap_or(0);
    for &c in &unit_items {
        clusters[c].parent = Some(root);
    }
    clusters.push(empty_cluster(root, level, false, unit_items.clone()));

    // op -> leaf cluster, and cluster op sets
    let mut op_cluster = vec![root; g.ops.len()];
    for c in &clusters {
        if c.is_leaf {
            for &o in &c.children {
                op_cluster[o] = c.id;
            }
        }
    }
    // backward ops: the owner rule over the leaves, numbered left to right
    let mut leaves_in_order: Vec<usize> = Vec::new();
    let mut stack = vec![root];
    while let Some(c) = stack.pop() {
        if clusters[c].is_leaf {
            leaves_in_order.push(c);
        } else {
            stack.extend(clusters[c].children.iter().rev());
        }
    }
    if let Some(last) = leaves_in_order.len().checked_sub(1) {
        let mut block_of_fwd = vec![usize::MAX; g.ops.len()];
        for (rank, &leaf) in leaves_in_order.iter().enumerate() {
            for &o in &clusters[leaf].children {
                block_of_fwd[o] = rank;
            }
        }
        let owner = backward_owners(g, &block_of_fwd, last);
        for (o, op) in g.ops.iter().enumerate() {
            if op.phase == Phase::Backward {
                op_cluster[o] = leaves_in_order[owner[o]];
            }
        }
    }
    // Backward fragments must be able to run atomically. Where anchoring made siblings'
    // fragments depend on each other in a cycle, move backward ops up to the root: first the
    // ones anchored by heuristics (no `differentiates`), then all of the offending cluster's.
    // With every backward op at the root no cycle is possible, so this terminates.
    let mut hierarchy = Hierarchy { clusters, root, op_cluster, partitioner: partitioner.name().to_string() };
    let mut escalate = vec![false; hierarchy.clusters.len()];
    loop {
        for c in hierarchy.clusters.iter_mut() {
            c.fwd_ops.clear();
            c.bwd_ops.clear();
            c.own_bwd_ops.clear();
        }
        fill_op_sets(&mut hierarchy.clusters, &hierarchy.op_cluster, g);
        let Err(bad) = hierarchy.fragment_cycle(g, &producer) else { break };
        let all = escalate[bad];
        escalate[bad] = true;
        let moved: Vec<OpId> = hierarchy.clusters[bad]
            .bwd_ops
            .iter()
            .copied()
            .filter(|&o| all || g.ops[o].differentiates.is_none())
            .collect();
        let moved = if moved.is_empty() { hierarchy.clusters[bad].bwd_ops.clone() } else { moved };
        escalate[bad] = escalate[bad] || moved.len() == hierarchy.clusters[bad].bwd_ops.len();
        for o in moved {
            hierarchy.op_cluster[o] = root;
        }
    }
    let Hierarchy { mut clusters, root, op_cluster, .. } = hierarchy;

    fill_interfaces(&mut clusters, root, &op_cluster, g, &producer, &consumers);
    fill_canonical(&mut clusters, g);
    Ok(Hierarchy { clusters, root, op_cluster, partitioner: partitioner.name().to_string() })
}

fn empty_cluster(id: usize, level: usize, is_leaf: bool, children: Vec<usize>) -> Cluster {
    Cluster {
        id,
        level,
        is_leaf,
        children,
        parent: None,
        fwd_ops: Vec::new(),
        bwd_ops: Vec::new(),
        own_bwd_ops: Vec::new(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        canon_hash: 0,
        representative: id,
    }
}

/// Keep the proposed groups that are valid, in order, dropping any that overlap earlier ones,
/// break the size limits or make the quotient graph cyclic.
fn checked_groups(dag: &UnitDag, proposed: Vec<Vec<usize>>, max_size: usize, mark: &mut [bool]) -> Vec<Vec<usize>> {
    // Groups whose spans in the topological order are disjoint can be contracted together
    // without creating a cycle (as long as each is convex): every edge leaving a contracted span
    // leads forward. So a group overlapping an accepted group's span is dropped; the check
    // below only has to catch groups that are not convex.
    let mut spans: std::collections::BTreeMap<usize, usize> = std::collections::BTreeMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for mut grp in proposed {
        grp.sort_unstable();
        grp.dedup();
        if grp.len() < 2 || grp.len() > max_size || grp.iter().any(|&u| u >= dag.n || mark[u]) {
            continue;
        }
        let lo = grp.iter().map(|&u| dag.pos[u]).min().unwrap();
        let hi = grp.iter().map(|&u| dag.pos[u]).max().unwrap();
        if spans.range(..=hi).next_back().is_some_and(|(_, &end)| end >= lo) {
            continue;
        }
        spans.insert(lo, hi);
        for &u in &grp {
            mark[u] = true;
        }
        groups.push(grp);
    }
    for m in mark.iter_mut() {
        *m = false;
    }
    // contract and check for cycles; dissolve the lowest-priority group stuck in a cycle
    loop {
        let mut gid = vec![usize::MAX; dag.n];
        for (i, grp) in groups.iter().enumerate() {
            for &u in grp {
                gid[u] = i;
            }
        }
        let mut node = vec![0usize; dag.n];
        let mut k = groups.len();
        for u in 0..dag.n {
            node[u] = if gid[u] != usize::MAX {
                gid[u]
            } else {
                k += 1;
                k - 1
            };
        }
        let mut succ = vec![Vec::new(); k];
        let mut pred = vec![Vec::new(); k];
        for u in 0..dag.n {
            for &v in &dag.succ[u] {
                let (a, b) = (node[u], node[v]);
                if a != b {
                    succ[a].push(b);
                    pred[b].push(a);
                }
            }
        }
        for v in succ.iter_mut().chain(pred.iter_mut()) {
            v.sort_unstable();
            v.dedup();
        }
        match topo_sort(k, &succ, &pred) {
            Some(_) => return groups,
            None => {
                let reached = kahn_reached(k, &succ, &pred);
                let worst = (0..groups.len()).rev().find(|&i| !reached[i]).expect("cycle involves a group");
                groups.remove(worst);
            }
        }
    }
}

fn kahn_reached(n: usize, succ: &[Vec<usize>], pred: &[Vec<usize>]) -> Vec<bool> {
    let mut indeg: Vec<usize> = pred.iter().map(|p| p.len()).collect();
    let mut stack: Vec<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
    let mut reached = vec![false; n];
    while let Some(u) = stack.pop() {
        reached[u] = true;
        for &s in &succ[u] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                stack.push(s);
            }
        }
    }
    reached
}

fn fill_op_sets(clusters: &mut [Cluster], op_cluster: &[usize], g: &Graph) {
    for (o, &c) in op_cluster.iter().enumerate() {
        // walk up from the leaf (or root) adding the op to every ancestor
        let mut cur = Some(c);
        let own = c;
        while let Some(id) = cur {
            match g.ops[o].phase {
                Phase::Forward => clusters[id].fwd_ops.push(o),
                Phase::Backward => {
                    clusters[id].bwd_ops.push(o);
                    if id == own {
                        clusters[id].own_bwd_ops.push(o);
                    }
                }
            }
            cur = clusters[id].parent;
        }
    }
}

/// Interfaces of every cluster. Leaves scan their ops; a parent combines its children's
/// interfaces (plus its own backward ops), using tree intervals to test "produced inside".
fn fill_interfaces(clusters: &mut [Cluster], root: usize, op_cluster: &[usize], g: &Graph, producer: &[Option<OpId>], consumers: &[Vec<OpId>]) {
    // DFS intervals of the cluster tree: c contains leaf l iff enter[c] <= enter[l] < exit[c]
    let n = clusters.len();
    let (mut enter, mut exit) = (vec![0usize; n], vec![0usize; n]);
    let mut clock = 0;
    let mut stack = vec![(root, false)];
    while let Some((c, done)) = stack.pop() {
        if done {
            exit[c] = clock;
            continue;
        }
        enter[c] = clock;
        clock += 1;
        stack.push((c, true));
        if !clusters[c].is_leaf {
            for &k in clusters[c].children.iter().rev() {
                stack.push((k, false));
            }
        }
    }
    let inside = |c: usize, op: OpId| {
        let l = op_cluster[op];
        enter[c] <= enter[l] && enter[l] < exit[c]
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&c| clusters[c].level);
    for c in order {
        let mut cand_in: Vec<TensorId> = Vec::new();
        let mut cand_out: Vec<TensorId> = Vec::new();
        let ops_in: Vec<OpId> = if clusters[c].is_leaf {
            clusters[c].fwd_ops.iter().chain(&clusters[c].bwd_ops).copied().collect()
        } else {
            for &k in &clusters[c].children {
                cand_in.extend_from_slice(&clusters[k].inputs);
                cand_out.extend_from_slice(&clusters[k].outputs);
            }
            clusters[c].own_bwd_ops.clone()
        };
        for &o in &ops_in {
            cand_in.extend_from_slice(&g.ops[o].inputs);
            cand_out.extend_from_slice(&g.ops[o].outputs);
        }
        let mut inputs: Vec<TensorId> = cand_in
            .into_iter()
            .filter(|&t| !g.tensors[t].role.is_preexisting() && !producer[t].is_some_and(|p| inside(c, p)))
            .collect();
        let mut outputs: Vec<TensorId> = cand_out
            .into_iter()
            .filter(|&t| g.tensors[t].role == Role::Output || consumers[t].iter().any(|&r| !inside(c, r)))
            .collect();
        inputs.sort_unstable();
        inputs.dedup();
        outputs.sort_unstable();
        outputs.dedup();
        clusters[c].inputs = inputs;
        clusters[c].outputs = outputs;
    }
}

/// Canonical classes, bottom-up. Leaves compare their full canonical form. A parent can only
/// match another parent with the same sequence of child classes, so the full form (all its
/// ops) is built only for parents sharing that sequence with some other parent.
fn fill_canonical(clusters: &mut [Cluster], g: &Graph) {
    let op_sig: Vec<u64> = g.ops.iter().map(|op| op_signature(g, op)).collect();
    let mut scratch = LocalIds::new(g.tensors.len());
    let mut by_level: Vec<usize> = (0..clusters.len()).collect();
    by_level.sort_by_key(|&c| clusters[c].level);
    let mut seen: HashMap<Vec<u64>, usize> = HashMap::new();
    let mut level_start = 0;
    while level_start < by_level.len() {
        let level = clusters[by_level[level_start]].level;
        let level_end = by_level[level_start..].iter().position(|&c| clusters[c].level != level).map_or(by_level.len(), |k| level_start + k);
        let members = &by_level[level_start..level_end];
        // child-class signatures of the parents of this level
        let sigs: Vec<Option<Vec<u64>>> = members
            .iter()
            .map(|&c| {
                let cl = &clusters[c];
                (!cl.is_leaf).then(|| {
                    let mut kids: Vec<(OpId, u64)> = cl
                        .children
                        .iter()
                        .map(|&k| {
                            let first = clusters[k].fwd_ops.first().or(clusters[k].bwd_ops.first()).copied();
                            (first.unwrap_or(usize::MAX), clusters[k].representative as u64)
                        })
                        .collect();
                    kids.sort_unstable();
                    let mut sig: Vec<u64> = vec![u64::MAX - 7, cl.own_bwd_ops.len() as u64];
                    sig.extend(kids.iter().map(|&(_, r)| r));
                    sig
                })
            })
            .collect();
        let mut sig_count: HashMap<&Vec<u64>, usize> = HashMap::new();
        for s in sigs.iter().flatten() {
            *sig_count.entry(s).or_insert(0) += 1;
        }
        let mut results = Vec::with_capacity(members.len());
        for (i, &c) in members.iter().enumerate() {
            let form = match &sigs[i] {
                Some(sig) if sig_count[sig] == 1 => sig.clone(), // unique: cannot match another cluster
                Some(sig) => {
                    let mut f = canonical_form(&clusters[c], g, &op_sig, &mut scratch);
                    f.extend_from_slice(sig);
                    f
                }
                None => canonical_form(&clusters[c], g, &op_sig, &mut scratch),
            };
            let mut h = DefaultHasher::new();
            form.hash(&mut h);
            results.push((c, h.finish(), form));
        }
        for (c, hash, form) in results {
            clusters[c].canon_hash = hash;
            clusters[c].representative = *seen.entry(form).or_insert(c);
        }
        level_start = level_end;
    }
}

/// Everything about an op that renaming cannot change.
fn op_signature(g: &Graph, op: &Op) -> u64 {
    let mut h = DefaultHasher::new();
    op.target.hash(&mut h);
    (op.phase == Phase::Backward).hash(&mut h);
    op.time.to_bits().hash(&mut h);
    op.workspace.hash(&mut h);
    (op.random, op.mutates_buffer).hash(&mut h);
    for &t in op.inputs.iter().chain(&op.outputs) {
        let x = &g.tensors[t];
        (x.bytes, x.role.code(), x.alias_of.is_some()).hash(&mut h);
    }
    (op.inputs.len(), op.outputs.len()).hash(&mut h);
    h.finish()
}

/// Per-cluster local numbering of tensors without a hash map (stamped scratch array).
struct LocalIds {
    id: Vec<u64>,
    stamp: Vec<u32>,
    now: u32,
    next: u64,
}

impl LocalIds {
    fn new(n: usize) -> LocalIds {
        LocalIds { id: vec![0; n], stamp: vec![0; n], now: 0, next: 0 }
    }
    fn reset(&mut self) {
        self.now += 1;
        self.next = 0;
    }
    fn get(&mut self, t: TensorId) -> u64 {
        if self.stamp[t] != self.now {
            self.stamp[t] = self.now;
            self.id[t] = self.next;
            self.next += 1;
        }
        self.id[t]
    }
    fn peek(&self, t: TensorId) -> Option<u64> {
        (self.stamp[t] == self.now).then(|| self.id[t])
    }
}

/// A renaming-invariant description of a cluster's ops, tensors and internal edges, in the
/// canonical op order (forward by id, then backward by id).
fn canonical_form(c: &Cluster, g: &Graph, op_sig: &[u64], ids: &mut LocalIds) -> Vec<u64> {
    ids.reset();
    let ops: Vec<OpId> = c.fwd_ops.iter().chain(&c.bwd_ops).copied().collect();
    let is_in = |t: &TensorId| c.inputs.binary_search(t).is_ok();
    let is_out = |t: &TensorId| c.outputs.binary_search(t).is_ok();
    let local_op: HashMap<OpId, u64> = ops.iter().enumerate().map(|(i, &o)| (o, i as u64)).collect();
    let mut form = Vec::with_capacity(ops.len() * 8);
    for &o in &ops {
        let op = &g.ops[o];
        form.push(op_sig[o]);
        form.push(op.differentiates.map_or(u64::MAX, |d| local_op.get(&d).copied().unwrap_or(u64::MAX - 1)));
        for &t in op.inputs.iter().chain(&op.outputs) {
            let alias = g.tensors[t].alias_of.map_or(u64::MAX, |a| ids.peek(a).unwrap_or(u64::MAX - 1));
            form.push(ids.get(t));
            form.push(alias);
            form.push(is_in(&t) as u64 | (is_out(&t) as u64) << 1);
        }
    }
    form
}

#[cfg(test)]
pub(crate) mod tests;
