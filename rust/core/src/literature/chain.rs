//! Chain structure in an IR graph, and Rotor on it.
//!
//! The useful forward ops, in execution order, are cut into stages: a cut before position `c`
//! is allowed when every tensor crossing it is produced inside the stage the cut closes, so each
//! stage reads only the previous stage's outputs (its *boundary* tensors) and pre-existing
//! tensors. Cuts are taken greedily, as early as possible, which gives the largest number of
//! stages. A backward op belongs to the stage of the latest forward tensor it reads and may
//! also read the boundary tensors of the stage before; its forward tensors constrain the cuts
//! the same way. The stage sequence and sizes become a [`Chain`]; a Rotor operation sequence is
//! turned back into IR steps ([`ChainStructure::schedule`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::graph::{Graph, OpId, Phase, Role, TensorId};
use crate::io::{op_label, tensor_label};
use crate::limits::{Stop, Stopped};
use crate::schedule::Schedule;
use crate::simulate::SimResult;

use super::rotor::{self, Bounds, Chain, ChainOp, Stage, StateOption};
use super::twremat::useful_order;
use super::{checked, Emitter, LiteratureError};

/// Default number of memory slots of the dynamic program.
pub const DEFAULT_SLOTS: usize = 500;

/// The stages of a chain-structured graph (stages numbered from 1 in [`ChainOp`]s; index
/// `k - 1` here).
#[derive(Debug, Clone)]
pub struct ChainStructure {
    /// Forward ops of each stage, in execution order.
    pub forward: Vec<Vec<OpId>>,
    /// Backward ops of each stage, in execution order.
    pub backward: Vec<Vec<OpId>>,
    /// Forward ops needed to produce the stage's boundary tensors and required results.
    output_ops: Vec<Vec<OpId>>,
    /// Boundary tensors `a_k`: read by the next stage (forward or backward).
    boundary: Vec<Vec<TensorId>>,
    /// Full state `ā_k`: the boundary plus what the stage's backward reads.
    state: Vec<Vec<TensorId>>,
    /// Backward tensors alive between the backward of stage k+1 and that of stage k (`δ_k`).
    grads: Vec<Vec<TensorId>>,
    /// Bytes alive for the whole iteration once produced (`output` tensors).
    permanent_bytes: u64,
    /// Per tensor: produced by a backward op.
    backward_tensor: Vec<bool>,
}

/// Storage bytes of a set of tensors, each counted storage once (views count their base).
fn set_bytes(g: &Graph, roots: &[TensorId], set: &[TensorId], skip: &[bool]) -> u64 {
    let mut seen: Vec<TensorId> = set.iter().map(|&t| roots[t]).filter(|&r| !skip[r]).collect();
    seen.sort_unstable();
    seen.dedup();
    seen.iter().map(|&r| g.tensors[r].bytes).sum()
}

