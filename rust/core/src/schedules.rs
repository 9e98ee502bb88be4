//! Reference schedules: store-all (plain autograd) and recompute-all. Both expect a validated
//! graph and always pass the simulator; recompute-all refuses graphs on which it would be too
//! long ([`MAX_SCHEDULE_STEPS`]).

use crate::graph::{Graph, OpId, Phase, TensorId};
use crate::io::topo_order_by;
use crate::limits::{TooLarge, MAX_SCHEDULE_STEPS};
use crate::schedule::{Schedule, Step};

/// Ops in graph order when that order is topological with all forward ops first (traced graphs
/// are), else a topological order that runs every forward op before any backward op.
pub fn execution_order(g: &Graph) -> Vec<OpId> {
    let producer = g.producers();
    let in_order = g.ops.iter().enumerate().all(|(i, o)| {
        o.inputs
            .iter()
            .all(|&t| !matches!(producer[t], Some(p) if p >= i))
    }) && g
        .ops
        .windows(2)
        .all(|w| !(w[0].phase == Phase::Backward && w[1].phase == Phase::Forward));
    if in_order {
        return (0..g.ops.len()).collect();
    }
    let order = topo_order_by(g, &producer, |o| (g.ops[o].phase == Phase::Backward) as u8);
    assert_eq!(
        order.len(),
        g.ops.len(),
        "the graph has a cycle; validate it first"
    );
    order
}

/// Nothing reads the tensor after position `k` (`last` is its last reader's position).
fn no_read_after(last: Option<usize>, k: usize) -> bool {
    last.is_none() || last == Some(k)
}

/// Last position (in `order`) of an op reading each tensor; `None` for unread tensors.
fn last_uses(g: &Graph, order: &[OpId]) -> Vec<Option<usize>> {
    let mut last = vec![None; g.tensors.len()];
    for (k, &op) in order.iter().enumerate() {
        for &t in &g.ops[op].inputs {
            last[t] = Some(k);
        }
    }
    last
}

/// Plain autograd: every op once in `execution_order`; each freeable tensor is freed right after
/// its last reader (or right after it is produced when nothing reads it). Outputs are kept.
/// `forward_len` ends after the last forward op and the frees that follow it.
pub fn store_all(g: &Graph) -> Schedule {
    let order = execution_order(g);
    let last = last_uses(g, &order);
    let mut steps = Vec::with_capacity(2 * order.len());
    let mut freed = vec![false; g.tensors.len()];
    let mut forward_len = 0;
    for (k, &op) in order.iter().enumerate() {
        steps.push(Step::Compute(op));
        let o = &g.ops[op];
        for &t in o.inputs.iter().chain(&o.outputs) {
            let done = no_read_after(last[t], k);
            if done && !freed[t] && g.tensors[t].role.is_freeable() {
                freed[t] = true;
                steps.push(Step::Free(t));
            }
        }
        if o.phase == Phase::Forward {
            forward_len = steps.len();
        }
    }
    if !order.iter().any(|&o| g.ops[o].phase == Phase::Backward) {
        forward_len = steps.len();
    }
    Schedule { steps, forward_len }
}

/// Recompute-all: the forward segment runs every forward op and keeps only what cannot be freed
/// (outputs). Before each backward op, the forward tensors it reads that are not alive are
/// recomputed from what is alive (pre-existing tensors, outputs, backward results), and freed as
/// soon as no longer needed. Backward results are freed after their last reader.
/// On long chains this recomputes O(n^2) ops, as recompute-all does by definition, so the steps
/// are counted first (in O(n) memory) and a schedule of more than [`MAX_SCHEDULE_STEPS`] steps
/// is refused with an error naming its size, before anything is allocated.
pub fn recompute_all(g: &Graph) -> Result<Schedule, TooLarge> {
    recompute_all_within(g, MAX_SCHEDULE_STEPS)
}

