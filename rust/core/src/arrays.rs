//! Graphs and schedules as flat arrays (docs/graph-ir.md, "Flat array form"): the shape in
//! which they cross the Rust/Python boundary without per-element objects.

use crate::graph::{Graph, Op, Phase, Role, Tensor};
use crate::io::{validate, validate_structure, GraphError};
use crate::schedule::{Schedule, Step};
use crate::simulate::ScheduleError;

/// The flat array form of a graph. `tensor_grad_of`/`tensor_updates` are optional extras
/// (-1 = none); without them the `grad_of`/`updates` rules are not checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GraphArrays {
    pub tensor_bytes: Vec<i64>,
    pub tensor_alias: Vec<i64>,
    pub tensor_role: Vec<i8>,
    pub op_time: Vec<f64>,
    pub op_workspace: Vec<i64>,
    pub op_phase: Vec<i8>,
    pub op_differentiates: Vec<i64>,
    pub op_flags: Vec<u8>,
    pub op_in_ptr: Vec<i64>,
    pub op_in_idx: Vec<i64>,
    pub op_out_ptr: Vec<i64>,
    pub op_out_idx: Vec<i64>,
    pub tensor_grad_of: Option<Vec<i64>>,
    pub tensor_updates: Option<Vec<i64>>,
}

pub const FLAG_RANDOM: u8 = 1;
pub const FLAG_MUTATES_BUFFER: u8 = 2;

fn arr_err(field: &str, message: String) -> GraphError {
    GraphError::Field {
        location: "graph arrays".to_string(),
        field: field.to_string(),
        message,
    }
}

fn check_len(field: &str, len: usize, want: usize, what: &str) -> Result<(), GraphError> {
    if len != want {
        return Err(arr_err(
            field,
            format!("has length {len}, expected {want} ({what})"),
        ));
    }
    Ok(())
}

/// -1 -> None, 0.. -> Some(id); anything else is an error naming the array and position.
fn opt_id(field: &str, pos: usize, v: i64) -> Result<Option<usize>, GraphError> {
    match v {
        -1 => Ok(None),
        x if x >= 0 => Ok(Some(x as usize)),
        x => Err(arr_err(
            field,
            format!("item {pos} is {x}; ids are >= 0, or -1 for none"),
        )),
    }
}

fn nonneg(field: &str, pos: usize, v: i64) -> Result<u64, GraphError> {
    u64::try_from(v).map_err(|_| arr_err(field, format!("item {pos} is {v}; must be >= 0")))
}