impl ChainStructure {
    /// Detect the chain structure of `g` (a validated graph). Errors name the op or tensor that
    /// prevents a chain of at least two stages.
    pub fn detect(g: &Graph) -> Result<ChainStructure, LiteratureError> {
        let producer = g.producers();
        let order = useful_order(g, &producer);
        let fwd: Vec<OpId> = order.iter().copied().filter(|&o| g.ops[o].phase == Phase::Forward).collect();
        let bwd: Vec<OpId> = order.iter().copied().filter(|&o| g.ops[o].phase == Phase::Backward).collect();
        let n = fwd.len();
        if n < 2 {
            return Err(LiteratureError::NotAChain(format!("it has {n} forward op(s); a chain needs at least two stages")));
        }
        let mut pos = vec![usize::MAX; g.ops.len()];
        for (i, &o) in fwd.iter().enumerate() {
            pos[o] = i;
        }
        // Outputs stay alive for the whole iteration, so reading them constrains nothing.
        let fwd_pos = |t: TensorId| {
            producer[t].map(|p| pos[p]).filter(|&p| p != usize::MAX && g.tensors[t].role != Role::Output)
        };

        // Intervals (p, r): positions p < r that must end up in the same or adjacent stages.
        let mut intervals: Vec<(usize, usize)> = Vec::new();
        for &o in &fwd {
            for &t in &g.ops[o].inputs {
                if let Some(p) = fwd_pos(t) {
                    intervals.push((p, pos[o]));
                }
            }
        }
        for &b in &bwd {
            let ps: Vec<usize> = g.ops[b].inputs.iter().filter_map(|&t| fwd_pos(t)).collect();
            if let (Some(&lo), Some(&hi)) = (ps.iter().min(), ps.iter().max()) {
                if lo < hi {
                    intervals.push((lo, hi));
                }
            }
        }
        // minback[c]: the smallest p over intervals with p < c <= r (a cut before c crosses them).
        intervals.sort_unstable();
        let mut minback = vec![usize::MAX; n];
        let mut heap: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
        let mut next = 0;
        for (c, mb) in minback.iter_mut().enumerate().skip(1) {
            while next < intervals.len() && intervals[next].0 < c {
                heap.push(Reverse(intervals[next]));
                next += 1;
            }
            while let Some(&Reverse((p, r))) = heap.peek() {
                if r < c {
                    heap.pop();
                } else {
                    *mb = p;
                    break;
                }
            }
        }
        let mut starts = vec![0usize];
        for (c, &mb) in minback.iter().enumerate().skip(1) {
            if mb == usize::MAX || mb >= *starts.last().unwrap() {
                starts.push(c);
            }
        }
        let l = starts.len();
        if l < 2 {
            return Err(LiteratureError::NotAChain(format!(
                "no cut splits its {n} forward ops into stages that each read only the previous stage's results"
            )));
        }
        let mut stage_of_pos = vec![0usize; n];
        for (k, w) in starts.iter().enumerate() {
            let end = starts.get(k + 1).copied().unwrap_or(n);
            for s in stage_of_pos.iter_mut().take(end).skip(*w) {
                *s = k;
            }
        }
        let mut fstage = vec![usize::MAX; g.ops.len()];
        let mut forward: Vec<Vec<OpId>> = vec![Vec::new(); l];
        for &o in &fwd {
            fstage[o] = stage_of_pos[pos[o]];
            forward[fstage[o]].push(o);
        }

        // Backward stages (run from L down to 1). An op in stage k may read forward tensors of
        // stages k and k-1 only, and must run after its backward producers. Each op takes the
        // largest stage allowed (as early as possible), which leaves the most room to the ops
        // that read its results.
        let mut bstage = vec![usize::MAX; g.ops.len()];
        for &b in &bwd {
            let mut hi = l - 1;
            let mut f_max: Option<usize> = None;
            for &t in &g.ops[b].inputs {
                let Some(p) = producer[t] else { continue };
                if g.ops[p].phase == Phase::Backward {
                    hi = hi.min(bstage[p]);
                } else if g.tensors[t].role != Role::Output {
                    hi = hi.min(fstage[p] + 1);
                    f_max = f_max.max(Some(fstage[p]));
                }
            }
            if let Some(f) = f_max.filter(|&f| f > hi) {
                let culprit = g.ops[b]
                    .inputs
                    .iter()
                    .copied()
                    .find(|&t| producer[t].is_some_and(|p| g.ops[p].phase == Phase::Forward && fstage[p] == f))
                    .unwrap();
                return Err(LiteratureError::NotAChain(format!(
                    "backward {} reads {}, a result of stage {}, but it also reads results that only \
                     exist once the backward of stage {} has run, so no stage of the chain can run it",
                    op_label(g, b), tensor_label(g, culprit), f + 1, hi + 1
                )));
            }
            bstage[b] = hi;
        }
        let mut backward: Vec<Vec<OpId>> = vec![Vec::new(); l];
        for &b in &bwd {
            backward[bstage[b]].push(b);
        }

        // Tensor sets.
        let nt = g.tensors.len();
        let mut boundary: Vec<Vec<TensorId>> = vec![Vec::new(); l];
        let mut state: Vec<Vec<TensorId>> = vec![Vec::new(); l];
        let mut grads: Vec<Vec<TensorId>> = vec![Vec::new(); l];
        let mut in_boundary = vec![false; nt];
        let mut in_state = vec![false; nt];
        for &o in fwd.iter().chain(&bwd) {
            let reader_stage = if g.ops[o].phase == Phase::Forward { fstage[o] } else { bstage[o] };
            for &t in &g.ops[o].inputs {
                let Some(p) = producer[t] else { continue };
                if g.tensors[t].role == Role::Output {
                    continue;
                }
                if g.ops[p].phase == Phase::Forward {
                    let k = fstage[p];
                    let is_bwd = g.ops[o].phase == Phase::Backward;
                    if reader_stage == k + 1 && !in_boundary[t] {
                        in_boundary[t] = true;
                        boundary[k].push(t);
                    } else if reader_stage == k && is_bwd && !in_state[t] {
                        in_state[t] = true;
                        state[k].push(t);
                    } else if reader_stage != k && reader_stage != k + 1 {
                        return Err(LiteratureError::NotAChain(format!(
                            "{} reads {} from stage {} while it runs in stage {}",
                            op_label(g, o), tensor_label(g, t), k + 1, reader_stage + 1
                        )));
                    }
                } else {
                    // Backward tensor from stage bstage[p] read in stage reader_stage (<=).
                    for gk in grads.iter_mut().take(bstage[p]).skip(reader_stage) {
                        gk.push(t);
                    }
                }
            }
        }
        for k in 0..l {
            for &t in &boundary[k] {
                if !in_state[t] {
                    state[k].push(t);
                }
            }
            grads[k].sort_unstable();
            grads[k].dedup();
        }

        // Ops producing each stage's boundary and required results (the `Forward` operation).
        let mut output_ops: Vec<Vec<OpId>> = vec![Vec::new(); l];
        let mut need = vec![false; g.ops.len()];
        for k in 0..l {
            let mut stack: Vec<OpId> = Vec::new();
            for &o in &forward[k] {
                if g.ops[o].outputs.iter().any(|&t| in_boundary[t] || g.tensors[t].role.is_required()) {
                    stack.push(o);
                }
            }
            while let Some(o) = stack.pop() {
                if std::mem::replace(&mut need[o], true) {
                    continue;
                }
                for &t in &g.ops[o].inputs {
                    if let Some(p) = producer[t] {
                        if fstage[p] == k && !need[p] {
                            stack.push(p);
                        }
                    }
                }
            }
            output_ops[k] = forward[k].iter().copied().filter(|&o| need[o]).collect();
        }
        let roots = g.storage_roots();
        let permanent: Vec<TensorId> = (0..nt).filter(|&t| g.tensors[t].role == Role::Output).collect();
        let preexisting: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting()).collect();
        let permanent_bytes = set_bytes(g, &roots, &permanent, &preexisting);
        let backward_tensor = (0..nt).map(|t| producer[t].is_some_and(|p| g.ops[p].phase == Phase::Backward)).collect();
        Ok(ChainStructure { forward, backward, output_ops, boundary, state, grads, permanent_bytes, backward_tensor })
    }

    /// Number of stages.
    pub fn len(&self) -> usize {
        self.forward.len()
    }

    pub fn is_empty(&self) -> bool {
        self.forward.is_empty()
    }

    /// Bytes counted for the whole run (the graph's `output` tensors), outside the chain model.
    pub fn permanent_bytes(&self) -> u64 {
        self.permanent_bytes
    }

    /// The chain model of this structure: sizes from storages, overheads from running each
    /// stage operation on its own; one state option per stage (the whole stage forward).
    pub fn chain(&self, g: &Graph) -> Chain {
        self.chain_within(g, &Stop::never()).expect("no stop was asked for")
    }

    /// [`Self::chain`], polling `stop` at each stage (each costs O(tensors)).
    pub fn chain_within(&self, g: &Graph, stop: &Stop) -> Result<Chain, Stopped> {
        let roots = g.storage_roots();
        let uncounted: Vec<bool> = g
            .tensors
            .iter()
            .map(|t| t.role.is_preexisting() || t.role == Role::Output)
            .collect();
        let time = |ops: &[OpId]| ops.iter().map(|&o| g.ops[o].time).sum::<f64>();
        let l = self.len();
        let stages = (0..l)
            .map(|k| {
                stop.check()?;
                let out_bytes = set_bytes(g, &roots, &self.boundary[k], &uncounted);
                let state_bytes = set_bytes(g, &roots, &self.state[k], &uncounted).max(out_bytes);
                let grad_bytes = if k == 0 { 0 } else { set_bytes(g, &roots, &self.grads[k - 1], &uncounted) };
                let fwd_peak = local_peak(g, &roots, &self.backward_tensor, &self.output_ops[k], &self.boundary[k]);
                let all_peak = local_peak(g, &roots, &self.backward_tensor, &self.forward[k], &self.state[k]);
                let keep_grads = if k == 0 { &[][..] } else { &self.grads[k - 1][..] };
                let bwd_peak = local_peak(g, &roots, &self.backward_tensor, &self.backward[k], keep_grads);
                Ok(Stage {
                    fwd_time: time(&self.output_ops[k]),
                    out_bytes,
                    grad_bytes,
                    fwd_overhead: fwd_peak.saturating_sub(out_bytes),
                    options: vec![StateOption {
                        fwd_time: time(&self.forward[k]),
                        state_bytes,
                        fwd_overhead: all_peak.saturating_sub(state_bytes),
                        bwd_time: time(&self.backward[k]),
                        bwd_overhead: bwd_peak.saturating_sub(grad_bytes),
                    }],
                })
            })
            .collect::<Result<_, Stopped>>()?;
        Ok(Chain { input_bytes: 0, final_grad_bytes: 0, stages })
    }

    /// Turn a chain operation sequence (valid for this structure's chain) into IR steps.
    pub fn schedule(&self, g: &Graph, ops: &[ChainOp]) -> Schedule {
        let mut em = Emitter::new(g);
        let mut forward_len: Option<usize> = None;
        for &op in ops {
            match op {
                ChainOp::Forward(k) => run_ops(g, &mut em, &self.backward_tensor, &self.output_ops[k - 1], &self.boundary[k - 1]),
                // One option per stage: the whole forward, keeping the state.
                ChainOp::ForwardAll(k, _) => run_ops(g, &mut em, &self.backward_tensor, &self.forward[k - 1], &self.state[k - 1]),
                ChainOp::Backward(k) => {
                    if forward_len.is_none() {
                        forward_len = Some(em.steps.len());
                    }
                    let keep = if k == 1 { &[][..] } else { &self.grads[k - 2][..] };
                    run_ops(g, &mut em, &self.backward_tensor, &self.backward[k - 1], keep);
                    // The stage's state is not needed any more (the next stage's backward ran).
                    for &t in &self.state[k - 1] {
                        em.free(g, t);
                    }
                }
                ChainOp::Free(k) => {
                    for &t in &self.boundary[k - 1] {
                        em.free(g, t);
                    }
                }
            }
        }
        let forward_len = forward_len.unwrap_or(em.steps.len());
        Schedule { steps: em.steps, forward_len }
    }
}