/// [`recompute_all`] with another bound on the number of steps.
pub fn recompute_all_within(g: &Graph, max_steps: usize) -> Result<Schedule, TooLarge> {
    let mut count = StepCount(0);
    let n_bwd = g.ops.iter().filter(|o| o.phase == Phase::Backward).count();
    if let Err(done) = recompute_all_steps(g, &mut count, max_steps) {
        return Err(TooLarge(format!(
            "recompute-all on this graph ({} ops, {} of them backward) would take more than {max_steps} \
             steps (its first {done} backward ops alone need {} steps): it recomputes O(n^2) ops on \
             long chains. Use a method that bounds recomputation (hrockmate, rotor, twremat, checkpoint)",
            g.ops.len(),
            n_bwd,
            count.0
        )));
    }
    let mut steps = Vec::with_capacity(count.0);
    let forward_len = recompute_all_steps(g, &mut steps, usize::MAX)
        .expect("the second pass writes the steps the first one counted");
    Ok(Schedule { steps, forward_len })
}

/// Where [`recompute_all_steps`] writes its steps: a counter (first pass) or the schedule.
trait StepSink {
    fn push(&mut self, step: Step);
    fn len(&self) -> usize;
}

struct StepCount(usize);

impl StepSink for StepCount {
    fn push(&mut self, _: Step) {
        self.0 += 1;
    }
    fn len(&self) -> usize {
        self.0
    }
}

