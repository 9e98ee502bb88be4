//! Leaf option enumeration (see docs/hierarchy.md, "Options").
//!
//! An option of a leaf cluster is a pair of schedule fragments over the graph's own op/tensor
//! ids: `fwd_steps` runs the cluster's forward ops once, leaving its interface outputs and the
//! `saved` tensors alive; `bwd_steps` runs its backward ops once, recomputing the forward
//! tensors it needs that were not saved, and frees everything internal. The only decision is
//! which internal forward tensors to save (`S`); the rest follows fixed rules:
//! - forward: ops in topological order; an internal tensor is freed after its last forward
//!   reader unless it is saved;
//! - backward: before each backward op, the missing forward tensors it reads are recomputed
//!   (their missing ancestors too, in topological order); a forward tensor stays alive until
//!   the last backward op that reads it or one of its descendants, then it is freed;
//!   gradients are freed after their last reader inside the cluster (right away when nothing
//!   reads them, e.g. parameter gradients); tensors that leave the cluster are never freed.
//!
//! The Pareto front of `(saved_bytes, bwd_time)` over all `S` is found by exhaustive
//! branch-and-bound when the cluster has at most `exact_limit` candidate tensors and the search
//! ends within `max_evaluations` evaluations (a greedy path otherwise), thinned to `max_options`, and every returned option is checked by the
//! simulator on the cluster's sub-graph, whose numbers are the ones reported.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::graph::{Graph, Op, OpId, Phase, Role, Tensor, TensorId};
use crate::partition::Hierarchy;
use crate::schedule::{Schedule, Step};
use crate::simulate::simulate;

#[derive(Debug, Clone, PartialEq)]
pub struct OptionsConfig {
    /// Most options kept per leaf (store-all and recompute-all always among them).
    pub max_options: usize,
    /// Up to this many candidate tensors the front is searched exactly (branch-and-bound).
    pub exact_limit: usize,
    /// Most evaluations of the branch-and-bound per leaf; beyond it the search stops, the
    /// greedy path is added and the leaf is reported inexact. Bounds the cost per leaf.
    pub max_evaluations: usize,
}

impl Default for OptionsConfig {
    fn default() -> Self {
        OptionsConfig { max_options: 12, exact_limit: 20, max_evaluations: 1_000_000 }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptionsError {
    #[error("invalid options configuration: {0}")]
    Config(String),
    #[error("cluster {0} is not a leaf; options are enumerated for leaf clusters only")]
    NotLeaf(usize),
    #[error("cluster id {0} is out of range")]
    NoSuchCluster(usize),
    #[error("option {option} of cluster {cluster} fails the simulator: {message}")]
    Invalid { cluster: usize, option: usize, message: String },
    #[error("the operation was cancelled")]
    Cancelled,
}

/// One way to run a leaf cluster. Ids are the graph's. See the module doc for the rules.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterOption {
    pub fwd_steps: Vec<Step>,
    pub bwd_steps: Vec<Step>,
    /// Internal forward tensors alive between the fragments (freed by `bwd_steps`).
    pub saved: Vec<TensorId>,
    /// Interface inputs that must still be alive when `bwd_steps` runs.
    pub bwd_needs_inputs: Vec<TensorId>,
    /// Interface outputs produced by the forward ops that must still be alive then.
    pub bwd_needs_outputs: Vec<TensorId>,
    pub fwd_time: f64,
    pub bwd_time: f64,
    /// Bytes of the storages of `saved`.
    pub saved_bytes: u64,
    /// Peak during `fwd_steps` above (interface inputs + outputs + saved at its end).
    pub fwd_overhead: u64,
    /// Peak during `bwd_steps` above what is alive when it starts (saved, interface tensors
    /// alive, incoming gradients).
    pub bwd_overhead: u64,
}

/// Options of every cluster (empty for non-leaves), indexed by cluster id.
#[derive(Debug, Clone, PartialEq)]
pub struct AllOptions {
    pub options: Vec<Vec<ClusterOption>>,
    /// Whether each leaf's front is exact (false: greedy, more candidates than `exact_limit`).
    pub exact: Vec<bool>,
}

const NONE: usize = usize::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Exists before the iteration: always alive, never counted.
    Pre,
    /// Interface input (from another cluster): alive for the fragments, counted, never freed.
    In,
    /// Produced by a forward op, read outside or an `output`: never freed here.
    OutFwd,
    /// Produced by a backward op and read outside: never freed here.
    OutBwd,
    /// Produced by a forward op, internal.
    IntFwd,
    /// Produced by a backward op, internal.
    IntBwd,
}