/// Run `ops` in order, freeing each tensor they produce, and each backward result they read, as
/// soon as no later op of the list reads it, except `keep` (and outputs, never freed).
/// Forward tensors from before the list are left to the caller.
fn run_ops(g: &Graph, em: &mut Emitter, backward_tensor: &[bool], ops: &[OpId], keep: &[TensorId]) {
    let mut last: std::collections::HashMap<TensorId, usize> = std::collections::HashMap::new();
    for (i, &o) in ops.iter().enumerate() {
        for &t in &g.ops[o].inputs {
            last.insert(t, i);
        }
    }
    let mut produced_here: std::collections::HashSet<TensorId> = std::collections::HashSet::new();
    let keep: std::collections::HashSet<TensorId> = keep.iter().copied().collect();
    for (i, &o) in ops.iter().enumerate() {
        for &t in &g.ops[o].outputs {
            if !em.alive[t] {
                produced_here.insert(t);
            }
        }
        em.compute(g, o);
        for &t in g.ops[o].inputs.iter().chain(&g.ops[o].outputs) {
            let done = last.get(&t).is_none_or(|&j| j <= i);
            let local = produced_here.contains(&t) || backward_tensor[t];
            if done && local && !keep.contains(&t) {
                em.free(g, t);
            }
        }
    }
}

