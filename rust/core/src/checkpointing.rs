//! Per-block checkpointing schedules, as `torch.utils.checkpoint` runs them, and the sweep over
//! block counts that the planner's "never costlier than checkpointing" rule measures against.
//!
//! The forward op order is cut into contiguous blocks. Forward: every op runs once; only the
//! values that cross blocks (read by a forward or backward op of another block), the model
//! outputs and `keep_extra` are kept. Backward: when a backward op reads a dropped value, that
//! value's block runs forward again (only the ops its backward still needs), and the recomputed
//! values live until their last backward use. `keep_extra` = matmul/attention outputs gives
//! selective checkpointing (torchtitan-style).

use crate::graph::{Graph, OpId, Phase, TensorId};
use crate::io::{op_label, tensor_label};
use crate::limits::{Stop, Stopped};
use crate::partition::backward_owners;
use crate::schedule::{Schedule, Step};
use crate::schedules::execution_order;
use crate::simulate::{simulate_within, SimulateError};

const NONE: usize = usize::MAX;

/// Why no checkpointing schedule came back.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckpointError {
    /// The graph defeats the block rule (a bug, or a graph validation should have refused).
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

impl From<SimulateError> for CheckpointError {
    fn from(e: SimulateError) -> Self {
        match e {
            SimulateError::Stopped(s) => CheckpointError::Stopped(s),
            SimulateError::Schedule(e) => {
                CheckpointError::Internal(format!("a block checkpointing schedule failed its check: {e}"))
            }
        }
    }
}

/// What block checkpointing needs to know about a graph that does not depend on the blocks:
/// computed once per graph and shared by every block count.
pub struct CheckpointFacts {
    /// The forward ops, then the backward ops, in [`execution_order`].
    pub fwd: Vec<OpId>,
    pub bwd: Vec<OpId>,
    /// Tensors that exist before the step (inputs, parameters, ...).
    fixed: Vec<bool>,
    /// `fixed` and the model outputs.
    never_free: Vec<bool>,
    /// Position in `bwd` of each tensor's last backward reader; -1 for none.
    last_direct: Vec<i64>,
    /// Position in `fwd` of each tensor's last forward use (read, else production); -1 for none.
    last_fwd_use: Vec<i64>,
    roots: Vec<TensorId>,
}

impl CheckpointFacts {
    /// The facts of a validated graph.
    pub fn new(g: &Graph) -> Self {
        let order = execution_order(g);
        let (fwd, bwd): (Vec<OpId>, Vec<OpId>) =
            order.into_iter().partition(|&o| g.ops[o].phase == Phase::Forward);
        let nt = g.tensors.len();
        let fixed: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting()).collect();
        let never_free: Vec<bool> = g
            .tensors
            .iter()
            .map(|t| t.role.is_preexisting() || t.role == crate::graph::Role::Output)
            .collect();
        let mut last_direct = vec![-1i64; nt];
        for (q, &o) in bwd.iter().enumerate() {
            for &y in &g.ops[o].inputs {
                last_direct[y] = q as i64;
            }
        }
        let mut last_fwd_use = vec![-1i64; nt];
        for (p, &o) in fwd.iter().enumerate() {
            for &y in &g.ops[o].inputs {
                last_fwd_use[y] = p as i64;
            }
            for &y in &g.ops[o].outputs {
                if last_fwd_use[y] < 0 {
                    last_fwd_use[y] = p as i64;
                }
            }
        }
        CheckpointFacts { fwd, bwd, fixed, never_free, last_direct, last_fwd_use, roots: g.storage_roots() }
    }

    /// The forward ops cut into `blocks` contiguous runs of equal op counts: the block of each
    /// op (`usize::MAX` for backward ops).
    pub fn contiguous_blocks(&self, n_ops: usize, blocks: usize) -> Vec<usize> {
        let n = self.fwd.len().max(1);
        let mut block_of = vec![NONE; n_ops];
        for (k, &o) in self.fwd.iter().enumerate() {
            block_of[o] = k * blocks / n;
        }
        block_of
    }
}