/// A leaf cluster in local ids: ops 0..nf forward (topological), nf.. backward.
struct Leaf {
    ops: Vec<OpId>,
    nf: usize,
    op_in: Vec<Vec<usize>>,
    op_out: Vec<Vec<usize>>,
    op_time: Vec<f64>,
    op_ws: Vec<u64>,
    tensors: Vec<TensorId>,
    kind: Vec<Kind>,
    bytes: Vec<u64>,
    producer: Vec<usize>,
    /// Local root of a view when that root is local (else NONE); the root decides keeping.
    view_root: Vec<usize>,
    last_fwd_use: Vec<usize>,
    /// Last backward index (0-based among backward ops) reading the tensor directly or through a
    /// descendant it is needed to recompute; NONE if the backward never needs it.
    cone_last: Vec<usize>,
    /// Last backward index reading a backward-produced tensor.
    last_bwd_use: Vec<usize>,
    /// Tensors to free after backward op i (by cone_last / last_bwd_use).
    free_after: Vec<Vec<usize>>,
    candidates: Vec<usize>,
    /// For interface inputs: produced by a backward op (an incoming gradient).
    from_bwd: Vec<bool>,
}

/// Whole-graph data shared by every leaf.
struct Ctx {
    pos: Vec<usize>,
    producer: Vec<Option<OpId>>,
    roots: Vec<TensorId>,
    counted: Vec<u64>,
}

impl Ctx {
    fn new(g: &Graph) -> Ctx {
        let producer = g.producers();
        let order = crate::io::topo_order(g, &producer);
        let mut pos = vec![0; g.ops.len()];
        for (i, &o) in order.iter().enumerate() {
            pos[o] = i;
        }
        let roots = g.storage_roots();
        let counted = crate::partition::counted_bytes(g, &roots);
        Ctx { pos, producer, roots, counted }
    }
}

impl Leaf {
    fn new(g: &Graph, h: &Hierarchy, cluster: usize, ctx: &Ctx) -> Leaf {
        let order_pos = &ctx.pos;
        let c = &h.clusters[cluster];
        let mut fwd = c.fwd_ops.clone();
        fwd.sort_by_key(|&o| order_pos[o]);
        let mut bwd = c.bwd_ops.clone();
        bwd.sort_by_key(|&o| order_pos[o]);
        let nf = fwd.len();
        let ops: Vec<OpId> = fwd.into_iter().chain(bwd).collect();
        let mut local: HashMap<TensorId, usize> = HashMap::new();
        let mut tensors = Vec::new();
        let mut op_in = Vec::with_capacity(ops.len());
        let mut op_out = Vec::with_capacity(ops.len());
        let mut id = |t: TensorId, tensors: &mut Vec<TensorId>| {
            *local.entry(t).or_insert_with(|| {
                tensors.push(t);
                tensors.len() - 1
            })
        };
        for &o in &ops {
            op_in.push(g.ops[o].inputs.iter().map(|&t| id(t, &mut tensors)).collect::<Vec<_>>());
            op_out.push(g.ops[o].outputs.iter().map(|&t| id(t, &mut tensors)).collect::<Vec<_>>());
        }
        let nt = tensors.len();
        let mut producer = vec![NONE; nt];
        for (i, outs) in op_out.iter().enumerate() {
            for &t in outs {
                producer[t] = i;
            }
        }
        let (roots, counted) = (&ctx.roots, &ctx.counted);
        let mut kind = Vec::with_capacity(nt);
        let mut bytes = Vec::with_capacity(nt);
        let mut view_root = vec![NONE; nt];
        for (l, &t) in tensors.iter().enumerate() {
            let x = &g.tensors[t];
            let k = if x.role.is_preexisting() {
                Kind::Pre
            } else if producer[l] == NONE {
                Kind::In
            } else {
                let out = c.outputs.binary_search(&t).is_ok();
                match (producer[l] < nf, out) {
                    (true, true) => Kind::OutFwd,
                    (true, false) => Kind::IntFwd,
                    (false, true) => Kind::OutBwd,
                    (false, false) => Kind::IntBwd,
                }
            };
            kind.push(k);
            bytes.push(counted[t]);
        }
        // A view's storage is that of its nearest alias ancestor that is not an internal forward
        // tensor of this leaf (an interface tensor: kept alive by the parent, so keeping the view
        // costs nothing), else that of its storage root.
        for (l, &t) in tensors.iter().enumerate() {
            if g.tensors[t].alias_of.is_none() {
                continue;
            }
            let mut cur = t;
            view_root[l] = local.get(&roots[t]).copied().unwrap_or(NONE);
            while let Some(a) = g.tensors[cur].alias_of {
                if let Some(&la) = local.get(&a) {
                    if kind[la] != Kind::IntFwd {
                        view_root[l] = la;
                        break;
                    }
                }
                cur = a;
            }
        }
        let nb = ops.len() - nf;
        let mut last_fwd_use = vec![NONE; nt];
        for (i, ins) in op_in[..nf].iter().enumerate() {
            for &t in ins {
                last_fwd_use[t] = i;
            }
        }
        let mut last_bwd_use = vec![NONE; nt];
        let mut cone_last = vec![NONE; nt];
        for j in 0..nb {
            for &t in &op_in[nf + j] {
                last_bwd_use[t] = j;
                // walk the internal forward ancestors of t
                let mut stack = vec![t];
                while let Some(x) = stack.pop() {
                    if kind[x] != Kind::IntFwd || cone_last[x] == j {
                        continue;
                    }
                    cone_last[x] = j;
                    for &y in &op_in[producer[x]] {
                        stack.push(y);
                    }
                }
            }
        }
        let mut free_after = vec![Vec::new(); nb];
        for x in 0..nt {
            match kind[x] {
                Kind::IntFwd if cone_last[x] != NONE => free_after[cone_last[x]].push(x),
                Kind::IntBwd if last_bwd_use[x] != NONE => free_after[last_bwd_use[x]].push(x),
                _ => {}
            }
        }
        let from_bwd = tensors.iter().map(|&t| ctx.producer[t].is_some_and(|p| g.ops[p].phase == Phase::Backward)).collect();
        let candidates: Vec<usize> = (0..nt)
            .filter(|&x| kind[x] == Kind::IntFwd && cone_last[x] != NONE && g.tensors[tensors[x]].alias_of.is_none())
            .collect();
        Leaf {
            ops,
            nf,
            op_in,
            op_out,
            op_time: Vec::new(),
            op_ws: Vec::new(),
            tensors,
            kind,
            bytes,
            producer,
            view_root,
            last_fwd_use,
            cone_last,
            last_bwd_use,
            free_after,
            candidates,
            from_bwd,
        }
        .with_costs(g)
    }