/// Peak bytes of new storages while running `ops` on their own (as [`run_ops`] does), on top
/// of whatever is alive before; outputs recomputed while alive count as duplicates.
fn local_peak(g: &Graph, roots: &[TensorId], backward_tensor: &[bool], ops: &[OpId], keep: &[TensorId]) -> u64 {
    let mut em = Emitter::new(g);
    // Everything the ops read from outside the list is alive beforehand, outputs included.
    let inside: std::collections::HashSet<TensorId> =
        ops.iter().flat_map(|&o| g.ops[o].outputs.iter().copied()).collect();
    for &o in ops {
        for &t in &g.ops[o].inputs {
            if !inside.contains(&t) {
                em.alive[t] = true;
            }
        }
    }
    for t in 0..g.tensors.len() {
        if g.tensors[t].role == Role::Output {
            em.alive[t] = true;
        }
    }
    let outside_alive = em.alive.clone();
    run_ops(g, &mut em, backward_tensor, ops, keep);
    // Replay the steps, counting storages created by the list (root-based, conservative).
    let mut refs: std::collections::HashMap<TensorId, u32> = std::collections::HashMap::new();
    let mut alive = outside_alive.clone();
    let counted = |t: TensorId| !g.tensors[roots[t]].role.is_preexisting();
    let outside_root: std::collections::HashSet<TensorId> =
        (0..g.tensors.len()).filter(|&t| outside_alive[t]).map(|t| roots[t]).collect();
    let mut cur: u64 = 0;
    let mut peak: u64 = 0;
    for step in &em.steps {
        match *step {
            crate::schedule::Step::Compute(o) => {
                let op = &g.ops[o];
                let mut new = 0u64;
                for &t in &op.outputs {
                    let r = roots[t];
                    if !counted(t) {
                        alive[t] = true;
                        continue;
                    }
                    if alive[t] {
                        if g.tensors[t].alias_of.is_none() {
                            new += g.tensors[t].bytes;
                        }
                        continue;
                    }
                    alive[t] = true;
                    if outside_root.contains(&r) && g.tensors[t].alias_of.is_some() {
                        continue;
                    }
                    let c = refs.entry(r).or_insert(0);
                    if *c == 0 {
                        cur += g.tensors[r].bytes;
                    }
                    *c += 1;
                }
                let dup = new; // duplicates only live during the step
                peak = peak.max(cur + dup + op.workspace);
            }
            crate::schedule::Step::Free(t) => {
                alive[t] = false;
                if let Some(c) = refs.get_mut(&roots[t]) {
                    if *c > 0 {
                        *c -= 1;
                        if *c == 0 {
                            cur -= g.tensors[roots[t]].bytes;
                        }
                    }
                }
            }
        }
    }
    peak
}