impl CheckpointFacts {
    /// Blocks given by a label per op (`label[o]`, e.g. the index of the layer an op's module
    /// belongs to; negative for ops outside every checkpointed region): the forward ops are
    /// walked in `fwd` order and a new block starts wherever the label changes, so blocks stay
    /// contiguous runs of the order even when a region's ops are interleaved with others'.
    /// Returns the block of each op (`usize::MAX` for backward ops) and the forward ops with
    /// negative labels, whose outputs a caller keeps (the regions a model does not checkpoint).
    pub fn labelled_blocks(&self, label: &[i64]) -> (Vec<usize>, Vec<OpId>) {
        let mut block_of = vec![NONE; label.len()];
        let mut outside = Vec::new();
        let mut current: Option<i64> = None;
        let mut block = 0usize;
        for &o in &self.fwd {
            let l = label.get(o).copied().unwrap_or(-1);
            if current.is_some() && current != Some(l) {
                block += 1;
            }
            current = Some(l);
            block_of[o] = block;
            if l < 0 {
                outside.push(o);
            }
        }
        (block_of, outside)
    }
}

/// The sorted, deduplicated union of the tensors in `lists` (frees happen in id order, so that
/// schedules do not depend on how an op lists its tensors).
fn sorted_union(buf: &mut Vec<TensorId>, lists: &[&[TensorId]]) {
    buf.clear();
    for l in lists {
        buf.extend_from_slice(l);
    }
    buf.sort_unstable();
    buf.dedup();
}

