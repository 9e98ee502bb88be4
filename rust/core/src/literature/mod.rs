//! Re-materialization solvers from the literature, as stand-alone plug-ins over the graph IR.
//!
//! - [`twremat`]: TW-Remat (Kumar et al., NeurIPS 2019): recursion over balanced separators of a
//!   tree decomposition of the forward graph; works on any valid graph. A depth limit trades
//!   memory for recomputation, so one graph yields several (memory, time) points.
//! - [`rotor`]: Rotor (Beaumont et al.): the optimal dynamic program for heterogeneous chains on
//!   a generic [`rotor::Chain`], with memory discretised into slots.
//! - [`chain`]: detection of chain structure in an IR graph and conversion of a Rotor sequence
//!   into an IR schedule.
//!
//! Every schedule these modules return has been checked by [`crate::simulate::simulate`].
//! See docs/literature-solvers.md for guarantees and limits.

pub mod chain;
pub mod rotor;
pub mod treedec;
pub mod twremat;

use crate::graph::{Graph, OpId, TensorId};
use crate::limits::{Stopped, TooLarge};
use crate::schedule::{Schedule, Step};
use crate::simulate::{simulate, SimResult};

/// Why a literature solver could not return a schedule. Messages say what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LiteratureError {
    /// The graph is not a chain (Rotor only); the message names the op or tensor at fault.
    #[error("the graph is not a chain: {0}; use TW-Remat or the hierarchical solver for general graphs")]
    NotAChain(String),
    /// No schedule fits the memory limit; `min_bytes` is the smallest limit that does.
    #[error("no schedule fits in {limit_bytes} bytes; the smallest feasible limit is {min_bytes} bytes ({detail})")]
    Infeasible {
        limit_bytes: u64,
        min_bytes: u64,
        detail: String,
    },
    /// The schedule would be longer than the step cap (deep recursion on wide graphs).
    #[error("the schedule would exceed {max_steps} steps; use a smaller depth limit")]
    StepLimit { max_steps: usize },
    /// A parameter is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The work would need more memory than its bound allows (Rotor's tables).
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    /// The time limit ran out, or the caller cancelled the work.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// The solver produced a schedule the simulator rejects (a bug: please report the graph).
    #[error("internal error, the produced schedule is invalid: {0}")]
    Internal(String),
}

/// Simulate a produced schedule; a rejection is a solver bug and is reported as `Internal`.
pub(crate) fn checked(g: &Graph, s: &Schedule) -> Result<SimResult, LiteratureError> {
    simulate(g, s).map_err(|e| LiteratureError::Internal(e.to_string()))
}

/// Writes compute/free steps while tracking which tensors are alive (pre-existing ones always).
#[derive(Debug, Clone)]
pub(crate) struct Emitter {
    pub steps: Vec<Step>,
    pub alive: Vec<bool>,
}

impl Emitter {
    pub fn new(g: &Graph) -> Emitter {
        Emitter {
            steps: Vec::new(),
            alive: g.tensors.iter().map(|t| t.role.is_preexisting()).collect(),
        }
    }

    pub fn compute(&mut self, g: &Graph, op: OpId) {
        self.steps.push(Step::Compute(op));
        for &t in &g.ops[op].outputs {
            self.alive[t] = true;
        }
    }

    /// Free `t` if it is alive and a schedule may free it (no-op otherwise).
    pub fn free(&mut self, g: &Graph, t: TensorId) {
        if self.alive[t] && g.tensors[t].role.is_freeable() {
            self.alive[t] = false;
            self.steps.push(Step::Free(t));
        }
    }
}