    fn with_costs(mut self, g: &Graph) -> Leaf {
        self.op_time = self.ops.iter().map(|&o| g.ops[o].time).collect();
        self.op_ws = self.ops.iter().map(|&o| g.ops[o].workspace).collect();
        self
    }

    fn freeable(&self, x: usize) -> bool {
        matches!(self.kind[x], Kind::IntFwd | Kind::IntBwd)
    }

    /// Whether internal forward tensor x is kept by the forward fragment under `keep`
    /// (views follow their local root; zero-byte owners are always kept).
    fn kept(&self, x: usize, keep: &[bool]) -> bool {
        if self.cone_last[x] == NONE {
            return false;
        }
        let r = self.view_root[x];
        if r != NONE {
            return self.kind[r] != Kind::IntFwd || keep[r];
        }
        if self.bytes[x] == 0 && self.kind[x] == Kind::IntFwd {
            return true;
        }
        keep[x]
    }
}

/// Result of running the fixed rules under one saved set.
#[derive(Debug, Clone, Default)]
struct Eval {
    saved_bytes: u64,
    fwd_overhead: u64,
    bwd_overhead: u64,
    fwd_time: f64,
    bwd_time: f64,
}

struct Recorder {
    fwd: Vec<Step>,
    bwd: Vec<Step>,
    saved: Vec<usize>,
    needs: Vec<usize>,
}

/// Buffers reused across evaluations of one leaf.
#[derive(Default)]
struct Scratch {
    alive: Vec<bool>,
    plan: Vec<usize>,
    stack: Vec<usize>,
    planned: Vec<bool>,
}

/// Run both fragments under `keep` (indexed by local tensor); record steps when asked.
fn evaluate(leaf: &Leaf, keep: &[bool], rec: Option<&mut Recorder>) -> Eval {
    evaluate_with(leaf, keep, &mut Scratch::default(), rec)
}

