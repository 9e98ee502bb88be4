//! Graph simplification before partitioning (see docs/hierarchy.md, "Simplification").
//!
//! Two rewrites, both exact for the store-all and recompute-all schedules (same peak, same time):
//! 1. **View folding.** A forward op that costs nothing (time 0, no workspace, not random, no
//!    buffer mutation), reads one tensor `b` and only outputs views of `b` (role `activation`)
//!    is removed; readers of its views read `b` instead. The storage is the same, so memory does
//!    not change; `b` simply lives as long as its longest-lived view did.
//! 2. **Chain merging.** Op `A` whose single output `t` (an activation that owns its storage,
//!    nothing views it) is read only by the op `B` that runs right after it, where every other
//!    input of `B` exists before the iteration: no schedule gains from keeping `t` instead of
//!    `B`'s outputs (nothing else reads `t`, and recomputing `B` from `t` needs nothing else),
//!    so `A` and `B` become one op with time `tA + tB`, `B`'s outputs, and the workspace that
//!    reproduces the peak inside the pair. Both must be in the same phase; backward ops must
//!    differentiate the same forward op. Random and buffer-mutation flags are OR-ed. Because a
//!    schedule may free `A`'s inputs between `A` and `B`, which one op cannot express, the merge
//!    is only done when that cannot change the peak: `A` reads only pre-existing tensors, or
//!    the pair's peak is at `A` (`A`'s outputs + workspace >= `t` + `B`'s outputs + workspace).
//!    Chains of more than two ops are merged pairwise under the same rules.
//!
//! The result keeps the original ids in `op_origin` / `tensor_origin`, and
//! [`Simplified::expand_schedule`] turns a schedule of the simplified graph into one of the
//! original graph with the same peak and time.

use crate::graph::{Graph, Op, OpId, Phase, Role, TensorId};
use crate::schedule::{Schedule, Step};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimplifyConfig {
    pub fold_views: bool,
    pub merge_chains: bool,
}

