//! Graph IR, schedules and the simulator for Python.
//!
//! Graphs arrive as keyword arguments holding the flat numpy arrays of docs/graph-ir.md
//! ("Flat array form"), plus optional `tensor_grad_of`/`tensor_updates` arrays and optional
//! `tensor_names`/`op_names` lists (used only in error messages). Arrays are copied out while
//! attached; the work runs on a worker thread (`errors::run_native`, Ctrl-C stops it). Bad
//! input raises TypeError (wrong kind or dtype), InvalidGraphError or InvalidScheduleError
//! (a rule broken; schedule errors start with "step N:" and carry `.step`), TooLargeError
//! (recompute-all longer than its bound).

use hrockmate_core::arrays::{
    graph_from_arrays, schedule_from_arrays, schedule_to_arrays, GraphArrays,
};
use hrockmate_core::checkpointing::{block_checkpoint, checkpoint_points as core_points, CheckpointFacts};
use hrockmate_core::graph::Graph;
use hrockmate_core::greedy::{greedy_eviction_scored as core_greedy, EvictionScore};
use hrockmate_core::limits::Stop;
use hrockmate_core::io::{graph_to_json, parse_graph_json, parse_schedule_json, GraphError};
use hrockmate_core::schedule::Schedule;
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::{simulate_within, SimResult};
use numpy::{Element, IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{run_native, Failure};

const REQUIRED: [&str; 12] = [
    "tensor_bytes",
    "tensor_alias",
    "tensor_role",
    "op_time",
    "op_workspace",
    "op_phase",
    "op_differentiates",
    "op_flags",
    "op_in_ptr",
    "op_in_idx",
    "op_out_ptr",
    "op_out_idx",
];
const OPTIONAL: [&str; 4] = [
    "tensor_grad_of",
    "tensor_updates",
    "tensor_names",
    "op_names",
];

/// A graph copied out of Python: arrays plus optional names.
pub(crate) struct GraphInput {
    arrays: GraphArrays,
    tensor_names: Option<Vec<String>>,
    op_names: Option<Vec<String>>,
}

impl GraphInput {
    pub(crate) fn build(&self) -> Result<Graph, GraphError> {
        graph_from_arrays(
            &self.arrays,
            self.tensor_names.as_deref(),
            self.op_names.as_deref(),
        )
    }
}

fn array<T: Element + Copy>(
    kwargs: &Bound<'_, PyDict>,
    name: &str,
    dtype: &str,
) -> PyResult<Option<Vec<T>>> {
    let Some(value) = kwargs.get_item(name)? else {
        return Ok(None);
    };
    if value.is_none() {
        return Ok(None);
    }
    let arr: PyReadonlyArray1<T> = value.extract().map_err(|e| {
        PyTypeError::new_err(format!(
            "graph array '{name}' must be a 1-D numpy array of dtype {dtype} (as Graph.to_arrays() makes): {e}"
        ))
    })?;
    Ok(Some(arr.as_array().iter().copied().collect()))
}

fn names(kwargs: &Bound<'_, PyDict>, name: &str) -> PyResult<Option<Vec<String>>> {
    match kwargs.get_item(name)? {
        Some(v) if !v.is_none() => v
            .extract::<Vec<String>>()
            .map(Some)
            .map_err(|e| PyTypeError::new_err(format!("'{name}' must be a list of str: {e}"))),
        _ => Ok(None),
    }
}

/// Copy the graph arrays out of the keyword arguments (while attached).
pub(crate) fn graph_input(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<GraphInput> {
    let Some(kwargs) = kwargs else {
        return Err(PyTypeError::new_err(format!(
            "missing graph arrays ({}); pass **graph.to_arrays()",
            REQUIRED.join(", ")
        )));
    };
    for key in kwargs.keys() {
        let key: String = key.extract()?;
        if !REQUIRED.contains(&key.as_str()) && !OPTIONAL.contains(&key.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "unexpected keyword argument '{key}'; graph arrays are: {}, optional: {}",
                REQUIRED.join(", "),
                OPTIONAL.join(", ")
            )));
        }
    }
    fn req<T: Element + Copy>(
        kwargs: &Bound<'_, PyDict>,
        name: &str,
        dtype: &str,
    ) -> PyResult<Vec<T>> {
        array(kwargs, name, dtype)?.ok_or_else(|| {
            PyTypeError::new_err(format!(
                "missing graph array '{name}' ({dtype}); pass **graph.to_arrays()"
            ))
        })
    }
    Ok(GraphInput {
        arrays: GraphArrays {
            tensor_bytes: req(kwargs, "tensor_bytes", "int64")?,
            tensor_alias: req(kwargs, "tensor_alias", "int64")?,
            tensor_role: req(kwargs, "tensor_role", "int8")?,
            op_time: req(kwargs, "op_time", "float64")?,
            op_workspace: req(kwargs, "op_workspace", "int64")?,
            op_phase: req(kwargs, "op_phase", "int8")?,
            op_differentiates: req(kwargs, "op_differentiates", "int64")?,
            op_flags: req(kwargs, "op_flags", "uint8")?,
            op_in_ptr: req(kwargs, "op_in_ptr", "int64")?,
            op_in_idx: req(kwargs, "op_in_idx", "int64")?,
            op_out_ptr: req(kwargs, "op_out_ptr", "int64")?,
            op_out_idx: req(kwargs, "op_out_idx", "int64")?,
            tensor_grad_of: array(kwargs, "tensor_grad_of", "int64")?,
            tensor_updates: array(kwargs, "tensor_updates", "int64")?,
        },
        tensor_names: names(kwargs, "tensor_names")?,
        op_names: names(kwargs, "op_names")?,
    })
}

