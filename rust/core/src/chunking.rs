//! Where the runtime hands finished gradients to autograd, measured with the storage rules of
//! [`crate::memory`] (the simulator's).
//!
//! The runtime runs the backward segment in chunks: a gradient the schedule frees stays held
//! (in the list handed to autograd) until the end of its chunk. Holding gradients costs memory,
//! so a chunk ends ("cut") before the compute step at which the held gradients would raise the
//! step's memory above the peak of the schedule as written. Random ops that run again keep
//! their generator's state from their first run to their last, and the current state is kept
//! while replays run (from the first replay of a chain of them to its last: the caller says
//! where); those bytes come on top.

use std::collections::HashSet;

use crate::graph::{Graph, TensorId};
use crate::limits::Stop;
use crate::memory::{Memory, NOT_ALIVE, UNCOUNTED};
use crate::schedule::{Schedule, Step};
use crate::simulate::{simulate_within, SimulateError};

/// The chunking of a (valid) schedule's backward segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunks {
    /// Step positions before which the held gradients are handed over, ascending.
    pub cuts: Vec<usize>,
    /// Peak with gradients held between cuts and the generator states counted.
    pub peak_bytes: u64,
    /// Peak with gradients held between cuts, without generator states.
    pub held_peak_bytes: u64,
}

/// Chunk the backward segment of `s`. `gradient[t]`: tensor `t` is a gradient handed to autograd
/// (held from its free to the next cut); `state_bytes[op]`: bytes of the generator state a
/// replayed random op keeps (0 for other ops); `current_state`: (first, last step position,
/// bytes) of each stretch during which a replay holds the generator's current state (positions
/// past the schedule are ignored). The cuts do not depend on the states. The schedule is
/// simulated first: a broken rule is an error, and the simulation gives the peak of the
/// schedule as written and how often each op runs.
pub fn gradient_chunks(
    g: &Graph,
    s: &Schedule,
    gradient: &[bool],
    state_bytes: &[u64],
    current_state: &[(usize, usize, u64)],
    stop: &Stop,
) -> Result<Chunks, SimulateError> {
    let sim = simulate_within(g, s, stop)?;
    let mut current_at = vec![0u64; s.steps.len()];
    for &(first, last, bytes) in current_state {
        for held in current_at.iter_mut().take(last.saturating_add(1)).skip(first) {
            *held += bytes;
        }
    }
    let model = Run {
        g,
        roots: g.storage_roots(),
        s,
        gradient,
        state_bytes,
        current_at,
        runs: sim.compute_count,
    };
    let (held_peak, cuts) = model.run(Some(sim.peak_bytes), None, false);
    let fixed: HashSet<usize> = cuts.iter().copied().collect();
    let (peak, _) = model.run(None, Some(&fixed), true);
    Ok(Chunks {
        cuts,
        peak_bytes: peak,
        held_peak_bytes: held_peak,
    })
}

struct Run<'a> {
    g: &'a Graph,
    roots: Vec<TensorId>,
    s: &'a Schedule,
    gradient: &'a [bool],
    state_bytes: &'a [u64],
    current_at: Vec<u64>, // per step position: the current generator states held there
    runs: Vec<u32>,
}

impl Run<'_> {
    /// (peak, cuts). Gradients are held from their free to the next cut: cut where the step's
    /// memory passes `limit`, or at `fixed_cuts`. `states`: count generator states.
    fn run(
        &self,
        limit: Option<u64>,
        fixed_cuts: Option<&HashSet<usize>>,
        states: bool,
    ) -> (u64, Vec<usize>) {
        let g = self.g;
        let mut mem = Memory::new(vec![NOT_ALIVE; g.tensors.len()]);
        for (t, tensor) in g.tensors.iter().enumerate() {
            if tensor.role.is_preexisting() {
                mem.hold(t, UNCOUNTED);
            }
        }
        let counted = |root: TensorId| !g.tensors[root].role.is_preexisting();
        let mut held: Vec<TensorId> = Vec::new(); // freed gradients, still referenced
        let mut cuts = Vec::new();
        let mut done = vec![0u32; g.ops.len()];
        let (mut peak, mut saved_states) = (0u64, 0u64);
        for (pos, step) in self.s.steps.iter().enumerate() {
            match *step {
                Step::Compute(j) => {
                    let mut step_bytes = mem.compute(g, &self.roots, j, counted);
                    let cut = match fixed_cuts {
                        Some(f) => f.contains(&pos),
                        None => {
                            limit.is_some_and(|l| step_bytes > l)
                                && !held.is_empty()
                                && pos >= self.s.forward_len
                        }
                    };
                    if cut {
                        cuts.push(pos);
                        // handed over before the step: what they held was never in it
                        let before = mem.held();
                        for t in held.drain(..) {
                            mem.release(t);
                        }
                        step_bytes -= before - mem.held();
                    }
                    let nb = if states { self.state_bytes[j] } else { 0 };
                    if nb > 0 {
                        done[j] += 1;
                        if done[j] == 1 {
                            saved_states += nb; // saved right before the first run
                        }
                    }
                    if states {
                        step_bytes += self.current_at[pos]; // kept while replays run
                    }
                    peak = peak.max(step_bytes + saved_states);
                    if nb > 0 && done[j] == self.runs[j] {
                        saved_states -= nb; // dropped after the last replay
                    }
                }
                Step::Free(t) => {
                    if self.gradient[t] {
                        held.push(t);
                    } else {
                        mem.release(t);
                    }
                }
            }
        }
        (peak, cuts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::recompute_all;
    use crate::testgen::{random_training_graph, GenParams};

    fn peaks(g: &Graph, s: &Schedule, current: &[(usize, usize, u64)]) -> Chunks {
        let gradient = vec![false; g.tensors.len()];
        let states = vec![0; g.ops.len()];
        gradient_chunks(g, s, &gradient, &states, current, &Stop::never()).unwrap()
    }

    #[test]
    fn current_states_count_over_their_stretch_and_leave_the_cuts_alone() {
        let g = random_training_graph(7, &GenParams::default());
        let s = recompute_all(&g).unwrap();
        let n = s.steps.len();
        let none = peaks(&g, &s, &[]);
        assert_eq!(none.peak_bytes, none.held_peak_bytes);
        // a stretch over the whole schedule raises the peak by its bytes, and no cut moves
        let all = peaks(&g, &s, &[(0, n - 1, 5000)]);
        assert_eq!(all.peak_bytes, none.peak_bytes + 5000);
        assert_eq!(all.cuts, none.cuts);
        // memory is measured at compute steps: stretches over free steps add nothing
        let frees: Vec<(usize, usize, u64)> = (0..n)
            .filter(|&p| matches!(s.steps[p], Step::Free(_)))
            .map(|p| (p, p, 5000))
            .collect();
        assert_eq!(peaks(&g, &s, &frees).peak_bytes, none.peak_bytes);
        let every: Vec<(usize, usize, u64)> = (0..n).map(|p| (p, p, 7)).collect();
        assert_eq!(peaks(&g, &s, &every).peak_bytes, none.peak_bytes + 7);
        // stretches past the schedule's end are ignored
        assert_eq!(peaks(&g, &s, &[(n + 3, usize::MAX, 9)]).peak_bytes, none.peak_bytes);
    }
}