/// Whether `g` has a chain structure of at least two stages.
pub fn is_chain(g: &Graph) -> bool {
    ChainStructure::detect(g).is_ok()
}

/// Rotor on a chain-structured graph: the fastest schedule (within the chain model, memory
/// discretised into `slots`) whose simulated peak is at most `budget_bytes`, within the default
/// [`Bounds`]. When rounding to slots makes a budget that the exact model allows infeasible,
/// the slots are refined ([`rotor::solve_refined`]) before giving up.
pub fn rotor(g: &Graph, budget_bytes: u64, slots: usize) -> Result<(Schedule, SimResult), LiteratureError> {
    rotor_within(g, budget_bytes, slots, &Bounds::default())
}

/// [`rotor`] within `bounds`: a chain whose tables cannot fit `bounds.max_table_bytes` is
/// refused (`TooLarge`) right after its stages are found, before the chain model is built, and
/// the work stops (`Stopped`) when `bounds.stop` says so.
pub fn rotor_within(
    g: &Graph,
    budget_bytes: u64,
    slots: usize,
    bounds: &Bounds,
) -> Result<(Schedule, SimResult), LiteratureError> {
    let structure = ChainStructure::detect(g)?;
    rotor::fit_slots(structure.len(), slots.max(1), bounds.max_table_bytes)?;
    let chain = structure.chain_within(g, &bounds.stop)?;
    let fixed = structure.permanent_bytes();
    let infeasible = |detail: String| match rotor::min_memory_within(&chain, bounds) {
        Ok(min) => LiteratureError::Infeasible { limit_bytes: budget_bytes, min_bytes: fixed + min, detail },
        Err(e) => e,
    };
    if budget_bytes < fixed {
        return Err(infeasible(format!("the graph's outputs alone take {fixed} bytes")));
    }
    let mut limit = budget_bytes - fixed;
    // The chain model over-approximates the simulated memory; if it ever under-approximates,
    // tighten the limit by the excess and solve again.
    for _ in 0..8 {
        let sol = match rotor::solve_refined(&chain, limit, slots, bounds) {
            Ok(sol) => sol,
            Err(LiteratureError::Infeasible { detail, .. }) => return Err(infeasible(detail)),
            Err(other) => return Err(other),
        };
        let s = structure.schedule(g, &sol.ops);
        let sim = checked(g, &s)?;
        if sim.peak_bytes <= budget_bytes {
            return Ok((s, sim));
        }
        let excess = sim.peak_bytes - budget_bytes;
        if excess >= limit {
            break;
        }
        limit -= excess;
    }
    Err(infeasible("the schedules found exceed the budget once simulated".into()))
}