/// A schedule as Python receives it: (step_kind int8, step_id int64, forward_len).
type ScheduleArrays<'py> = (Bound<'py, PyArray1<i8>>, Bound<'py, PyArray1<i64>>, usize);

fn schedule_arrays<'py>(py: Python<'py>, s: Schedule) -> ScheduleArrays<'py> {
    let (kind, id, forward_len) = schedule_to_arrays(&s);
    (kind.into_pyarray(py), id.into_pyarray(py), forward_len)
}

/// Parse IR JSON or networkx node-link JSON; return the canonical, validated IR JSON.
#[pyfunction]
fn parse_graph(py: Python<'_>, text: &str) -> PyResult<String> {
    let text = text.to_owned();
    run_native(py, None, |_| Ok(graph_to_json(&parse_graph_json(&text)?)))
}

/// Validate a graph given as flat arrays (InvalidGraphError naming the problem).
#[pyfunction]
#[pyo3(signature = (**graph))]
fn check_graph(py: Python<'_>, graph: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let input = graph_input(graph)?;
    run_native(py, None, |_| Ok(input.build().map(|_| ())?))
}

/// Simulate a schedule on a graph; returns a dict of the SimResult fields.
#[pyfunction]
#[pyo3(signature = (step_kind, step_id, forward_len, **graph))]
fn simulate<'py>(
    py: Python<'py>,
    step_kind: PyReadonlyArray1<'py, i8>,
    step_id: PyReadonlyArray1<'py, i64>,
    forward_len: i64,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let input = graph_input(graph)?;
    let kind: Vec<i8> = step_kind.as_array().iter().copied().collect();
    let id: Vec<i64> = step_id.as_array().iter().copied().collect();
    let r = run_native(py, None, |stop| {
        let g = input.build()?;
        let s = schedule_from_arrays(&kind, &id, forward_len)?;
        Ok(simulate_within(&g, &s, stop)?)
    })?;
    sim_result_dict(py, &r)
}

/// A simulation result as Python receives it (python/hrockmate/ir/schedule.py
/// `SimulationResult.from_native`).
pub(crate) fn sim_result_dict<'py>(py: Python<'py>, r: &SimResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("peak_bytes", r.peak_bytes)?;
    d.set_item("time", r.time)?;
    d.set_item("forward_peak", r.forward_peak)?;
    d.set_item("backward_peak", r.backward_peak)?;
    d.set_item("bytes_after_forward", r.bytes_after_forward)?;
    d.set_item("peak_step", r.peak_step)?;
    let timeline: Vec<i64> = r.timeline.iter().map(|&b| b as i64).collect();
    d.set_item("timeline", timeline.into_pyarray(py))?;
    let counts: Vec<i64> = r.compute_count.iter().map(|&c| i64::from(c)).collect();
    d.set_item("compute_count", counts.into_pyarray(py))?;
    Ok(d)
}