fn evaluate_with(leaf: &Leaf, keep: &[bool], scratch: &mut Scratch, mut rec: Option<&mut Recorder>) -> Eval {
    let nt = leaf.tensors.len();
    let Scratch { alive, plan, stack, planned } = scratch;
    alive.clear();
    alive.extend(leaf.kind.iter().map(|k| matches!(k, Kind::Pre | Kind::In)));
    planned.clear();
    planned.resize(leaf.ops.len(), false);
    let mut mem: u64 = (0..nt).filter(|&x| leaf.kind[x] == Kind::In).map(|x| leaf.bytes[x]).sum();
    let mut peak = mem;
    let mut ev = Eval::default();
    let compute = |i: usize, alive: &mut [bool], mem: &mut u64, peak: &mut u64| {
        let mut new = 0;
        let mut dup = 0;
        for &t in &leaf.op_out[i] {
            if alive[t] {
                dup += leaf.bytes[t];
            } else {
                alive[t] = true;
                new += leaf.bytes[t];
            }
        }
        *peak = (*peak).max(*mem + new + dup + leaf.op_ws[i]);
        *mem += new;
    };
    // ---- forward fragment
    for i in 0..leaf.nf {
        compute(i, alive, &mut mem, &mut peak);
        ev.fwd_time += leaf.op_time[i];
        if let Some(r) = rec.as_deref_mut() {
            r.fwd.push(Step::Compute(leaf.ops[i]));
        }
        for &x in leaf.op_in[i].iter().chain(&leaf.op_out[i]) {
            let done = leaf.last_fwd_use[x] == NONE || leaf.last_fwd_use[x] <= i;
            if alive[x] && leaf.freeable(x) && done && !(leaf.kind[x] == Kind::IntFwd && leaf.kept(x, keep)) {
                alive[x] = false;
                mem -= leaf.bytes[x];
                if let Some(r) = rec.as_deref_mut() {
                    r.fwd.push(Step::Free(leaf.tensors[x]));
                }
            }
        }
    }
    let end_fwd = mem;
    ev.fwd_overhead = peak - end_fwd;
    ev.saved_bytes = (0..nt).filter(|&x| leaf.kind[x] == Kind::IntFwd && alive[x]).map(|x| leaf.bytes[x]).sum();
    if let Some(r) = rec.as_deref_mut() {
        r.saved = (0..nt).filter(|&x| leaf.kind[x] == Kind::IntFwd && alive[x]).collect();
    }
    // ---- backward fragment: incoming gradients are interface inputs produced by backward ops
    let start = mem;
    let mut bpeak = start;
    for j in 0..leaf.ops.len() - leaf.nf {
        let b = leaf.nf + j;
        // recompute missing internal forward inputs (and their missing ancestors)
        plan.clear();
        for &t in &leaf.op_in[b] {
            if !alive[t] && leaf.kind[t] == Kind::IntFwd {
                stack.push(t);
            }
        }
        while let Some(x) = stack.pop() {
            let p = leaf.producer[x];
            if alive[x] || planned[p] {
                continue;
            }
            planned[p] = true;
            plan.push(p);
            for &y in &leaf.op_in[p] {
                if !alive[y] && leaf.kind[y] == Kind::IntFwd {
                    stack.push(y);
                }
            }
        }
        plan.sort_unstable();
        for &p in plan.iter() {
            planned[p] = false;
            compute(p, alive, &mut mem, &mut bpeak);
            ev.bwd_time += leaf.op_time[p];
            if let Some(r) = rec.as_deref_mut() {
                r.bwd.push(Step::Compute(leaf.ops[p]));
                r.needs.extend(leaf.op_in[p].iter().copied());
            }
            // outputs nobody needs from here on are temporaries
            for &x in &leaf.op_out[p] {
                if alive[x] && leaf.freeable(x) && (leaf.cone_last[x] == NONE || leaf.cone_last[x] < j) {
                    alive[x] = false;
                    mem -= leaf.bytes[x];
                    if let Some(r) = rec.as_deref_mut() {
                        r.bwd.push(Step::Free(leaf.tensors[x]));
                    }
                }
            }
        }
        compute(b, alive, &mut mem, &mut bpeak);
        ev.bwd_time += leaf.op_time[b];
        if let Some(r) = rec.as_deref_mut() {
            r.bwd.push(Step::Compute(leaf.ops[b]));
            r.needs.extend(leaf.op_in[b].iter().copied());
        }
        let unread = |x: usize| leaf.kind[x] == Kind::IntBwd && leaf.last_bwd_use[x] == NONE;
        for &x in leaf.free_after[j].iter().chain(leaf.op_out[b].iter().filter(|&&x| unread(x))) {
            if alive[x] {
                alive[x] = false;
                mem -= leaf.bytes[x];
                if let Some(r) = rec.as_deref_mut() {
                    r.bwd.push(Step::Free(leaf.tensors[x]));
                }
            }
        }
    }
    ev.bwd_overhead = bpeak - start;
    ev
}