/// The per-block checkpointing schedule of `g` for the given blocks of its forward ops
/// (`block_of_fwd[o]`, `usize::MAX` for backward ops; blocks numbered along `facts.fwd`), also
/// keeping `keep_extra`. `stop` is polled for cancellation.
pub fn block_checkpoint(
    g: &Graph,
    facts: &CheckpointFacts,
    block_of_fwd: &[usize],
    keep_extra: &[TensorId],
    stop: &Stop,
) -> Result<Schedule, CheckpointError> {
    let (ops, nt) = (&g.ops, g.tensors.len());
    let f = facts;
    let n_blocks = 1 + f.fwd.iter().map(|&o| block_of_fwd[o]).max().unwrap_or(0);
    let owner = backward_owners(g, block_of_fwd, n_blocks - 1);
    let mut block_of_tensor = vec![NONE; nt];
    for &o in &f.fwd {
        for &x in &ops[o].outputs {
            block_of_tensor[x] = block_of_fwd[o];
        }
    }
    let bot = &block_of_tensor;

    // kept: what crosses blocks (and its storage), the extras
    let mut keep = vec![false; nt];
    for &x in keep_extra {
        if x < nt && bot[x] != NONE {
            keep[x] = true;
        }
    }
    for &o in f.fwd.iter().chain(&f.bwd) {
        let mine = if ops[o].phase == Phase::Forward { block_of_fwd[o] } else { owner[o] };
        for &x in &ops[o].inputs {
            if bot[x] != NONE && bot[x] != mine {
                keep[x] = true;
            }
        }
    }
    let kept: Vec<TensorId> = (0..nt).filter(|&x| keep[x]).collect();
    for x in kept {
        keep[f.roots[x]] = true;
    }
    for x in 0..nt {
        keep[x] &= bot[x] != NONE;
    }

    // when each block is recomputed: the first backward op reading a dropped value of it
    let mut trigger: Vec<Option<usize>> = vec![None; n_blocks];
    for (q, &o) in f.bwd.iter().enumerate() {
        for &y in &ops[o].inputs {
            if bot[y] != NONE && !keep[y] && !f.never_free[y] && trigger[bot[y]].is_none() {
                trigger[bot[y]] = Some(q);
            }
        }
    }
    // the recomputation of block m reads its kept values and other blocks' values: they must
    // live until then
    let mut horizon = vec![-1i64; nt];
    for x in 0..nt {
        if keep[x] {
            horizon[x] = f.last_direct[x];
        }
    }
    for &o in &f.fwd {
        let m = block_of_fwd[o];
        if let Some(t) = trigger[m] {
            for &x in &ops[o].inputs {
                if keep[x] || (bot[x] != NONE && bot[x] != m) {
                    horizon[x] = horizon[x].max(t as i64);
                }
            }
        }
    }

    let mut steps: Vec<Step> = Vec::with_capacity(3 * ops.len());
    let mut alive = f.fixed.clone();
    let mut buf: Vec<TensorId> = Vec::new();
    for (p, &o) in f.fwd.iter().enumerate() {
        if p % 4096 == 4095 {
            stop.check()?;
        }
        steps.push(Step::Compute(o));
        for &x in &ops[o].outputs {
            alive[x] = true;
        }
        sorted_union(&mut buf, &[&ops[o].inputs, &ops[o].outputs]);
        for &x in &buf {
            if f.never_free[x] || !alive[x] || f.last_fwd_use[x] > p as i64 {
                continue;
            }
            if keep[x] && horizon[x] >= 0 {
                continue;
            }
            alive[x] = false;
            steps.push(Step::Free(x));
        }
    }
    let forward_len = steps.len();

    let mut block_ops: Vec<Vec<OpId>> = vec![Vec::new(); n_blocks];
    let mut block_values: Vec<Vec<TensorId>> = vec![Vec::new(); n_blocks];
    for &o in &f.fwd {
        block_ops[block_of_fwd[o]].push(o);
        block_values[block_of_fwd[o]].extend_from_slice(&ops[o].outputs);
    }
    // scratch marks, reset after each use: O(block) per recomputation
    let mut want = vec![false; nt];
    let mut last_use = vec![-1i64; nt];
    let mut touched: Vec<TensorId> = Vec::new();
    let mut run: Vec<OpId> = Vec::new();
    for (q, &o) in f.bwd.iter().enumerate() {
        if q % 4096 == 4095 {
            stop.check()?;
        }
        let qi = q as i64;
        touched.clear();
        while let Some(&first) = ops[o].inputs.iter().find(|&&y| !alive[y]) {
            let m = bot[first];
            if m == NONE {
                return Err(CheckpointError::Internal(format!(
                    "backward op {} reads a value nobody produces",
                    op_label(g, o)
                )));
            }
            // the values of block m still read by the backward, and what they are made from
            let mut wanted: Vec<TensorId> = Vec::new();
            for &y in &block_values[m] {
                if !alive[y] && f.last_direct[y] >= qi && !want[y] {
                    want[y] = true;
                    wanted.push(y);
                }
            }
            run.clear();
            for &k in block_ops[m].iter().rev() {
                if ops[k].outputs.iter().any(|&x| want[x]) {
                    run.push(k);
                    for &x in &ops[k].inputs {
                        if !alive[x] && bot[x] == m && !want[x] {
                            want[x] = true;
                            wanted.push(x);
                        }
                    }
                }
            }
            run.reverse();
            for (i, &k) in run.iter().enumerate() {
                for &x in &ops[k].inputs {
                    last_use[x] = i as i64;
                }
            }
            for (i, &k) in run.iter().enumerate() {
                steps.push(Step::Compute(k));
                for &x in &ops[k].outputs {
                    alive[x] = true;
                    touched.push(x);
                }
                sorted_union(&mut buf, &[&ops[k].inputs, &ops[k].outputs]);
                for &x in &buf {
                    if alive[x]
                        && !f.never_free[x]
                        && bot[x] == m
                        && !keep[x]
                        && last_use[x] <= i as i64
                        && f.last_direct[x] < qi
                    {
                        alive[x] = false;
                        steps.push(Step::Free(x));
                    }
                }
            }
            for &k in &run {
                for &x in &ops[k].inputs {
                    last_use[x] = -1;
                }
            }
            for x in wanted {
                want[x] = false;
            }
            if let Some(&y) = ops[o].inputs.iter().find(|&&y| !alive[y]) {
                if bot[y] == m {
                    return Err(CheckpointError::Internal(format!(
                        "the recomputation of block {m} left {} missing",
                        tensor_label(g, y)
                    )));
                }
            }
        }
        steps.push(Step::Compute(o));
        for &x in &ops[o].outputs {
            alive[x] = true;
        }
        sorted_union(&mut buf, &[&ops[o].inputs, &ops[o].outputs, &touched]);
        for &x in &buf {
            if f.never_free[x] || !alive[x] || f.last_direct[x] > qi || horizon[x] > qi {
                continue;
            }
            alive[x] = false;
            steps.push(Step::Free(x));
        }
    }
    Ok(Schedule { steps, forward_len })
}

