//! Solvers from the literature for Python: TW-Remat and Rotor, on graphs or, for Rotor, on a
//! chain given as arrays (see docs/literature-solvers.md).
//!
//! Graphs arrive as the flat arrays of docs/graph-ir.md (keyword arguments, as for
//! `simulate`). Errors raise ValueError whose args are `(kind, message, min_bytes)`, with kind
//! one of "not_a_chain", "infeasible", "invalid_argument", "internal", so that the Python
//! wrappers can raise precise exceptions.

use hrockmate_core::arrays::schedule_to_arrays;
use hrockmate_core::literature::chain::{rotor as rotor_core, ChainStructure, MAX_TABLE_CELLS};
use hrockmate_core::literature::rotor::{op_options, solve_refined, Chain, ChainOp, Stage, StateOption};
use hrockmate_core::literature::twremat::{default_step_cap, TwRemat};
use hrockmate_core::literature::LiteratureError;
use hrockmate_core::schedule::Schedule;
use hrockmate_core::simulate::{simulate, SimResult};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
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

fn invalid(message: String) -> PyErr {
    PyValueError::new_err(("invalid_argument", message, 0u64))
}

/// Build a chain from per-stage arrays and CSR-style per-option arrays (see [`rotor_chain`]).
#[allow(clippy::too_many_arguments)]
fn chain_from_arrays(
    input_bytes: u64,
    final_grad_bytes: u64,
    fwd_time: &[f64],
    out_bytes: &[u64],
    grad_bytes: &[u64],
    fwd_overhead: &[u64],
    opt_ptr: &[i64],
    opt_fwd_time: &[f64],
    opt_state_bytes: &[u64],
    opt_fwd_overhead: &[u64],
    opt_bwd_time: &[f64],
    opt_bwd_overhead: &[u64],
) -> Result<Chain, String> {
    let l = fwd_time.len();
    for (name, len) in [("out_bytes", out_bytes.len()), ("grad_bytes", grad_bytes.len()), ("fwd_overhead", fwd_overhead.len())] {
        if len != l {
            return Err(format!("{name} has {len} entries but fwd_time has {l} (one per stage)"));
        }
    }
    if opt_ptr.len() != l + 1 {
        return Err(format!("opt_ptr has {} entries; it needs one per stage plus one ({})", opt_ptr.len(), l + 1));
    }
    let n = opt_fwd_time.len();
    for (name, len) in [
        ("opt_state_bytes", opt_state_bytes.len()),
        ("opt_fwd_overhead", opt_fwd_overhead.len()),
        ("opt_bwd_time", opt_bwd_time.len()),
        ("opt_bwd_overhead", opt_bwd_overhead.len()),
    ] {
        if len != n {
            return Err(format!("{name} has {len} entries but opt_fwd_time has {n} (one per option)"));
        }
    }
    if opt_ptr[0] != 0 || opt_ptr[l] != n as i64 {
        return Err(format!("opt_ptr must start at 0 and end at the number of options ({n}); got {} .. {}", opt_ptr[0], opt_ptr[l]));
    }
    for k in 0..l {
        let (lo, hi) = (opt_ptr[k], opt_ptr[k + 1]);
        if hi < lo {
            return Err(format!("opt_ptr must be non-decreasing; opt_ptr[{}] = {hi} < opt_ptr[{k}] = {lo}", k + 1));
        }
    }
    let mut stages = Vec::with_capacity(l);
    for k in 0..l {
        let (lo, hi) = (opt_ptr[k], opt_ptr[k + 1]);
        if hi == lo {
            return Err(format!("stage {} has no state option; give each stage at least one", k + 1));
        }
        let options = (lo as usize..hi as usize)
            .map(|i| StateOption {
                fwd_time: opt_fwd_time[i],
                state_bytes: opt_state_bytes[i],
                fwd_overhead: opt_fwd_overhead[i],
                bwd_time: opt_bwd_time[i],
                bwd_overhead: opt_bwd_overhead[i],
            })
            .collect();
        stages.push(Stage {
            fwd_time: fwd_time[k],
            out_bytes: out_bytes[k],
            grad_bytes: grad_bytes[k],
            fwd_overhead: fwd_overhead[k],
            options,
        });
    }
    Ok(Chain { input_bytes, final_grad_bytes, stages })
}