/// A point of the search: the saved set and its numbers.
#[derive(Debug, Clone)]
struct Point {
    keep: Vec<bool>,
    ev: Eval,
}

/// The Pareto front found so far, as saved bytes -> backward time (times strictly decrease as
/// saved bytes increase), for O(log n) dominance queries.
#[derive(Default)]
struct Front(std::collections::BTreeMap<u64, f64>);

impl Front {
    /// Some point has saved <= `saved` and time <= `time`.
    fn covers(&self, saved: u64, time: f64) -> bool {
        self.0.range(..=saved).next_back().is_some_and(|(_, &t)| t <= time)
    }
    /// Insert unless covered; returns whether it was inserted.
    fn insert(&mut self, saved: u64, time: f64) -> bool {
        if self.covers(saved, time) {
            return false;
        }
        let worse: Vec<u64> = self.0.range(saved..).take_while(|(_, &t)| t >= time).map(|(&k, _)| k).collect();
        for k in worse {
            self.0.remove(&k);
        }
        self.0.insert(saved, time);
        true
    }
}

/// Pareto front of (saved_bytes, bwd_time), lower overheads first among equals.
fn pareto(mut pts: Vec<Point>) -> Vec<Point> {
    pts.sort_by(|a, b| {
        a.ev.saved_bytes
            .cmp(&b.ev.saved_bytes)
            .then(a.ev.bwd_time.total_cmp(&b.ev.bwd_time))
            .then((a.ev.fwd_overhead + a.ev.bwd_overhead).cmp(&(b.ev.fwd_overhead + b.ev.bwd_overhead)))
    });
    let mut front: Vec<Point> = Vec::new();
    for p in pts {
        if front.last().is_none_or(|l| p.ev.bwd_time < l.ev.bwd_time) {
            front.push(p);
        }
    }
    front
}

/// Search the saved sets; returns the front and whether it is exact.
fn search(leaf: &Leaf, cfg: &OptionsConfig, cancel: &AtomicBool) -> (Vec<Point>, bool) {
    let nt = leaf.tensors.len();
    // decide big tensors first: the saved-bytes bound then grows fastest
    let mut cands: Vec<usize> = leaf.candidates.iter().copied().filter(|&x| leaf.bytes[x] > 0).collect();
    cands.sort_by_key(|&x| std::cmp::Reverse(leaf.bytes[x]));
    let direct: Vec<usize> = cands.iter().copied().filter(|&x| leaf.op_in[leaf.nf..].iter().any(|ins| ins.contains(&x))).collect();
    let mut scratch = Scratch::default();
    let mk = |set: &[usize]| {
        let mut keep = vec![false; nt];
        for &x in set {
            keep[x] = true;
        }
        keep
    };
    let mut point = |keep: Vec<bool>| {
        let ev = evaluate_with(leaf, &keep, &mut scratch, None);
        Point { keep, ev }
    };
    let mut pts = vec![point(mk(&direct)), point(mk(&[]))];
    let mut exact = false;
    if cands.len() <= cfg.exact_limit {
        let mut front = Front::default();
        for p in &pts {
            front.insert(p.ev.saved_bytes, p.ev.bwd_time);
        }
        let mut bb = Bnb { leaf, cands: &cands, keep: vec![false; nt], front, pts: Vec::new(), evals: 0, budget: cfg.max_evaluations, scratch: Scratch::default(), cancel };
        exact = bb.run(0, 0);
        pts.append(&mut bb.pts);
    }
    if !exact {
        // greedy: from store-all, drop the candidate that costs the least time per byte freed
        let mut cur: Vec<usize> = direct.clone();
        while !cur.is_empty() && !cancel.load(Ordering::Relaxed) {
            let base = evaluate_with(leaf, &mk(&cur), &mut Scratch::default(), None);
            let mut best: Option<(f64, usize, Point)> = None;
            for i in 0..cur.len() {
                let mut next = cur.clone();
                next.remove(i);
                let p = point(mk(&next));
                let freed = base.saved_bytes.saturating_sub(p.ev.saved_bytes).max(1) as f64;
                let ratio = (p.ev.bwd_time - base.bwd_time) / freed;
                if best.as_ref().is_none_or(|b| ratio < b.0) {
                    best = Some((ratio, i, p));
                }
            }
            let (_, i, p) = best.expect("non-empty");
            cur.remove(i);
            pts.push(p);
        }
    }
    (pareto(pts), exact)
}