impl Default for SimplifyConfig {
    fn default() -> Self {
        SimplifyConfig { fold_views: true, merge_chains: true }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Simplified {
    pub graph: Graph,
    /// Original ops of each new op, in execution order.
    pub op_origin: Vec<Vec<OpId>>,
    /// Original tensor of each new tensor.
    pub tensor_origin: Vec<TensorId>,
    /// New tensor of each original tensor: itself, the storage a folded view was folded into,
    /// or None for a tensor merged away inside a chain.
    pub tensor_new: Vec<Option<TensorId>>,
    /// Removed view ops: (op, its input) for each folded view tensor, indexed by tensor.
    view_op: Vec<Option<OpId>>,
}

/// Simplify `g` (a validated graph).
pub fn simplify(g: &Graph, cfg: &SimplifyConfig) -> Simplified {
    let order = crate::schedules::execution_order(g);
    let nt = g.tensors.len();
    let no = g.ops.len();
    // ---- 1. view folding: rep[t] = the tensor t is folded into
    let mut rep: Vec<TensorId> = (0..nt).collect();
    let mut removed = vec![false; no];
    let mut view_op: Vec<Option<OpId>> = vec![None; nt];
    if cfg.fold_views {
        for &o in &order {
            let op = &g.ops[o];
            let Some(&base) = op.inputs.first() else { continue };
            let foldable = op.phase == Phase::Forward
                && op.time == 0.0
                && op.workspace == 0
                && !op.random
                && !op.mutates_buffer
                && !op.outputs.is_empty()
                && op.inputs.iter().all(|&t| t == base)
                && op.outputs.iter().all(|&v| {
                    let x = &g.tensors[v];
                    x.alias_of == Some(base) && x.role == Role::Activation
                });
            if foldable {
                removed[o] = true;
                for &v in &op.outputs {
                    rep[v] = rep[base];
                    view_op[v] = Some(o);
                }
            }
        }
    }
    // ---- 2. chain merging over the ops that remain, in execution order
    let kept_order: Vec<OpId> = order.iter().copied().filter(|&o| !removed[o]).collect();
    let mut readers: Vec<Vec<OpId>> = vec![Vec::new(); nt];
    for &o in &kept_order {
        for &t in &g.ops[o].inputs {
            let r = rep[t];
            if readers[r].last() != Some(&o) {
                readers[r].push(o);
            }
        }
    }
    let mut viewed = vec![false; nt];
    for (t, x) in g.tensors.iter().enumerate() {
        if let (Some(b), false) = (x.alias_of, view_op[t].is_some()) {
            viewed[rep[b]] = true;
        }
    }
    let roots = g.storage_roots();
    let counted = crate::partition::counted_bytes(g, &roots);
    let producer = g.producers();
    let fwd_target = |o: OpId| -> Option<OpId> { g.ops[o].differentiates };
    let out_bytes = |op: &Op| -> u64 { op.outputs.iter().map(|&t| counted[t]).sum() };
    // Schedules free the inputs of the group's first op right after it when nothing else reads
    // them, which a merged op cannot express. The merge is exact when that cannot matter: the
    // first op reads only pre-existing tensors, or the group's peak is reached at the first op.
    let peak_stays_at_first = |grp: &Vec<OpId>, o: OpId| -> bool {
        let first = &g.ops[grp[0]];
        if first.inputs.iter().all(|&i| g.tensors[rep[i]].role.is_preexisting()) {
            return true;
        }
        let at_first = out_bytes(first) + first.workspace;
        let mut prev = first;
        for &k in grp[1..].iter().chain(std::iter::once(&o)) {
            let op = &g.ops[k];
            if out_bytes(prev) + out_bytes(op) + op.workspace > at_first {
                return false;
            }
            prev = op;
        }
        true
    };
    let mut groups: Vec<Vec<OpId>> = Vec::new();
    for &o in &kept_order {
        let merge = cfg.merge_chains
            && groups.last().is_some_and(|grp: &Vec<OpId>| {
                let a = *grp.last().unwrap();
                let (oa, ob) = (&g.ops[a], &g.ops[o]);
                let [t] = oa.outputs[..] else { return false };
                let x = &g.tensors[t];
                oa.phase == ob.phase
                    && (oa.phase == Phase::Forward || fwd_target(grp[0]) == fwd_target(o))
                    && x.role == Role::Activation
                    && x.alias_of.is_none()
                    && !viewed[t]
                    && readers[t] == [o]
                    && ob.inputs.iter().all(|&i| rep[i] == t || g.tensors[rep[i]].role.is_preexisting())
                    && peak_stays_at_first(grp, o)
            });
        if merge {
            groups.last_mut().unwrap().push(o);
        } else {
            groups.push(vec![o]);
        }
    }
    // tensors that disappear: folded views and chain intermediates
    let mut gone = vec![false; nt];
    for (t, v) in view_op.iter().enumerate() {
        gone[t] = v.is_some();
    }
    for grp in &groups {
        for &a in &grp[..grp.len() - 1] {
            gone[g.ops[a].outputs[0]] = true;
        }
    }
    let mut tensor_new: Vec<Option<TensorId>> = vec![None; nt];
    let mut tensor_origin = Vec::new();
    for t in 0..nt {
        if !gone[t] {
            tensor_new[t] = Some(tensor_origin.len());
            tensor_origin.push(t);
        }
    }
    for t in 0..nt {
        if view_op[t].is_some() {
            tensor_new[t] = tensor_new[rep[t]];
        }
    }
    // new ops in original id order (a group sits at its first op)
    let mut groups_by_id = groups.clone();
    groups_by_id.sort_by_key(|grp| grp[0]);
    let mut new_of_op: Vec<Option<OpId>> = vec![None; no];
    for (i, grp) in groups_by_id.iter().enumerate() {
        for &o in grp {
            new_of_op[o] = Some(i);
        }
    }
    // a removed view op maps to the op producing the storage it viewed
    let op_target = |o: OpId| -> Option<OpId> {
        if removed[o] {
            producer[rep[g.ops[o].outputs[0]]].and_then(|p| new_of_op[p])
        } else {
            new_of_op[o]
        }
    };
    let map_t = |t: TensorId| tensor_new[rep[t]].expect("inputs of kept ops are kept");
    let ops: Vec<Op> = groups_by_id
        .iter()
        .map(|grp| {
            let first = &g.ops[grp[0]];
            let last = &g.ops[*grp.last().unwrap()];
            let mut inputs: Vec<TensorId> = first.inputs.iter().map(|&t| map_t(t)).collect();
            for &o in &grp[1..] {
                inputs.extend(g.ops[o].inputs.iter().filter(|&&t| g.tensors[rep[t]].role.is_preexisting()).map(|&t| map_t(t)));
            }
            // peak above "before" at each member; the merged op reports outputs + workspace
            let mut extra = 0u64;
            for (k, &o) in grp.iter().enumerate() {
                let op = &g.ops[o];
                let carried = if k == 0 { 0 } else { counted[g.ops[grp[k - 1]].outputs[0]] };
                extra = extra.max(carried + out_bytes(op) + op.workspace);
            }
            let join = |f: &dyn Fn(&Op) -> &str| match grp[..] {
                [one] => f(&g.ops[one]).to_string(),
                _ => grp.iter().map(|&o| f(&g.ops[o])).collect::<Vec<_>>().join("+"),
            };
            Op {
                name: join(&|o| o.name.as_str()),
                target: join(&|o| o.target.as_str()),
                phase: first.phase,
                time: grp.iter().map(|&o| g.ops[o].time).sum(),
                workspace: extra - out_bytes(last),
                inputs,
                outputs: last.outputs.iter().map(|&t| tensor_new[t].unwrap()).collect(),
                differentiates: first.differentiates.and_then(op_target),
                random: grp.iter().any(|&o| g.ops[o].random),
                mutates_buffer: grp.iter().any(|&o| g.ops[o].mutates_buffer),
                module: first.module.clone(),
            }
        })
        .collect();
    let tensors = tensor_origin
        .iter()
        .map(|&t| {
            let mut x = g.tensors[t].clone();
            x.alias_of = x.alias_of.map(&map_t);
            x.grad_of = x.grad_of.and_then(|a| tensor_new[a]);
            x.updates = x.updates.and_then(|a| tensor_new[a]);
            x
        })
        .collect();
    let graph = Graph { name: g.name.clone(), time_unit: g.time_unit.clone(), tensors, ops, meta: g.meta.clone() };
    Simplified { graph, op_origin: groups_by_id, tensor_origin, tensor_new, view_op }
}

impl Simplified {
    /// A schedule of the original graph doing what `s` does on the simplified graph: merged ops
    /// run member by member (freeing the intermediates), folded views are recomputed (free of
    /// cost) right before the op that reads them and dropped right after.
    pub fn expand_schedule(&self, original: &Graph, s: &Schedule) -> Result<Schedule, String> {
        let g = original;
        let mut alive: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting()).collect();
        let mut steps = Vec::with_capacity(s.steps.len() * 2);
        let mut forward_len = 0;
        for (i, step) in s.steps.iter().enumerate() {
            match *step {
                Step::Compute(x) => {
                    let grp = self.op_origin.get(x).ok_or_else(|| format!("step {i}: op id {x} out of range of the simplified graph"))?;
                    for (k, &o) in grp.iter().enumerate() {
                        let mut temps = Vec::new();
                        for &t in &g.ops[o].inputs {
                            self.make_view(g, t, &mut alive, &mut steps, &mut temps);
                        }
                        steps.push(Step::Compute(o));
                        for &t in &g.ops[o].outputs {
                            alive[t] = true;
                        }
                        for t in temps.into_iter().rev() {
                            alive[t] = false;
                            steps.push(Step::Free(t));
                        }
                        if k > 0 {
                            let t = g.ops[grp[k - 1]].outputs[0];
                            alive[t] = false;
                            steps.push(Step::Free(t));
                        }
                    }
                }
                Step::Free(t) => {
                    let orig = *self.tensor_origin.get(t).ok_or_else(|| format!("step {i}: tensor id {t} out of range of the simplified graph"))?;
                    alive[orig] = false;
                    steps.push(Step::Free(orig));
                }
            }
            if i + 1 == s.forward_len {
                forward_len = steps.len();
            }
        }
        if s.forward_len == 0 {
            forward_len = 0;
        }
        Ok(Schedule { steps, forward_len })
    }

    /// Recompute folded view `t` (and the folded views it is made from) if it is not alive.
    fn make_view(&self, g: &Graph, t: TensorId, alive: &mut [bool], steps: &mut Vec<Step>, temps: &mut Vec<TensorId>) {
        if alive[t] {
            return;
        }
        let Some(v) = self.view_op[t] else { return };
        let base = g.ops[v].inputs[0];
        self.make_view(g, base, alive, steps, temps);
        steps.push(Step::Compute(v));
        for &o in &g.ops[v].outputs {
            if !alive[o] {
                alive[o] = true;
                temps.push(o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Tensor;

    fn t(name: &str, bytes: u64, role: Role, alias_of: Option<usize>) -> Tensor {
        Tensor { name: name.into(), bytes, role, alias_of, grad_of: None, updates: None, shape: None, dtype: None }
    }

    fn op(name: &str, phase: Phase, time: f64, inputs: Vec<usize>, outputs: Vec<usize>) -> Op {
        Op {
            name: name.into(),
            target: name.into(),
            phase,
            time,
            workspace: 0,
            inputs,
            outputs,
            differentiates: None,
            random: false,
            mutates_buffer: false,
            module: String::new(),
        }
    }

    #[test]
    fn folds_a_view_and_merges_a_chain() {
        // x -> a = f(x) -> v = view(a) -> b = g(v, w) -> c = h(b) -> loss
        let mut g = Graph { name: "s".into(), time_unit: "s".into(), ..Default::default() };
        g.tensors = vec![
            t("x", 8, Role::Input, None),
            t("a", 100, Role::Activation, None),
            t("v", 0, Role::Activation, Some(1)),
            t("w", 8, Role::Parameter, None),
            t("b", 50, Role::Activation, None),
            t("c", 10, Role::Output, None),
        ];
        g.ops = vec![
            op("f", Phase::Forward, 1.0, vec![0], vec![1]),
            op("view", Phase::Forward, 0.0, vec![1], vec![2]),
            op("g", Phase::Forward, 2.0, vec![2, 3], vec![4]),
            op("h", Phase::Forward, 3.0, vec![4], vec![5]),
        ];
        let s = simplify(&g, &SimplifyConfig::default());
        // everything collapses into one op: f+g+h
        assert_eq!(s.graph.ops.len(), 1);
        assert_eq!(s.op_origin[0], vec![0, 2, 3]);
        assert_eq!(s.graph.ops[0].time, 6.0);
        let orig = crate::simulate::simulate(&g, &crate::schedules::store_all(&g)).unwrap();
        let new = crate::simulate::simulate(&s.graph, &crate::schedules::store_all(&s.graph)).unwrap();
        assert_eq!(orig.peak_bytes, new.peak_bytes);
        let back = s.expand_schedule(&g, &crate::schedules::store_all(&s.graph)).unwrap();
        let again = crate::simulate::simulate(&g, &back).unwrap();
        assert_eq!(again.peak_bytes, orig.peak_bytes);
        assert_eq!(again.time, orig.time);
    }
}
