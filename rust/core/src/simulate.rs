//! The exact schedule simulator: checks every rule of docs/graph-ir.md "Schedule" and computes
//! memory and time, in O(steps + edges).
//!
//! Memory follows the storage rules of [`crate::memory`] (shared with the planner's fragment
//! peaks): a view kept alive after its base is freed keeps the bytes counted, and recomputing
//! the base then counts a second copy (as the allocator would). Storages rooted at pre-existing
//! tensors are never counted.

use crate::graph::{Graph, Phase, Role, TensorId};
use crate::io::{op_label, tensor_label};
use crate::limits::{Stop, Stopped};
use crate::memory::{Memory, UNCOUNTED};
use crate::schedule::{Schedule, Step};

#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    /// Max over steps of the memory during the step.
    pub peak_bytes: u64,
    /// Sum of `time` over compute steps.
    pub time: f64,
    /// Peak over the forward segment (0 if it is empty).
    pub forward_peak: u64,
    /// Peak over the backward segment (0 if it is empty).
    pub backward_peak: u64,
    /// Memory alive at the end of the forward segment.
    pub bytes_after_forward: u64,
    /// First step reaching `peak_bytes` (0 for an empty schedule).
    pub peak_step: usize,
    /// Memory during each step: for a compute step, alive storages + its new output storages +
    /// recomputed duplicates + workspace; for a free step, what is alive after the free.
    pub timeline: Vec<u64>,
    /// How many times each op is computed.
    pub compute_count: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleError {
    /// The first bad step; `steps.len()` for errors found at the end of the schedule.
    pub step: usize,
    pub message: String,
}

impl std::fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {}: {}", self.step, self.message)
    }
}

impl std::error::Error for ScheduleError {}

/// Why [`simulate_within`] returned no result.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimulateError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

fn err<T>(step: usize, message: String) -> Result<T, SimulateError> {
    Err(SimulateError::Schedule(ScheduleError { step, message }))
}

/// Simulate `s` on `g` (a validated graph). Returns the first broken rule as an error.
///
/// Memory figures are exact: validation bounds a graph's sizes ([`crate::limits::MAX_GRAPH_BYTES`])
/// so that no sum here can pass 2^63.
pub fn simulate(g: &Graph, s: &Schedule) -> Result<SimResult, ScheduleError> {
    simulate_within(g, s, &Stop::never()).map_err(|e| match e {
        SimulateError::Schedule(e) => e,
        SimulateError::Stopped(_) => unreachable!("no stop was asked for"),
    })
}

