//! Simplification, hierarchical partitioning and leaf options for Python.
//!
//! Graphs arrive as the flat arrays of docs/graph-ir.md (keyword arguments, see graph_api.rs);
//! results go back as dicts of numpy arrays in CSR form (docs/hierarchy.md, "Arrays").
//! The work runs on a worker thread (`errors::run_native`): Ctrl-C sets a cancellation flag the
//! core checks, and KeyboardInterrupt is raised as soon as the worker stops. Core errors become
//! the exception classes of `errors.rs` (ValueError subclasses for bad input), panics
//! InternalError.

use hrockmate_core::arrays::{graph_to_arrays, schedule_from_arrays, schedule_to_arrays};
use hrockmate_core::options::{enumerate_all, AllOptions, OptionsConfig};
use hrockmate_core::partition::{backward_owners as partition_owners, build_hierarchy_cancellable, partitioner_by_name, Hierarchy, PartitionConfig};
use hrockmate_core::schedule::Step;
use hrockmate_core::simplify::{simplify as simplify_core, SimplifyConfig, Simplified};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{run_native, Failure};
use crate::graph_api::graph_input;

/// CSR of a list of id lists: (ptr int64[n+1], idx int64[...]).
fn csr<'a>(lists: impl Iterator<Item = &'a [usize]>) -> (Vec<i64>, Vec<i64>) {
    let mut ptr = vec![0i64];
    let mut idx = Vec::new();
    for l in lists {
        idx.extend(l.iter().map(|&x| x as i64));
        ptr.push(idx.len() as i64);
    }
    (ptr, idx)
}

fn set_csr<'a>(d: &Bound<'_, PyDict>, name: &str, lists: impl Iterator<Item = &'a [usize]>) -> PyResult<()> {
    let py = d.py();
    let (ptr, idx) = csr(lists);
    d.set_item(format!("{name}_ptr"), ptr.into_pyarray(py))?;
    d.set_item(format!("{name}_idx"), idx.into_pyarray(py))?;
    Ok(())
}

fn steps_csr(d: &Bound<'_, PyDict>, name: &str, lists: &[&[Step]]) -> PyResult<()> {
    let py = d.py();
    let mut ptr = vec![0i64];
    let mut kind = Vec::new();
    let mut id = Vec::new();
    for l in lists {
        for s in l.iter() {
            kind.push(s.kind_code());
            id.push(s.id() as i64);
        }
        ptr.push(id.len() as i64);
    }
    d.set_item(format!("{name}_ptr"), ptr.into_pyarray(py))?;
    d.set_item(format!("{name}_kind"), kind.into_pyarray(py))?;
    d.set_item(format!("{name}_id"), id.into_pyarray(py))?;
    Ok(())
}

