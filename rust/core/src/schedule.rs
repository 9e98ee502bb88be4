//! Schedules: sequences of compute/free steps split into a forward and a backward segment
//! (see docs/graph-ir.md, "Schedule").

use crate::graph::{OpId, TensorId};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "0", content = "1", rename_all = "snake_case")]
pub enum Step {
    Compute(OpId),
    Free(TensorId),
}

impl Step {
    pub fn kind_code(self) -> i8 {
        match self {
            Step::Compute(_) => 0,
            Step::Free(_) => 1,
        }
    }

    pub fn id(self) -> usize {
        match self {
            Step::Compute(i) | Step::Free(i) => i,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Schedule {
    pub steps: Vec<Step>,
    /// The first `forward_len` steps run in the forward call, the rest in backward.
    pub forward_len: usize,
}