/// Split CSR (ptr, idx) into one id list per op, checking the pointers.
fn csr(
    ptr_name: &str,
    idx_name: &str,
    ptr: &[i64],
    idx: &[i64],
    n_ops: usize,
) -> Result<Vec<Vec<usize>>, GraphError> {
    check_len(ptr_name, ptr.len(), n_ops + 1, "number of ops + 1")?;
    if ptr[0] != 0 {
        return Err(arr_err(
            ptr_name,
            format!("must start at 0, starts at {}", ptr[0]),
        ));
    }
    if ptr[n_ops] != idx.len() as i64 {
        return Err(arr_err(
            ptr_name,
            format!(
                "ends at {} but {idx_name} has {} items",
                ptr[n_ops],
                idx.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(n_ops);
    for i in 0..n_ops {
        let (a, b) = (ptr[i], ptr[i + 1]);
        if b < a || b as usize > idx.len() {
            return Err(arr_err(ptr_name, format!(
                "item {} is {b}; pointers must not decrease (previous {a}) nor exceed the {} items of {idx_name}",
                i + 1, idx.len()
            )));
        }
        let ids = idx[a as usize..b as usize]
            .iter()
            .enumerate()
            .map(|(k, &x)| {
                usize::try_from(x).map_err(|_| {
                    arr_err(
                        idx_name,
                        format!("item {} is {x}; tensor ids are >= 0", a as usize + k),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(ids);
    }
    Ok(out)
}

/// Build and validate a graph from flat arrays. Names are optional (used in messages); when
/// absent, ops and tensors are unnamed and messages use ids only.
pub fn graph_from_arrays(
    a: &GraphArrays,
    tensor_names: Option<&[String]>,
    op_names: Option<&[String]>,
) -> Result<Graph, GraphError> {
    let nt = a.tensor_bytes.len();
    let no = a.op_time.len();
    check_len(
        "tensor_alias",
        a.tensor_alias.len(),
        nt,
        "one per tensor, as tensor_bytes",
    )?;
    check_len(
        "tensor_role",
        a.tensor_role.len(),
        nt,
        "one per tensor, as tensor_bytes",
    )?;
    for (name, v) in [
        ("tensor_grad_of", &a.tensor_grad_of),
        ("tensor_updates", &a.tensor_updates),
    ] {
        if let Some(v) = v {
            check_len(name, v.len(), nt, "one per tensor, as tensor_bytes")?;
        }
    }
    check_len(
        "op_workspace",
        a.op_workspace.len(),
        no,
        "one per op, as op_time",
    )?;
    check_len("op_phase", a.op_phase.len(), no, "one per op, as op_time")?;
    check_len(
        "op_differentiates",
        a.op_differentiates.len(),
        no,
        "one per op, as op_time",
    )?;
    check_len("op_flags", a.op_flags.len(), no, "one per op, as op_time")?;
    if let Some(n) = tensor_names {
        check_len("tensor_names", n.len(), nt, "one per tensor")?;
    }
    if let Some(n) = op_names {
        check_len("op_names", n.len(), no, "one per op")?;
    }
    let inputs = csr("op_in_ptr", "op_in_idx", &a.op_in_ptr, &a.op_in_idx, no)?;
    let outputs = csr("op_out_ptr", "op_out_idx", &a.op_out_ptr, &a.op_out_idx, no)?;

    let mut tensors = Vec::with_capacity(nt);
    for i in 0..nt {
        let role = Role::from_code(a.tensor_role[i]).ok_or_else(|| {
            arr_err(
                "tensor_role",
                format!("item {i} is {}; role codes are 0..=8", a.tensor_role[i]),
            )
        })?;
        let link = |v: &Option<Vec<i64>>, name: &str| -> Result<Option<usize>, GraphError> {
            match v {
                Some(v) => opt_id(name, i, v[i]),
                None => Ok(None),
            }
        };
        tensors.push(Tensor {
            name: tensor_names.map(|n| n[i].clone()).unwrap_or_default(),
            bytes: nonneg("tensor_bytes", i, a.tensor_bytes[i])?,
            role,
            alias_of: opt_id("tensor_alias", i, a.tensor_alias[i])?,
            grad_of: link(&a.tensor_grad_of, "tensor_grad_of")?,
            updates: link(&a.tensor_updates, "tensor_updates")?,
            shape: None,
            dtype: None,
        });
    }
    let mut ops = Vec::with_capacity(no);
    for (i, (ins, outs)) in inputs.into_iter().zip(outputs).enumerate() {
        let phase = match a.op_phase[i] {
            0 => Phase::Forward,
            1 => Phase::Backward,
            x => {
                return Err(arr_err(
                    "op_phase",
                    format!("item {i} is {x}; 0 = forward, 1 = backward"),
                ))
            }
        };
        let flags = a.op_flags[i];
        if flags & !(FLAG_RANDOM | FLAG_MUTATES_BUFFER) != 0 {
            return Err(arr_err(
                "op_flags",
                format!("item {i} is {flags}; only bits 0 (random) and 1 (mutates_buffer) exist"),
            ));
        }
        ops.push(Op {
            name: op_names.map(|n| n[i].clone()).unwrap_or_default(),
            target: String::new(),
            phase,
            time: a.op_time[i],
            workspace: nonneg("op_workspace", i, a.op_workspace[i])?,
            inputs: ins,
            outputs: outs,
            differentiates: opt_id("op_differentiates", i, a.op_differentiates[i])?,
            random: flags & FLAG_RANDOM != 0,
            mutates_buffer: flags & FLAG_MUTATES_BUFFER != 0,
            module: String::new(),
        });
    }
    let g = Graph {
        name: String::new(),
        time_unit: "s".to_string(),
        tensors,
        ops,
        meta: Default::default(),
    };
    let has_links = a.tensor_grad_of.is_some() && a.tensor_updates.is_some();
    if has_links {
        validate(&g)?;
    } else {
        validate_structure(&g)?;
    }
    Ok(g)
}

/// The flat array form of a graph (with the optional link arrays filled in).
pub fn graph_to_arrays(g: &Graph) -> GraphArrays {
    let id = |x: Option<usize>| x.map_or(-1, |v| v as i64);
    let mut a = GraphArrays {
        tensor_bytes: g.tensors.iter().map(|t| t.bytes as i64).collect(),
        tensor_alias: g.tensors.iter().map(|t| id(t.alias_of)).collect(),
        tensor_role: g.tensors.iter().map(|t| t.role.code()).collect(),
        op_time: g.ops.iter().map(|o| o.time).collect(),
        op_workspace: g.ops.iter().map(|o| o.workspace as i64).collect(),
        op_phase: g
            .ops
            .iter()
            .map(|o| (o.phase == Phase::Backward) as i8)
            .collect(),
        op_differentiates: g.ops.iter().map(|o| id(o.differentiates)).collect(),
        op_flags: g
            .ops
            .iter()
            .map(|o| {
                ((o.random as u8) * FLAG_RANDOM) | ((o.mutates_buffer as u8) * FLAG_MUTATES_BUFFER)
            })
            .collect(),
        tensor_grad_of: Some(g.tensors.iter().map(|t| id(t.grad_of)).collect()),
        tensor_updates: Some(g.tensors.iter().map(|t| id(t.updates)).collect()),
        ..GraphArrays::default()
    };
    a.op_in_ptr.push(0);
    a.op_out_ptr.push(0);
    for o in &g.ops {
        a.op_in_idx.extend(o.inputs.iter().map(|&t| t as i64));
        a.op_out_idx.extend(o.outputs.iter().map(|&t| t as i64));
        a.op_in_ptr.push(a.op_in_idx.len() as i64);
        a.op_out_ptr.push(a.op_out_idx.len() as i64);
    }
    a
}

/// A schedule from `step_kind` (0 compute, 1 free), `step_id` and `forward_len`.
/// Ids are checked against the graph by the simulator, not here. An error names the first bad
/// step (the number of steps for problems of the whole).
pub fn schedule_from_arrays(
    step_kind: &[i8],
    step_id: &[i64],
    forward_len: i64,
) -> Result<Schedule, ScheduleError> {
    let n_steps = step_kind.len().min(step_id.len());
    let err_at = |step: usize, field: &str, message: String| ScheduleError {
        step,
        message: format!("schedule arrays: field '{field}': {message}"),
    };
    if step_kind.len() != step_id.len() {
        return Err(err_at(
            n_steps,
            "step_id",
            format!(
                "has length {}, but step_kind has {}; both have one item per step",
                step_id.len(),
                step_kind.len()
            ),
        ));
    }
    let mut steps = Vec::with_capacity(step_kind.len());
    for (i, (&k, &id)) in step_kind.iter().zip(step_id).enumerate() {
        let id = usize::try_from(id)
            .map_err(|_| err_at(i, "step_id", format!("item {i} is {id}; ids are >= 0")))?;
        steps.push(match k {
            0 => Step::Compute(id),
            1 => Step::Free(id),
            x => {
                return Err(err_at(
                    i,
                    "step_kind",
                    format!("item {i} is {x}; 0 = compute, 1 = free"),
                ))
            }
        });
    }
    let forward_len = usize::try_from(forward_len)
        .ok()
        .filter(|&f| f <= steps.len())
        .ok_or_else(|| {
            err_at(
                n_steps,
                "forward_len",
                format!(
                    "is {forward_len}; must be between 0 and the number of steps ({})",
                    steps.len()
                ),
            )
        })?;
    Ok(Schedule { steps, forward_len })
}

/// `(step_kind, step_id, forward_len)` of a schedule.
pub fn schedule_to_arrays(s: &Schedule) -> (Vec<i8>, Vec<i64>, usize) {
    (
        s.steps.iter().map(|st| st.kind_code()).collect(),
        s.steps.iter().map(|st| st.id() as i64).collect(),
        s.forward_len,
    )
}
