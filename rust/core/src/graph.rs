//! The graph IR: ops and tensors of one training iteration (see docs/graph-ir.md).
//!
//! Ids are indices into `Graph::ops` / `Graph::tensors`. The JSON form and its validation live
//! in `io.rs`; this module holds the in-memory types and cheap derived views.

use serde::{Deserialize, Serialize};

pub type OpId = usize;
pub type TensorId = usize;

pub const FORMAT_NAME: &str = "hrockmate-graph";
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Input,
    Parameter,
    Buffer,
    Tangent,
    Activation,
    Output,
    ParamGrad,
    InputGrad,
    BufferUpdate,
}

impl Role {
    /// All roles in the order of their array codes (docs/graph-ir.md, "Flat array form").
    pub const ALL: [Role; 9] = [
        Role::Input,
        Role::Parameter,
        Role::Buffer,
        Role::Tangent,
        Role::Activation,
        Role::Output,
        Role::ParamGrad,
        Role::InputGrad,
        Role::BufferUpdate,
    ];

    pub fn code(self) -> i8 {
        Role::ALL.iter().position(|r| *r == self).unwrap() as i8
    }

    pub fn from_code(code: i8) -> Option<Role> {
        usize::try_from(code).ok().and_then(|i| Role::ALL.get(i).copied())
    }

    /// Alive before the iteration starts (or handed in by the caller): never counted, never freed.
    pub fn is_preexisting(self) -> bool {
        matches!(self, Role::Input | Role::Parameter | Role::Buffer | Role::Tangent)
    }

    /// A schedule may free tensors of this role.
    pub fn is_freeable(self) -> bool {
        matches!(
            self,
            Role::Activation | Role::ParamGrad | Role::InputGrad | Role::BufferUpdate
        )
    }

    /// A schedule must produce tensors of this role.
    pub fn is_required(self) -> bool {
        matches!(
            self,
            Role::Output | Role::ParamGrad | Role::InputGrad | Role::BufferUpdate
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Input => "input",
            Role::Parameter => "parameter",
            Role::Buffer => "buffer",
            Role::Tangent => "tangent",
            Role::Activation => "activation",
            Role::Output => "output",
            Role::ParamGrad => "param_grad",
            Role::InputGrad => "input_grad",
            Role::BufferUpdate => "buffer_update",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tensor {
    pub name: String,
    /// Bytes of the storage this tensor owns; 0 for a view.
    pub bytes: u64,
    pub role: Role,
    #[serde(default)]
    pub alias_of: Option<TensorId>,
    #[serde(default)]
    pub grad_of: Option<TensorId>,
    #[serde(default)]
    pub updates: Option<TensorId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<i64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Op {
    pub name: String,
    #[serde(default)]
    pub target: String,
    pub phase: Phase,
    pub time: f64,
    #[serde(default)]
    pub workspace: u64,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    #[serde(default)]
    pub differentiates: Option<OpId>,
    #[serde(default)]
    pub random: bool,
    #[serde(default)]
    pub mutates_buffer: bool,
    #[serde(default)]
    pub module: String,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Graph {
    pub name: String,
    /// "s" for traced graphs, "units" for third-party costs.
    pub time_unit: String,
    pub tensors: Vec<Tensor>,
    pub ops: Vec<Op>,
    /// Free-form metadata carried through serialisation.
    pub meta: serde_json::Map<String, serde_json::Value>,
}

impl Graph {
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }

    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The op producing each tensor (None for pre-existing tensors).
    pub fn producers(&self) -> Vec<Option<OpId>> {
        let mut producer = vec![None; self.tensors.len()];
        for (op_id, op) in self.ops.iter().enumerate() {
            for &t in &op.outputs {
                producer[t] = Some(op_id);
            }
        }
        producer
    }

    /// The ops reading each tensor (in op order, deduplicated).
    pub fn consumers(&self) -> Vec<Vec<OpId>> {
        let mut users: Vec<Vec<OpId>> = vec![Vec::new(); self.tensors.len()];
        for (op_id, op) in self.ops.iter().enumerate() {
            for &t in &op.inputs {
                if users[t].last() != Some(&op_id) {
                    users[t].push(op_id);
                }
            }
        }
        users
    }

    /// The storage-owning tensor of each tensor (itself unless it is a view).
    /// Assumes alias chains are acyclic (checked by validation).
    pub fn storage_roots(&self) -> Vec<TensorId> {
        let n = self.tensors.len();
        let mut root = vec![usize::MAX; n];
        for start in 0..n {
            let mut t = start;
            let mut path = Vec::new();
            while root[t] == usize::MAX {
                match self.tensors[t].alias_of {
                    Some(base) if path.len() <= n => {
                        path.push(t);
                        t = base;
                    }
                    _ => {
                        root[t] = t;
                    }
                }
            }
            let r = root[t];
            for p in path {
                root[p] = r;
            }
        }
        root
    }
}