/// Branch-and-bound over the candidates' keep/free decisions.
struct Bnb<'a> {
    leaf: &'a Leaf,
    cands: &'a [usize],
    keep: Vec<bool>,
    front: Front,
    pts: Vec<Point>,
    evals: usize,
    budget: usize,
    scratch: Scratch,
    cancel: &'a AtomicBool,
}

impl Bnb<'_> {
    fn eval(&mut self) -> Eval {
        self.evals += 1;
        evaluate_with(self.leaf, &self.keep, &mut self.scratch, None)
    }

    /// Explore decisions from `depth` on; false when stopped by the budget or cancellation.
    fn run(&mut self, depth: usize, kept_bytes: u64) -> bool {
        if self.evals >= self.budget || self.cancel.load(Ordering::Relaxed) {
            return false;
        }
        if depth == self.cands.len() {
            let ev = self.eval();
            if self.front.insert(ev.saved_bytes, ev.bwd_time) {
                self.pts.push(Point { keep: self.keep.clone(), ev });
            }
            return true;
        }
        // bound: nothing below saves fewer than kept_bytes, and keeping more never adds
        // recomputation, so nothing below is faster than with every undecided tensor kept
        for &x in &self.cands[depth..] {
            self.keep[x] = true;
        }
        let bound = self.eval();
        for &x in &self.cands[depth..] {
            self.keep[x] = false;
        }
        if self.front.covers(kept_bytes, bound.bwd_time) {
            return true;
        }
        let x = self.cands[depth];
        if !self.run(depth + 1, kept_bytes) {
            return false;
        }
        self.keep[x] = true;
        let done = self.run(depth + 1, kept_bytes + self.leaf.bytes[x]);
        self.keep[x] = false;
        done
    }
}

/// Keep at most `max` points: both extremes, then evenly spread by saved bytes.
fn thin(front: Vec<Point>, max: usize) -> Vec<Point> {
    if front.len() <= max.max(2) {
        return front;
    }
    let n = front.len();
    let m = max.max(2);
    let mut idx: Vec<usize> = (0..m).map(|k| k * (n - 1) / (m - 1)).collect();
    idx.dedup();
    let mut front = front;
    idx.iter().rev().map(|&i| front.swap_remove(i)).collect::<Vec<_>>().into_iter().rev().collect()
}

/// The cluster's sub-graph: its ops, the tensors they touch; interface inputs become `input`s,
/// incoming gradients `tangent`s, forward interface outputs `output`s and backward ones
/// `input_grad`s. Returns the graph and the local->global op and tensor ids.
pub fn leaf_subgraph(g: &Graph, h: &Hierarchy, cluster: usize) -> (Graph, Vec<OpId>, Vec<TensorId>) {
    let leaf = Leaf::new(g, h, cluster, &Ctx::new(g));
    subgraph_of(g, &leaf)
}

fn subgraph_of(g: &Graph, leaf: &Leaf) -> (Graph, Vec<OpId>, Vec<TensorId>) {
    let local: HashMap<TensorId, usize> = leaf.tensors.iter().enumerate().map(|(l, &t)| (t, l)).collect();
    let tensors = leaf
        .tensors
        .iter()
        .enumerate()
        .map(|(l, &t)| {
            let x = &g.tensors[t];
            let role = match leaf.kind[l] {
                Kind::Pre => x.role,
                Kind::In => {
                    if leaf.from_bwd[l] {
                        Role::Tangent
                    } else {
                        Role::Input
                    }
                }
                Kind::OutFwd if !x.role.is_required() => Role::Output,
                Kind::OutBwd if !x.role.is_required() => Role::InputGrad,
                _ => x.role,
            };
            let alias_of = match leaf.kind[l] {
                Kind::Pre | Kind::In => None,
                _ => x.alias_of.and_then(|a| local.get(&a).copied()),
            };
            Tensor {
                name: x.name.clone(),
                bytes: if x.alias_of.is_some() && alias_of.is_none() { 0 } else { x.bytes },
                role,
                alias_of,
                grad_of: None,
                updates: None,
                shape: None,
                dtype: None,
            }
        })
        .collect();
    let local_op: HashMap<OpId, usize> = leaf.ops.iter().enumerate().map(|(i, &o)| (o, i)).collect();
    let ops = leaf
        .ops
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            let op = &g.ops[o];
            Op {
                name: op.name.clone(),
                target: op.target.clone(),
                phase: op.phase,
                time: op.time,
                workspace: op.workspace,
                inputs: leaf.op_in[i].clone(),
                outputs: leaf.op_out[i].clone(),
                differentiates: op.differentiates.and_then(|d| local_op.get(&d).copied()),
                random: op.random,
                mutates_buffer: op.mutates_buffer,
                module: op.module.clone(),
            }
        })
        .collect();
    let sub = Graph { name: format!("{}:cluster", g.name), time_unit: g.time_unit.clone(), tensors, ops, meta: Default::default() };
    (sub, leaf.ops.clone(), leaf.tensors.clone())
}