fn hierarchy_dict<'py>(py: Python<'py>, h: &Hierarchy, opts: Option<&AllOptions>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let cs = &h.clusters;
    d.set_item("partitioner", &h.partitioner)?;
    d.set_item("root", h.root)?;
    d.set_item("level", cs.iter().map(|c| c.level as i64).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("is_leaf", cs.iter().map(|c| c.is_leaf).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("parent", cs.iter().map(|c| c.parent.map_or(-1, |p| p as i64)).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("canon_hash", cs.iter().map(|c| c.canon_hash).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("representative", cs.iter().map(|c| c.representative as i64).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("op_cluster", h.op_cluster.iter().map(|&c| c as i64).collect::<Vec<_>>().into_pyarray(py))?;
    set_csr(&d, "children", cs.iter().map(|c| c.children.as_slice()))?;
    set_csr(&d, "fwd_ops", cs.iter().map(|c| c.fwd_ops.as_slice()))?;
    set_csr(&d, "bwd_ops", cs.iter().map(|c| c.bwd_ops.as_slice()))?;
    set_csr(&d, "own_bwd_ops", cs.iter().map(|c| c.own_bwd_ops.as_slice()))?;
    set_csr(&d, "inputs", cs.iter().map(|c| c.inputs.as_slice()))?;
    set_csr(&d, "outputs", cs.iter().map(|c| c.outputs.as_slice()))?;
    if let Some(all) = opts {
        let flat: Vec<(usize, &hrockmate_core::options::ClusterOption)> =
            all.options.iter().enumerate().flat_map(|(c, v)| v.iter().map(move |o| (c, o))).collect();
        d.set_item("exact", all.exact.clone().into_pyarray(py))?;
        d.set_item("opt_cluster", flat.iter().map(|(c, _)| *c as i64).collect::<Vec<_>>().into_pyarray(py))?;
        d.set_item("opt_fwd_time", flat.iter().map(|(_, o)| o.fwd_time).collect::<Vec<_>>().into_pyarray(py))?;
        d.set_item("opt_bwd_time", flat.iter().map(|(_, o)| o.bwd_time).collect::<Vec<_>>().into_pyarray(py))?;
        d.set_item("opt_saved_bytes", flat.iter().map(|(_, o)| o.saved_bytes as i64).collect::<Vec<_>>().into_pyarray(py))?;
        d.set_item("opt_fwd_overhead", flat.iter().map(|(_, o)| o.fwd_overhead as i64).collect::<Vec<_>>().into_pyarray(py))?;
        d.set_item("opt_bwd_overhead", flat.iter().map(|(_, o)| o.bwd_overhead as i64).collect::<Vec<_>>().into_pyarray(py))?;
        steps_csr(&d, "opt_fwd", &flat.iter().map(|(_, o)| o.fwd_steps.as_slice()).collect::<Vec<_>>())?;
        steps_csr(&d, "opt_bwd", &flat.iter().map(|(_, o)| o.bwd_steps.as_slice()).collect::<Vec<_>>())?;
        set_csr(&d, "opt_saved", flat.iter().map(|(_, o)| o.saved.as_slice()))?;
        set_csr(&d, "opt_needs_inputs", flat.iter().map(|(_, o)| o.bwd_needs_inputs.as_slice()))?;
        set_csr(&d, "opt_needs_outputs", flat.iter().map(|(_, o)| o.bwd_needs_outputs.as_slice()))?;
    }
    Ok(d)
}

/// Partition a graph (and, with `options=True`, enumerate every leaf's options).
#[pyfunction]
#[pyo3(signature = (partitioner="contiguous", max_size=20, top_max_size=30, alpha=0.5, leaf_size=6, group_size=4, options=true, max_options=12, exact_limit=20, max_evaluations=1_000_000, **graph))]
#[allow(clippy::too_many_arguments)]
fn build_hierarchy<'py>(
    py: Python<'py>,
    partitioner: &str,
    max_size: usize,
    top_max_size: usize,
    alpha: f64,
    leaf_size: usize,
    group_size: usize,
    options: bool,
    max_options: usize,
    exact_limit: usize,
    max_evaluations: usize,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let input = graph_input(graph)?;
    let part = partitioner_by_name(partitioner).map_err(|e| Failure::from(e).into_pyerr(py))?;
    let pcfg = PartitionConfig { max_size, top_max_size, alpha, leaf_size, group_size, ..PartitionConfig::default() };
    let ocfg = OptionsConfig { max_options, exact_limit, max_evaluations };
    let (h, opts) = run_native(py, None, |stop| {
        let g = input.build()?;
        let h = build_hierarchy_cancellable(&g, part.as_ref(), &pcfg, &|| stop.should_stop())?;
        let opts = if options { Some(enumerate_all(&g, &h, &ocfg, stop.cancel_flag())?) } else { None };
        Ok((h, opts))
    })?;
    hierarchy_dict(py, &h, opts.as_ref())
}

/// The block of every backward op given the blocks of the forward ops (the hierarchy's and block
/// checkpointing's rule, `partition::backward_owners`): int64, -1 for forward ops.
/// `block_of_fwd[o]`: the block of forward op `o`, -1 for none.
#[pyfunction]
#[pyo3(signature = (block_of_fwd, last, **graph))]
fn backward_owners<'py>(
    py: Python<'py>,
    block_of_fwd: PyReadonlyArray1<'py, i64>,
    last: usize,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let input = graph_input(graph)?;
    let blocks: Vec<usize> = block_of_fwd.as_array().iter().map(|&b| usize::try_from(b).unwrap_or(usize::MAX)).collect();
    let owner = run_native(py, None, |_| {
        let g = input.build()?;
        if blocks.len() != g.ops.len() {
            return Err(Failure::InvalidArgument(format!(
                "block_of_fwd has {} entries for a graph of {} ops",
                blocks.len(),
                g.ops.len()
            )));
        }
        Ok(partition_owners(&g, &blocks, last))
    })?;
    Ok(owner.into_iter().map(|o| if o == usize::MAX { -1 } else { o as i64 }).collect::<Vec<i64>>().into_pyarray(py))
}

fn simplified_dict<'py>(py: Python<'py>, s: &Simplified) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let a = graph_to_arrays(&s.graph);
    d.set_item("tensor_bytes", a.tensor_bytes.into_pyarray(py))?;
    d.set_item("tensor_alias", a.tensor_alias.into_pyarray(py))?;
    d.set_item("tensor_role", a.tensor_role.into_pyarray(py))?;
    d.set_item("op_time", a.op_time.into_pyarray(py))?;
    d.set_item("op_workspace", a.op_workspace.into_pyarray(py))?;
    d.set_item("op_phase", a.op_phase.into_pyarray(py))?;
    d.set_item("op_differentiates", a.op_differentiates.into_pyarray(py))?;
    d.set_item("op_flags", a.op_flags.into_pyarray(py))?;
    d.set_item("op_in_ptr", a.op_in_ptr.into_pyarray(py))?;
    d.set_item("op_in_idx", a.op_in_idx.into_pyarray(py))?;
    d.set_item("op_out_ptr", a.op_out_ptr.into_pyarray(py))?;
    d.set_item("op_out_idx", a.op_out_idx.into_pyarray(py))?;
    if let Some(v) = a.tensor_grad_of {
        d.set_item("tensor_grad_of", v.into_pyarray(py))?;
    }
    if let Some(v) = a.tensor_updates {
        d.set_item("tensor_updates", v.into_pyarray(py))?;
    }
    d.set_item("op_origin_ptr", csr(s.op_origin.iter().map(|v| v.as_slice())).0.into_pyarray(py))?;
    d.set_item("op_origin_idx", csr(s.op_origin.iter().map(|v| v.as_slice())).1.into_pyarray(py))?;
    d.set_item("tensor_origin", s.tensor_origin.iter().map(|&t| t as i64).collect::<Vec<_>>().into_pyarray(py))?;
    d.set_item("tensor_new", s.tensor_new.iter().map(|t| t.map_or(-1, |x| x as i64)).collect::<Vec<_>>().into_pyarray(py))?;
    Ok(d)
}

