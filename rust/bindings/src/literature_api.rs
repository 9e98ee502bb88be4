//! Solvers from the literature for Python: TW-Remat and Rotor (see docs/literature-solvers.md).
//!
//! Graphs arrive as the flat arrays of docs/graph-ir.md (keyword arguments, as for
//! `simulate`). Errors raise ValueError whose args are `(kind, message, min_bytes)`, with kind
//! one of "not_a_chain", "infeasible", "invalid_argument", "internal", so that the Python
//! wrappers can raise precise exceptions.

use hrockmate_core::arrays::schedule_to_arrays;
use hrockmate_core::literature::chain::{rotor as rotor_core, ChainStructure};
use hrockmate_core::literature::twremat::{default_step_cap, TwRemat};
use hrockmate_core::literature::LiteratureError;
use hrockmate_core::schedule::Schedule;
use hrockmate_core::simulate::{simulate, SimResult};
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::graph_api::graph_input;

fn to_py_err(e: LiteratureError) -> PyErr {
    let message = e.to_string();
    let (kind, min) = match e {
        LiteratureError::NotAChain(_) => ("not_a_chain", 0),
        LiteratureError::Infeasible { min_bytes, .. } => ("infeasible", min_bytes),
        LiteratureError::InvalidArgument(_) | LiteratureError::StepLimit { .. } => ("invalid_argument", 0),
        LiteratureError::Internal(_) => ("internal", 0),
    };
    PyValueError::new_err((kind, message, min))
}

fn graph_err(message: String) -> PyErr {
    PyValueError::new_err(("invalid_graph", message, 0u64))
}

/// A schedule and its simulation as Python receives them:
/// `(step_kind int8, step_id int64, forward_len, sim dict)`.
type Point<'py> = (Bound<'py, PyArray1<i8>>, Bound<'py, PyArray1<i64>>, usize, Bound<'py, PyDict>);

fn point<'py>(py: Python<'py>, s: &Schedule, r: &SimResult) -> PyResult<Point<'py>> {
    let (kind, id, forward_len) = schedule_to_arrays(s);
    let d = crate::graph_api::sim_result_dict(py, r)?;
    Ok((kind.into_pyarray(py), id.into_pyarray(py), forward_len, d))
}

/// TW-Remat at the given depth limits (None: every depth from 0 to the full recursion, each
/// distinct schedule once, stopping where schedules exceed `max_steps` steps, by default a few
/// hundred per op; with explicit depths, `max_steps` exceeded is an error).
/// Returns a list of `(depth_limit, step_kind, step_id, forward_len, sim)`.
#[pyfunction]
#[pyo3(signature = (depth_limits=None, max_steps=None, **graph))]
fn twremat<'py>(
    py: Python<'py>,
    depth_limits: Option<Vec<usize>>,
    max_steps: Option<usize>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let input = graph_input(graph)?;
    let results = py.detach(move || -> Result<Vec<(usize, Schedule, SimResult)>, PyErr> {
        let g = input.build().map_err(graph_err)?;
        let tw = TwRemat::new(&g);
        let all = depth_limits.is_none();
        let depths = depth_limits.unwrap_or_else(|| (0..=tw.height()).collect());
        let mut out: Vec<(usize, Schedule, SimResult)> = Vec::with_capacity(depths.len());
        let cap = max_steps.unwrap_or_else(|| if all { default_step_cap(&g) } else { usize::MAX });
        for d in depths {
            let s = match tw.schedule_capped(&g, d, cap) {
                Ok(s) => s,
                // Listing every depth stops where schedules get too long.
                Err(LiteratureError::StepLimit { .. }) if all && !out.is_empty() => break,
                Err(e) => return Err(to_py_err(e)),
            };
            // When listing every depth, a depth that changes nothing is reported once.
            if all && out.last().is_some_and(|(_, prev, _)| *prev == s) {
                continue;
            }
            let sim = simulate(&g, &s).map_err(|e| to_py_err(LiteratureError::Internal(e.to_string())))?;
            out.push((d.min(tw.height()), s, sim));
        }
        Ok(out)
    })?;
    let list = PyList::empty(py);
    for (d, s, sim) in &results {
        let (kind, id, forward_len, dict) = point(py, s, sim)?;
        list.append((*d, kind, id, forward_len, dict))?;
    }
    Ok(list)
}

/// Rotor on a chain-structured graph: `(step_kind, step_id, forward_len, sim)`.
#[pyfunction]
#[pyo3(signature = (budget_bytes, slots=500, **graph))]
fn rotor<'py>(
    py: Python<'py>,
    budget_bytes: u64,
    slots: usize,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Point<'py>> {
    let input = graph_input(graph)?;
    let (s, sim) = py.detach(move || {
        let g = input.build().map_err(graph_err)?;
        rotor_core(&g, budget_bytes, slots).map_err(to_py_err)
    })?;
    point(py, &s, &sim)
}

/// The chain stages of a graph: a list of `(forward op ids, backward op ids)` per stage.
#[pyfunction]
#[pyo3(signature = (**graph))]
fn chain_stages(py: Python<'_>, graph: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(Vec<usize>, Vec<usize>)>> {
    let input = graph_input(graph)?;
    py.detach(move || {
        let g = input.build().map_err(graph_err)?;
        let cs = ChainStructure::detect(&g).map_err(to_py_err)?;
        Ok(cs.forward.into_iter().zip(cs.backward).collect())
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(twremat, m)?)?;
    m.add_function(wrap_pyfunction!(rotor, m)?)?;
    m.add_function(wrap_pyfunction!(chain_stages, m)?)?;
    Ok(())
}