/// The store-all (plain autograd) schedule: (step_kind int8, step_id int64, forward_len).
#[pyfunction(name = "store_all")]
#[pyo3(signature = (**graph))]
fn store_all_py<'py>(
    py: Python<'py>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<ScheduleArrays<'py>> {
    let input = graph_input(graph)?;
    let s = run_native(py, None, |_| Ok(store_all(&input.build()?)))?;
    Ok(schedule_arrays(py, s))
}

/// The recompute-all schedule: (step_kind int8, step_id int64, forward_len); TooLargeError when
/// it would be longer than `limits::MAX_SCHEDULE_STEPS`.
#[pyfunction(name = "recompute_all")]
#[pyo3(signature = (**graph))]
fn recompute_all_py<'py>(
    py: Python<'py>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<ScheduleArrays<'py>> {
    let input = graph_input(graph)?;
    let s = run_native(py, None, |_| Ok(recompute_all(&input.build()?)?))?;
    Ok(schedule_arrays(py, s))
}

/// Parse schedule JSON: (step_kind int8, step_id int64, forward_len); InvalidScheduleError on
/// bad input.
#[pyfunction]
fn parse_schedule<'py>(py: Python<'py>, text: &str) -> PyResult<ScheduleArrays<'py>> {
    let text = text.to_owned();
    let s = run_native(py, None, |_| {
        parse_schedule_json(&text)
            .map_err(|e| Failure::InvalidSchedule { step: None, message: e.to_string() })
    })?;
    Ok(schedule_arrays(py, s))
}


/// Ids from Python (int64) for a graph of `n` items: `what` names the array in errors.
fn ids_below(ids: &[i64], n: usize, what: &str) -> Result<Vec<usize>, Failure> {
    ids.iter()
        .enumerate()
        .map(|(i, &x)| {
            usize::try_from(x).ok().filter(|&x| x < n).ok_or_else(|| {
                Failure::InvalidArgument(format!("{what} item {i} is {x}; ids are 0..{n}"))
            })
        })
        .collect()
}

/// Per-block checkpointing with `blocks` contiguous blocks of the forward ops, also keeping the
/// tensors `keep_extra` (int64 ids): (step_kind int8, step_id int64, forward_len)
/// (`checkpointing::block_checkpoint`).
#[pyfunction]
#[pyo3(signature = (blocks, keep_extra, **graph))]
fn block_checkpoint_schedule<'py>(
    py: Python<'py>,
    blocks: usize,
    keep_extra: PyReadonlyArray1<'py, i64>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<ScheduleArrays<'py>> {
    let input = graph_input(graph)?;
    let extra: Vec<i64> = keep_extra.as_array().iter().copied().collect();
    if blocks == 0 {
        return Err(Failure::InvalidArgument("blocks must be >= 1, got 0".into()).into_pyerr(py));
    }
    let s = run_native(py, None, |stop| {
        let g = input.build()?;
        let extra = ids_below(&extra, g.tensors.len(), "keep_extra")?;
        let facts = CheckpointFacts::new(&g);
        Ok(block_checkpoint(&g, &facts, &facts.contiguous_blocks(g.ops.len(), blocks), &extra, stop)?)
    })?;
    Ok(schedule_arrays(py, s))
}