/// [`simulate`], polling `stop` every 65,536 steps.
pub fn simulate_within(g: &Graph, s: &Schedule, stop: &Stop) -> Result<SimResult, SimulateError> {
    let nt = g.tensors.len();
    let no = g.ops.len();
    let n_steps = s.steps.len();
    if s.forward_len > n_steps {
        return err(
            n_steps,
            format!(
                "forward_len {} exceeds the number of steps ({n_steps})",
                s.forward_len
            ),
        );
    }
    let roots = g.storage_roots();

    // Per tensor: the storage instance it holds (memory rules), whether it was ever produced.
    let mut mem = Memory::new(vec![crate::memory::NOT_ALIVE; nt]);
    let mut produced = vec![false; nt];
    for (t, tensor) in g.tensors.iter().enumerate() {
        if tensor.role.is_preexisting() {
            mem.hold(t, UNCOUNTED);
            produced[t] = true;
        }
    }
    let counted = |root: TensorId| !g.tensors[root].role.is_preexisting();

    let mut compute_count = vec![0u32; no];
    let mut timeline = Vec::with_capacity(n_steps);
    let mut time = 0.0;
    let mut bytes_after_forward = 0;

    for (i, step) in s.steps.iter().enumerate() {
        if i % 65_536 == 65_535 {
            stop.check()?;
        }
        let in_forward = i < s.forward_len;
        if i == s.forward_len {
            if let Some(m) = check_forward_outputs(g, &produced) {
                return err(i, m);
            }
        }
        match *step {
            Step::Compute(op_id) => {
                let Some(op) = g.ops.get(op_id) else {
                    return err(
                        i,
                        format!("compute: op id {op_id} out of range (the graph has {no} ops)"),
                    );
                };
                let what = || format!("compute {}", op_label(g, op_id));
                if in_forward && op.phase == Phase::Backward {
                    return err(
                        i,
                        format!(
                            "{}: a backward op cannot run in the forward segment (forward_len {})",
                            what(),
                            s.forward_len
                        ),
                    );
                }
                if op.phase == Phase::Backward && compute_count[op_id] > 0 {
                    return err(
                        i,
                        format!(
                            "{}: backward ops run exactly once, this one already ran",
                            what()
                        ),
                    );
                }
                for &t in &op.inputs {
                    if !mem.is_alive(t) {
                        let why = if produced[t] {
                            "it was freed"
                        } else {
                            "it has not been computed yet"
                        };
                        return err(
                            i,
                            format!(
                                "{}: input {} is not alive ({why})",
                                what(),
                                tensor_label(g, t)
                            ),
                        );
                    }
                    if in_forward && g.tensors[t].role == Role::Tangent {
                        return err(i, format!("{}: reads {}, a tangent, in the forward segment (tangents exist only in backward)", what(), tensor_label(g, t)));
                    }
                }
                for &t in &op.outputs {
                    produced[t] = true;
                }
                timeline.push(mem.compute(g, &roots, op_id, counted));
                compute_count[op_id] += 1;
                time += op.time;
            }
            Step::Free(t) => {
                let Some(tensor) = g.tensors.get(t) else {
                    return err(
                        i,
                        format!("free: tensor id {t} out of range (the graph has {nt} tensors)"),
                    );
                };
                if !tensor.role.is_freeable() {
                    return err(
                        i,
                        format!(
                            "free {}: its role '{}' cannot be freed by a schedule",
                            tensor_label(g, t),
                            tensor.role.as_str()
                        ),
                    );
                }
                if !mem.is_alive(t) {
                    let why = if produced[t] {
                        "it was already freed"
                    } else {
                        "it has not been computed yet"
                    };
                    return err(i, format!("free {}: not alive ({why})", tensor_label(g, t)));
                }
                mem.release(t);
                timeline.push(mem.held());
            }
        }
        if i + 1 == s.forward_len {
            bytes_after_forward = mem.held();
        }
    }
    if s.forward_len == n_steps {
        if let Some(m) = check_forward_outputs(g, &produced) {
            return err(n_steps, m);
        }
    }

    // End of schedule: every backward op ran, every required tensor was produced.
    if let Some(op) = (0..no).find(|&o| g.ops[o].phase == Phase::Backward && compute_count[o] == 0)
    {
        return err(
            n_steps,
            format!(
                "backward {} never runs; every backward op must run exactly once",
                op_label(g, op)
            ),
        );
    }
    if let Some(t) = (0..nt).find(|&t| g.tensors[t].role.is_required() && !produced[t]) {
        return err(
            n_steps,
            format!(
                "{} ('{}') is never produced; it is a required result",
                tensor_label(g, t),
                g.tensors[t].role.as_str()
            ),
        );
    }

    let peak_of = |r: &[u64]| r.iter().copied().max().unwrap_or(0);
    let (peak_step, peak_bytes) = timeline.iter().copied().enumerate().fold(
        (0, 0),
        |(bi, bv), (i, v)| if v > bv { (i, v) } else { (bi, bv) },
    );
    Ok(SimResult {
        peak_bytes,
        time,
        forward_peak: peak_of(&timeline[..s.forward_len]),
        backward_peak: peak_of(&timeline[s.forward_len..]),
        bytes_after_forward,
        peak_step,
        timeline,
        compute_count,
    })
}

/// Outputs must all exist when the forward segment ends (`None` when they do).
fn check_forward_outputs(g: &Graph, produced: &[bool]) -> Option<String> {
    let t = (0..g.tensors.len()).find(|&t| g.tensors[t].role == Role::Output && !produced[t])?;
    Some(format!(
        "{} is an 'output' but was not produced in the forward segment (outputs are returned by the forward call)",
        tensor_label(g, t)
    ))
}

/// Convenience for callers that only need validity.
pub fn check(g: &Graph, s: &Schedule) -> Result<(), ScheduleError> {
    simulate(g, s).map(|_| ())
}