/// One block count of [`checkpoint_points`].
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointPoint {
    pub blocks: usize,
    pub peak_bytes: u64,
    pub time: f64,
    /// Kept only for the fastest point within the budget when one was given.
    pub schedule: Option<Schedule>,
}

/// Block checkpointing at each of [`checkpoint_candidates`]' block counts, simulated. With
/// `budget`, only the fastest point within it (the first, on ties) keeps its schedule: memory
/// then holds one whole-graph schedule, not one per block count. With `time_limit` (seconds)
/// the counts nearest sqrt(n) come first and the rest stop once it has passed (the first count
/// always runs); `stop` is polled for cancellation.
pub fn checkpoint_points(
    g: &Graph,
    keep_extra: &[TensorId],
    budget: Option<u64>,
    time_limit: Option<f64>,
    stop: &Stop,
) -> Result<Vec<CheckpointPoint>, CheckpointError> {
    // (a limit that is not a number of seconds >= 0 means none, as for `Stop::new` callers that
    // validated it already)
    let limit = Stop::new(None, time_limit).unwrap_or_default();
    let facts = CheckpointFacts::new(g);
    let mut counts = checkpoint_candidates(facts.fwd.len());
    if time_limit.is_some() {
        let root = (facts.fwd.len().max(1) as f64).sqrt();
        counts.sort_by(|a, b| {
            let d = |k: usize| (k as f64 / root).ln().abs();
            d(*a).total_cmp(&d(*b))
        });
    }
    let mut out: Vec<CheckpointPoint> = Vec::with_capacity(counts.len());
    let mut best: Option<usize> = None;
    for blocks in counts {
        stop.check()?;
        if !out.is_empty() && limit.should_stop() {
            break;
        }
        let block_of = facts.contiguous_blocks(g.ops.len(), blocks);
        let s = block_checkpoint(g, &facts, &block_of, keep_extra, stop)?;
        let r = simulate_within(g, &s, stop)?;
        let keep_schedule = match budget {
            None => true,
            Some(b) => r.peak_bytes <= b && best.is_none_or(|k| r.time < out[k].time),
        };
        if keep_schedule && budget.is_some() {
            if let Some(k) = best {
                out[k].schedule = None;
            }
            best = Some(out.len());
        }
        out.push(CheckpointPoint {
            blocks,
            peak_bytes: r.peak_bytes,
            time: r.time,
            schedule: keep_schedule.then_some(s),
        });
    }
    Ok(out)
}

/// Block counts worth trying on `n_forward` forward ops: sqrt(n), and a spread around it (every
/// count up to 16, then steps of 30%, and n itself), ascending.
pub fn checkpoint_candidates(n_forward: usize) -> Vec<usize> {
    if n_forward == 0 {
        return vec![1];
    }
    let mut c = vec![1, n_forward, ((n_forward as f64).sqrt().round() as usize).max(1)];
    let mut k = 2usize;
    while k < n_forward {
        c.push(k);
        k = if k < 16 { k + 1 } else { (k as f64 * 1.3) as usize };
    }
    c.sort_unstable();
    c.dedup();
    c
}