/// Simulate an option of leaf `cluster` on its sub-graph; returns the simulator's numbers.
pub fn validate_option(
    g: &Graph,
    h: &Hierarchy,
    cluster: usize,
    opt: &ClusterOption,
) -> Result<crate::simulate::SimResult, String> {
    let (sub, ops, tensors) = leaf_subgraph(g, h, cluster);
    simulate_on(&sub, &ops, &tensors, opt)
}

fn simulate_on(sub: &Graph, ops: &[OpId], tensors: &[TensorId], opt: &ClusterOption) -> Result<crate::simulate::SimResult, String> {
    let lo: HashMap<OpId, usize> = ops.iter().enumerate().map(|(i, &o)| (o, i)).collect();
    let lt: HashMap<TensorId, usize> = tensors.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut steps = Vec::with_capacity(opt.fwd_steps.len() + opt.bwd_steps.len());
    for s in opt.fwd_steps.iter().chain(&opt.bwd_steps) {
        steps.push(match *s {
            Step::Compute(o) => Step::Compute(*lo.get(&o).ok_or_else(|| format!("op {o} is not in the cluster"))?),
            Step::Free(t) => Step::Free(*lt.get(&t).ok_or_else(|| format!("tensor {t} is not in the cluster"))?),
        });
    }
    let sched = Schedule { steps, forward_len: opt.fwd_steps.len() };
    simulate(sub, &sched).map_err(|e| e.to_string())
}

/// Enumerate, validate and number the options of one leaf.
fn leaf_options(g: &Graph, leaf: &Leaf, cluster: usize, cfg: &OptionsConfig, cancel: &AtomicBool) -> Result<(Vec<ClusterOption>, bool), OptionsError> {
    let (front, exact) = search(leaf, cfg, cancel);
    if cancel.load(Ordering::Relaxed) {
        return Err(OptionsError::Cancelled);
    }
    let (sub, ops, tensors) = subgraph_of(g, leaf);
    let mut out = Vec::with_capacity(front.len());
    for (k, p) in thin(front, cfg.max_options).into_iter().enumerate() {
        let mut rec = Recorder { fwd: Vec::new(), bwd: Vec::new(), saved: Vec::new(), needs: Vec::new() };
        let ev = evaluate(leaf, &p.keep, Some(&mut rec));
        // A view read in backward also needs the interface tensor whose storage it shares.
        let needed: Vec<usize> = rec
            .needs
            .iter()
            .flat_map(|&x| std::iter::once(x).chain((leaf.view_root[x] != NONE).then_some(leaf.view_root[x])))
            .collect();
        let mut needs_in: Vec<TensorId> = needed.iter().filter(|&&x| leaf.kind[x] == Kind::In).map(|&x| leaf.tensors[x]).collect();
        needs_in.sort_unstable();
        needs_in.dedup();
        let mut needs_out: Vec<TensorId> = needed.iter().filter(|&&x| leaf.kind[x] == Kind::OutFwd).map(|&x| leaf.tensors[x]).collect();
        needs_out.sort_unstable();
        needs_out.dedup();
        let mut opt = ClusterOption {
            fwd_steps: rec.fwd,
            bwd_steps: rec.bwd,
            saved: rec.saved.iter().map(|&x| leaf.tensors[x]).collect(),
            bwd_needs_inputs: needs_in,
            bwd_needs_outputs: needs_out,
            fwd_time: ev.fwd_time,
            bwd_time: ev.bwd_time,
            saved_bytes: ev.saved_bytes,
            fwd_overhead: ev.fwd_overhead,
            bwd_overhead: ev.bwd_overhead,
        };
        let sim = simulate_on(&sub, &ops, &tensors, &opt)
            .map_err(|message| OptionsError::Invalid { cluster, option: k, message })?;
        // the simulator's accounting is authoritative (it follows storages through views)
        let after = sim.bytes_after_forward;
        opt.fwd_overhead = sim.forward_peak.saturating_sub(after);
        opt.bwd_overhead = sim.backward_peak.saturating_sub(after);
        out.push(opt);
    }
    Ok((out, exact))
}

