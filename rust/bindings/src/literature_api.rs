//! Solvers from the literature for Python: TW-Remat and Rotor, on graphs or, for Rotor, on a
//! chain given as arrays (see docs/literature-solvers.md).
//!
//! Graphs arrive as the flat arrays of docs/graph-ir.md (keyword arguments, as for
//! `simulate`). The work runs on a worker thread (`errors::run_native`): `time_limit` (seconds)
//! bounds it and Ctrl-C stops it. Errors raise the classes of `errors.rs`: InvalidGraphError,
//! NotAChainError, InfeasibleError (with `limit_bytes`, `min_bytes`), InvalidArgumentError,
//! TooLargeError (Rotor's tables beyond `max_table_bytes`), TimeLimitError, InternalError.

use hrockmate_core::arrays::schedule_to_arrays;
use hrockmate_core::literature::chain::{rotor_within, ChainStructure};
use hrockmate_core::literature::rotor::{
    op_options, solve_refined, Bounds, Chain, ChainOp, Stage, StateOption, DEFAULT_MAX_TABLE_BYTES,
};
use hrockmate_core::literature::twremat::twremat_points_within;
use hrockmate_core::schedule::Schedule;
use hrockmate_core::simulate::SimResult;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{run_native, Failure};
use crate::graph_api::graph_input;

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
/// hundred per op, or the points exceed 20 million steps in all; with explicit depths,
/// `max_steps` exceeded is an error): `twremat::twremat_points_within`.
/// Returns a list of `(depth_limit, step_kind, step_id, forward_len, sim)`.
#[pyfunction]
#[pyo3(signature = (depth_limits=None, max_steps=None, time_limit=None, **graph))]
fn twremat<'py>(
    py: Python<'py>,
    depth_limits: Option<Vec<usize>>,
    max_steps: Option<usize>,
    time_limit: Option<f64>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let input = graph_input(graph)?;
    let points = run_native(py, time_limit, |stop| {
        let g = input.build()?;
        Ok(twremat_points_within(&g, depth_limits.as_deref(), max_steps, stop)?)
    })?;
    let list = PyList::empty(py);
    for p in &points {
        let (kind, id, forward_len, dict) = point(py, &p.schedule, &p.sim)?;
        list.append((p.depth_limit, kind, id, forward_len, dict))?;
    }
    Ok(list)
}

/// Rotor on a chain-structured graph: `(step_kind, step_id, forward_len, sim)`. The program's
/// tables stay within `max_table_bytes` (slots are reduced to fit; TooLargeError when not even
/// the fewest useful slots fit).
#[pyfunction]
#[pyo3(signature = (budget_bytes, slots=500, time_limit=None, max_table_bytes=DEFAULT_MAX_TABLE_BYTES, **graph))]
fn rotor<'py>(
    py: Python<'py>,
    budget_bytes: u64,
    slots: usize,
    time_limit: Option<f64>,
    max_table_bytes: u64,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Point<'py>> {
    let input = graph_input(graph)?;
    let (s, sim) = run_native(py, time_limit, |stop| {
        let g = input.build()?;
        Ok(rotor_within(&g, budget_bytes, slots, &Bounds { max_table_bytes, stop: *stop })?)
    })?;
    point(py, &s, &sim)
}

/// The chain stages of a graph: a list of `(forward op ids, backward op ids)` per stage.
#[pyfunction]
#[pyo3(signature = (**graph))]
fn chain_stages(py: Python<'_>, graph: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(Vec<usize>, Vec<usize>)>> {
    let input = graph_input(graph)?;
    run_native(py, None, |_| {
        let g = input.build()?;
        let cs = ChainStructure::detect(&g)?;
        Ok(cs.forward.into_iter().zip(cs.backward).collect())
    })
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
/// (x4) when rounding alone loses a limit the exact model meets, and reduced when the tables
/// would exceed `max_table_bytes`. Returns a dict with `op_kind` (int8: 0 Forward,
/// 1 ForwardAll, 2 Backward, 3 Free), `op_stage` (int64, 1-based), `op_option` (int64: the
/// option of ForwardAll and Backward, else -1), `time`, `peak_bytes` and `slots` (those used).
#[pyfunction]
#[pyo3(signature = (input_bytes, final_grad_bytes, fwd_time, out_bytes, grad_bytes, fwd_overhead,
    opt_ptr, opt_fwd_time, opt_state_bytes, opt_fwd_overhead, opt_bwd_time, opt_bwd_overhead,
    limit_bytes, slots, time_limit=None, max_table_bytes=DEFAULT_MAX_TABLE_BYTES))]
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
    time_limit: Option<f64>,
    max_table_bytes: u64,
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
    .map_err(|m| Failure::InvalidArgument(m).into_pyerr(py))?;
    let sol = run_native(py, time_limit, |stop| {
        Ok(solve_refined(&chain, limit_bytes, slots, &Bounds { max_table_bytes, stop: *stop })?)
    })?;
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
    d.set_item("slots", sol.slots)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(twremat, m)?)?;
    m.add_function(wrap_pyfunction!(rotor, m)?)?;
    m.add_function(wrap_pyfunction!(chain_stages, m)?)?;
    m.add_function(wrap_pyfunction!(rotor_chain, m)?)?;
    Ok(())
}