/// Rotor's dynamic program on a chain given as arrays, each stage with one or more state
/// options (`opt_ptr[k]..opt_ptr[k+1]` index the options of stage `k + 1`). Slots are refined
/// (x4) when rounding alone loses a limit the exact model meets. Returns a dict with
/// `op_kind` (int8: 0 Forward, 1 ForwardAll, 2 Backward, 3 Free), `op_stage` (int64, 1-based),
/// `op_option` (int64: the option of ForwardAll and Backward, else -1), `time`, `peak_bytes`.
#[pyfunction]
#[pyo3(signature = (input_bytes, final_grad_bytes, fwd_time, out_bytes, grad_bytes, fwd_overhead,
    opt_ptr, opt_fwd_time, opt_state_bytes, opt_fwd_overhead, opt_bwd_time, opt_bwd_overhead,
    limit_bytes, slots))]
#[allow(clippy::too_many_arguments)]
fn rotor_chain<'py>(
    py: Python<'py>,
    input_bytes: u64,
    final_grad_bytes: u64,
    fwd_time: PyReadonlyArray1<'py, f64>,
    out_bytes: PyReadonlyArray1<'py, u64>,
    grad_bytes: PyReadonlyArray1<'py, u64>,
    fwd_overhead: PyReadonlyArray1<'py, u64>,
    opt_ptr: PyReadonlyArray1<'py, i64>,
    opt_fwd_time: PyReadonlyArray1<'py, f64>,
    opt_state_bytes: PyReadonlyArray1<'py, u64>,
    opt_fwd_overhead: PyReadonlyArray1<'py, u64>,
    opt_bwd_time: PyReadonlyArray1<'py, f64>,
    opt_bwd_overhead: PyReadonlyArray1<'py, u64>,
    limit_bytes: u64,
    slots: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let v = |a: &PyReadonlyArray1<'py, u64>| a.as_array().to_vec();
    let f = |a: &PyReadonlyArray1<'py, f64>| a.as_array().to_vec();
    let chain = chain_from_arrays(
        input_bytes,
        final_grad_bytes,
        &f(&fwd_time),
        &v(&out_bytes),
        &v(&grad_bytes),
        &v(&fwd_overhead),
        &opt_ptr.as_array().to_vec(),
        &f(&opt_fwd_time),
        &v(&opt_state_bytes),
        &v(&opt_fwd_overhead),
        &f(&opt_bwd_time),
        &v(&opt_bwd_overhead),
    )
    .map_err(invalid)?;
    let sol = py
        .detach(move || solve_refined(&chain, limit_bytes, slots, MAX_TABLE_CELLS))
        .map_err(to_py_err)?;
    let options = op_options(&sol.ops);
    let n = sol.ops.len();
    let (mut kind, mut stage, mut option) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for (op, o) in sol.ops.iter().zip(options) {
        let (kd, k) = match *op {
            ChainOp::Forward(k) => (0i8, k),
            ChainOp::ForwardAll(k, _) => (1, k),
            ChainOp::Backward(k) => (2, k),
            ChainOp::Free(k) => (3, k),
        };
        kind.push(kd);
        stage.push(k as i64);
        option.push(o.map_or(-1, |o| o as i64));
    }
    let d = PyDict::new(py);
    d.set_item("op_kind", kind.into_pyarray(py))?;
    d.set_item("op_stage", stage.into_pyarray(py))?;
    d.set_item("op_option", option.into_pyarray(py))?;
    d.set_item("time", sol.time)?;
    d.set_item("peak_bytes", sol.peak_bytes)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(twremat, m)?)?;
    m.add_function(wrap_pyfunction!(rotor, m)?)?;
    m.add_function(wrap_pyfunction!(chain_stages, m)?)?;
    m.add_function(wrap_pyfunction!(rotor_chain, m)?)?;
    Ok(())
}