/// Options of one leaf cluster.
pub fn enumerate_leaf(g: &Graph, h: &Hierarchy, cluster: usize, cfg: &OptionsConfig) -> Result<(Vec<ClusterOption>, bool), OptionsError> {
    check_config(cfg)?;
    let c = h.clusters.get(cluster).ok_or(OptionsError::NoSuchCluster(cluster))?;
    if !c.is_leaf {
        return Err(OptionsError::NotLeaf(cluster));
    }
    let leaf = Leaf::new(g, h, cluster, &Ctx::new(g));
    leaf_options(g, &leaf, cluster, cfg, &AtomicBool::new(false))
}

fn check_config(cfg: &OptionsConfig) -> Result<(), OptionsError> {
    if cfg.max_options < 2 {
        return Err(OptionsError::Config(format!(
            "max_options must be at least 2 (got {}): store-all and recompute-all are always kept",
            cfg.max_options
        )));
    }
    if cfg.max_evaluations == 0 {
        return Err(OptionsError::Config("max_evaluations must be at least 1".into()));
    }
    if cfg.exact_limit > 40 {
        return Err(OptionsError::Config(format!(
            "exact_limit {} is too large: the exact search is exponential in it (use <= 40)",
            cfg.exact_limit
        )));
    }
    Ok(())
}

/// Options of every leaf, solving each class of identical leaves once (in parallel) and mapping
/// the representative's options onto the others. `cancel` stops the work early.
pub fn enumerate_all(g: &Graph, h: &Hierarchy, cfg: &OptionsConfig, cancel: &AtomicBool) -> Result<AllOptions, OptionsError> {
    check_config(cfg)?;
    let ctx = Ctx::new(g);
    let reps: Vec<usize> = h.clusters.iter().filter(|c| c.is_leaf && c.representative == c.id).map(|c| c.id).collect();
    type Solved = Result<(usize, Vec<ClusterOption>, bool), OptionsError>;
    let solved: Vec<Solved> = reps
        .par_iter()
        .map(|&c| {
            if cancel.load(Ordering::Relaxed) {
                return Err(OptionsError::Cancelled);
            }
            let leaf = Leaf::new(g, h, c, &ctx);
            leaf_options(g, &leaf, c, cfg, cancel).map(|(o, e)| (c, o, e))
        })
        .collect();
    let mut options = vec![Vec::new(); h.clusters.len()];
    let mut exact = vec![true; h.clusters.len()];
    for r in solved {
        let (c, o, e) = r?;
        options[c] = o;
        exact[c] = e;
    }
    for c in h.clusters.iter().filter(|c| c.is_leaf && c.representative != c.id) {
        let (ops, tensors) = h.correspondence(g, c.representative, c.id).map_err(OptionsError::Config)?;
        options[c.id] = options[c.representative].iter().map(|o| map_option(o, &ops, &tensors)).collect();
        exact[c.id] = exact[c.representative];
    }
    Ok(AllOptions { options, exact })
}

/// Rename an option's ids through op and tensor maps (from [`Hierarchy::correspondence`]).
pub fn map_option(o: &ClusterOption, ops: &HashMap<OpId, OpId>, tensors: &HashMap<TensorId, TensorId>) -> ClusterOption {
    let step = |s: &Step| match *s {
        Step::Compute(x) => Step::Compute(ops[&x]),
        Step::Free(t) => Step::Free(tensors[&t]),
    };
    let ts = |v: &[TensorId]| {
        let mut r: Vec<TensorId> = v.iter().map(|t| tensors[t]).collect();
        r.sort_unstable();
        r
    };
    ClusterOption {
        fwd_steps: o.fwd_steps.iter().map(step).collect(),
        bwd_steps: o.bwd_steps.iter().map(step).collect(),
        saved: ts(&o.saved),
        bwd_needs_inputs: ts(&o.bwd_needs_inputs),
        bwd_needs_outputs: ts(&o.bwd_needs_outputs),
        ..o.clone()
    }
}

#[cfg(test)]
mod tests;