/// Simplify a graph; returns the simplified graph's arrays plus the id mappings.
#[pyfunction]
#[pyo3(signature = (fold_views=true, merge_chains=true, **graph))]
fn simplify<'py>(py: Python<'py>, fold_views: bool, merge_chains: bool, graph: Option<&Bound<'py, PyDict>>) -> PyResult<Bound<'py, PyDict>> {
    let input = graph_input(graph)?;
    let cfg = SimplifyConfig { fold_views, merge_chains };
    let s = run_native(py, None, |_| Ok(simplify_core(&input.build()?, &cfg)))?;
    simplified_dict(py, &s)
}

/// Map a schedule of the simplified graph back to the original graph: (kind, id, forward_len).
#[pyfunction]
#[pyo3(signature = (step_kind, step_id, forward_len, fold_views=true, merge_chains=true, **graph))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn expand_schedule<'py>(
    py: Python<'py>,
    step_kind: PyReadonlyArray1<'py, i8>,
    step_id: PyReadonlyArray1<'py, i64>,
    forward_len: i64,
    fold_views: bool,
    merge_chains: bool,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Bound<'py, numpy::PyArray1<i8>>, Bound<'py, numpy::PyArray1<i64>>, usize)> {
    let input = graph_input(graph)?;
    let kind: Vec<i8> = step_kind.as_array().iter().copied().collect();
    let id: Vec<i64> = step_id.as_array().iter().copied().collect();
    let cfg = SimplifyConfig { fold_views, merge_chains };
    let s = run_native(py, None, |_| {
        let g = input.build()?;
        let simplified = simplify_core(&g, &cfg);
        let sched = schedule_from_arrays(&kind, &id, forward_len)?;
        simplified
            .expand_schedule(&g, &sched)
            .map_err(|message| Failure::InvalidSchedule { step: None, message })
    })?;
    let (k, i, f) = schedule_to_arrays(&s);
    Ok((k.into_pyarray(py), i.into_pyarray(py), f))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build_hierarchy, m)?)?;
    m.add_function(wrap_pyfunction!(backward_owners, m)?)?;
    m.add_function(wrap_pyfunction!(simplify, m)?)?;
    m.add_function(wrap_pyfunction!(expand_schedule, m)?)?;
    Ok(())
}