/// Per-block checkpointing with the blocks given by a label per op (`label`, int64, one per op:
/// the layer a forward op belongs to, negative outside every checkpointed layer; backward ops'
/// labels are ignored): a block is a run of forward ops with one label
/// (`CheckpointFacts::labelled_blocks`), and the outputs of the unlabelled ops are kept with
/// `keep_extra`, as a model that checkpoints only its layers keeps everything else.
/// (step_kind int8, step_id int64, forward_len) (`checkpointing::block_checkpoint`).
#[pyfunction]
#[pyo3(signature = (label, keep_extra, **graph))]
fn labelled_checkpoint_schedule<'py>(
    py: Python<'py>,
    label: PyReadonlyArray1<'py, i64>,
    keep_extra: PyReadonlyArray1<'py, i64>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<ScheduleArrays<'py>> {
    let input = graph_input(graph)?;
    let extra: Vec<i64> = keep_extra.as_array().iter().copied().collect();
    let label: Vec<i64> = label.as_array().iter().copied().collect();
    let s = run_native(py, None, |stop| {
        let g = input.build()?;
        if label.len() != g.ops.len() {
            return Err(Failure::InvalidArgument(format!(
                "label has {} items; the graph has {} ops (one label per op)",
                label.len(),
                g.ops.len()
            )));
        }
        let mut extra = ids_below(&extra, g.tensors.len(), "keep_extra")?;
        let facts = CheckpointFacts::new(&g);
        let (block_of, outside) = facts.labelled_blocks(&label);
        for o in outside {
            extra.extend_from_slice(&g.ops[o].outputs);
        }
        extra.sort_unstable();
        extra.dedup();
        Ok(block_checkpoint(&g, &facts, &block_of, &extra, stop)?)
    })?;
    Ok(schedule_arrays(py, s))
}

/// Per-block checkpointing at every candidate block count, simulated
/// (`checkpointing::checkpoint_points`): a list of `(blocks, peak_bytes, time, schedule)`,
/// `schedule` being (step_kind, step_id, forward_len) or None (with `budget_bytes`, only the
/// fastest point within it keeps one). `time_limit`: the counts nearest sqrt(n) first, the rest
/// dropped once it has passed.
#[pyfunction]
#[pyo3(signature = (keep_extra, budget_bytes=None, time_limit=None, **graph))]
fn checkpoint_points<'py>(
    py: Python<'py>,
    keep_extra: PyReadonlyArray1<'py, i64>,
    budget_bytes: Option<u64>,
    time_limit: Option<f64>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let input = graph_input(graph)?;
    let extra: Vec<i64> = keep_extra.as_array().iter().copied().collect();
    Stop::new(None, time_limit).map_err(|m| Failure::InvalidArgument(m).into_pyerr(py))?;
    let points = run_native(py, None, |stop| {
        let g = input.build()?;
        let extra = ids_below(&extra, g.tensors.len(), "keep_extra")?;
        Ok(core_points(&g, &extra, budget_bytes, time_limit, stop)?)
    })?;
    let list = PyList::empty(py);
    for p in points {
        let sched = p.schedule.map(|s| schedule_arrays(py, s));
        list.append((p.blocks, p.peak_bytes, p.time, sched))?;
    }
    Ok(list)
}

/// Greedy eviction (DTR-style, `greedy::greedy_eviction_scored`) within `budget_bytes`, evicting
/// by `score` (a name of `EvictionScore::NAMES`): (step_kind, step_id, forward_len), or None
/// when it gets stuck or `time_limit` (seconds) passes.
#[pyfunction]
#[pyo3(signature = (budget_bytes, time_limit=None, score="staleness", **graph))]
fn greedy_eviction<'py>(
    py: Python<'py>,
    budget_bytes: u64,
    time_limit: Option<f64>,
    score: &str,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Option<ScheduleArrays<'py>>> {
    let Some(score) = EvictionScore::from_name(score) else {
        let names = EvictionScore::NAMES.join(", ");
        return Err(Failure::InvalidArgument(format!("unknown eviction score {score:?}; use one of {names}"))
            .into_pyerr(py));
    };
    let input = graph_input(graph)?;
    Stop::new(None, time_limit).map_err(|m| Failure::InvalidArgument(m).into_pyerr(py))?;
    let s = run_native(py, None, |stop| {
        let g = input.build()?;
        Ok(core_greedy(&g, budget_bytes, score, time_limit, stop)?)
    })?;
    Ok(s.map(|s| schedule_arrays(py, s)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_graph, m)?)?;
    m.add_function(wrap_pyfunction!(check_graph, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(store_all_py, m)?)?;
    m.add_function(wrap_pyfunction!(recompute_all_py, m)?)?;
    m.add_function(wrap_pyfunction!(parse_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(block_checkpoint_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_points, m)?)?;
    m.add_function(wrap_pyfunction!(labelled_checkpoint_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(greedy_eviction, m)?)?;
    m.add("EVICTION_SCORES", EvictionScore::NAMES.to_vec())?;
    Ok(())
}