impl StepSink for Vec<Step> {
    fn push(&mut self, step: Step) {
        Vec::push(self, step);
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// Write the recompute-all steps of `g` to `sink`; `Ok(forward_len)`, or `Err(backward ops
/// done)` as soon as more than `max_steps` steps were written.
fn recompute_all_steps<S: StepSink>(g: &Graph, steps: &mut S, max_steps: usize) -> Result<usize, usize> {
    let order = execution_order(g);
    let n_fwd = order
        .iter()
        .take_while(|&&o| g.ops[o].phase == Phase::Forward)
        .count();
    let (fwd, bwd) = order.split_at(n_fwd);
    let producer = g.producers();
    let nt = g.tensors.len();
    let mut alive: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting()).collect();

    // Forward: free each freeable tensor after its last forward reader.
    let last_fwd = last_uses(g, fwd);
    for (k, &op) in fwd.iter().enumerate() {
        steps.push(Step::Compute(op));
        let o = &g.ops[op];
        for &t in &o.outputs {
            alive[t] = true;
        }
        for &t in o.inputs.iter().chain(&o.outputs) {
            if alive[t] && g.tensors[t].role.is_freeable() && no_read_after(last_fwd[t], k) {
                alive[t] = false;
                steps.push(Step::Free(t));
            }
        }
    }
    let forward_len = steps.len();
    if forward_len > max_steps {
        return Err(0);
    }

    // Backward: per backward op, recompute its missing forward inputs (post-order DFS over
    // producers), run it, free the temporaries and the backward results no longer needed.
    let last_bwd = last_uses(g, bwd);
    let mut op_epoch = vec![usize::MAX; g.ops.len()];
    let mut local_epoch = vec![usize::MAX; nt];
    let mut local_last = vec![0usize; nt];
    let mut stack: Vec<(OpId, usize)> = Vec::new();
    let mut plan: Vec<OpId> = Vec::new();
    for (k, &b) in bwd.iter().enumerate() {
        plan.clear();
        for &t in &g.ops[b].inputs {
            if alive[t] {
                continue;
            }
            let p = producer[t].expect("a tensor that is not alive has a producer");
            if op_epoch[p] == k {
                continue;
            }
            op_epoch[p] = k;
            stack.push((p, 0));
            while let Some(&mut (op, ref mut next)) = stack.last_mut() {
                let inputs = &g.ops[op].inputs;
                if *next < inputs.len() {
                    let t = inputs[*next];
                    *next += 1;
                    if !alive[t] {
                        let q = producer[t].expect("a tensor that is not alive has a producer");
                        if op_epoch[q] != k {
                            op_epoch[q] = k;
                            stack.push((q, 0));
                        }
                    }
                } else {
                    plan.push(op);
                    stack.pop();
                }
            }
        }
        // Local tensors: made alive by the plan; their last local reader (plan index, or
        // plan.len() for the backward op itself).
        for (j, &op) in plan.iter().enumerate() {
            for &t in &g.ops[op].outputs {
                if !alive[t] && local_epoch[t] != k {
                    local_epoch[t] = k;
                    local_last[t] = usize::MAX; // unread so far
                }
            }
            for &t in &g.ops[op].inputs {
                if local_epoch[t] == k {
                    local_last[t] = j;
                }
            }
        }
        for &t in &g.ops[b].inputs {
            if local_epoch[t] == k {
                local_last[t] = plan.len();
            }
        }
        let free_local = |j: usize, t: TensorId, alive: &mut Vec<bool>, steps: &mut S| {
            if local_epoch[t] == k
                && alive[t]
                && (local_last[t] == j || local_last[t] == usize::MAX)
            {
                alive[t] = false;
                steps.push(Step::Free(t));
            }
        };
        for (j, &op) in plan.iter().enumerate() {
            steps.push(Step::Compute(op));
            let o = &g.ops[op];
            for &t in &o.outputs {
                alive[t] = true;
            }
            for &t in o.inputs.iter().chain(&o.outputs) {
                free_local(j, t, &mut alive, steps);
            }
        }
        steps.push(Step::Compute(b));
        let o = &g.ops[b];
        for &t in &o.outputs {
            alive[t] = true;
        }
        for &t in &o.inputs {
            free_local(plan.len(), t, &mut alive, steps);
        }
        for &t in o.inputs.iter().chain(&o.outputs) {
            if local_epoch[t] != k
                && alive[t]
                && g.tensors[t].role.is_freeable()
                && no_read_after(last_bwd[t], k)
            {
                alive[t] = false;
                steps.push(Step::Free(t));
            }
        }
        if steps.len() > max_steps {
            return Err(k + 1);
        }
    }
    Ok(forward_len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::synthetic::chain;
    use crate::simulate::simulate;

    #[test]
    fn recompute_all_counts_exactly_the_steps_it_builds() {
        let g = chain(40, 1);
        let s = recompute_all(&g).unwrap();
        simulate(&g, &s).unwrap();
        assert_eq!(recompute_all_within(&g, s.steps.len()).unwrap(), s);
        let err = recompute_all_within(&g, s.steps.len() - 1).unwrap_err();
        assert!(err.0.contains(&format!("more than {} steps", s.steps.len() - 1)), "{err}");
    }

    #[test]
    fn recompute_all_refuses_a_200k_op_chain_before_allocating() {
        // The whole schedule would take about 5e9 steps. The counting pass must stop within
        // one backward op's steps past the bound, and the refusal must come from that pass
        // (the schedule vector is only made once the count fits), with its numbers.
        let g = chain(100_000, 1);
        let n_bwd = g.ops.iter().filter(|o| o.phase == Phase::Backward).count();
        let mut count = StepCount(0);
        let done = recompute_all_steps(&g, &mut count, MAX_SCHEDULE_STEPS).unwrap_err();
        // (one backward op recomputes at most every op and frees at most every tensor)
        let one_op_at_most = 2 * (g.ops.len() + g.tensors.len());
        assert!(count.0 > MAX_SCHEDULE_STEPS, "{}", count.0);
        assert!(count.0 <= MAX_SCHEDULE_STEPS + one_op_at_most, "{}", count.0);
        assert!(done > 0 && done < n_bwd / 10, "{done} of {n_bwd} backward ops");
        let msg = recompute_all(&g).unwrap_err().to_string();
        assert!(msg.contains(&format!("this graph ({} ops, 100001 of them backward)", g.ops.len())), "{msg}");
        assert!(msg.contains(&format!("more than {MAX_SCHEDULE_STEPS} steps")), "{msg}");
        assert!(msg.contains(&format!("its first {done} backward ops alone need {} steps", count.0)), "{msg}");
    }
}
