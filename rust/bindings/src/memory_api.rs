//! The storage rules for the planner: `MemoryModel(**graph.to_arrays())` holds a validated graph
//! and measures schedule fragments with the rules the simulator uses (`hrockmate_core::memory`).

use std::collections::{HashMap, HashSet};

use hrockmate_core::arrays::schedule_from_arrays;
use hrockmate_core::chunking::gradient_chunks as gradient_chunks_core;
use hrockmate_core::graph::{Graph, TensorId};
use hrockmate_core::memory::{fragment_peak, FragmentResult, HeldTensor};
use hrockmate_core::schedule::Step;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::{run_native, Failure};
use crate::graph_api::graph_input;

/// A graph prepared once for many fragment measurements (thread-safe: methods take `&self`).
#[pyclass(frozen, module = "hrockmate._native")]
pub struct MemoryModel {
    graph: Graph,
    roots: Vec<TensorId>,
}

#[pymethods]
impl MemoryModel {
    #[new]
    #[pyo3(signature = (**graph))]
    fn new(py: Python<'_>, graph: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let input = graph_input(graph)?;
        let graph = run_native(py, None, |_| Ok(input.build()?))?;
        let roots = graph.storage_roots();
        Ok(MemoryModel { graph, roots })
    }

    /// Peak bytes over `steps` (a list of ("compute", op) / ("free", tensor)) of the storages
    /// rooted in `counted`, from `start` ({tensor: (instance id, bytes)} alive before;
    /// tensors with the same id share a storage); `dying` tensors go after their last read.
    /// Returns (peak, {tensor: (instance id, bytes)} alive at the end).
    #[pyo3(signature = (steps, counted, start, dying))]
    fn fragment_peak<'py>(
        &self,
        py: Python<'py>,
        steps: &Bound<'py, PyList>,
        counted: HashSet<TensorId>,
        start: HashMap<TensorId, (i64, u64)>,
        dying: HashSet<TensorId>,
    ) -> PyResult<(u64, Bound<'py, PyDict>)> {
        let r = self.measure(py, steps, counted, start, dying)?;
        let end = PyDict::new(py);
        for (t, id, bytes) in r.end {
            end.set_item(t, (id, bytes))?;
        }
        Ok((r.peak, end))
    }

    /// The same measurement step by step: (per step, the bytes while it runs; {instance id of
    /// `start`: the step after which its last holder went, -1 before the first} for the
    /// instances released inside the fragment).
    #[pyo3(signature = (steps, counted, start, dying))]
    fn fragment_profile<'py>(
        &self,
        py: Python<'py>,
        steps: &Bound<'py, PyList>,
        counted: HashSet<TensorId>,
        start: HashMap<TensorId, (i64, u64)>,
        dying: HashSet<TensorId>,
    ) -> PyResult<(Vec<u64>, HashMap<i64, i64>)> {
        let r = self.measure(py, steps, counted, start, dying)?;
        Ok((r.during, r.released.into_iter().collect()))
    }
}

impl MemoryModel {
    fn measure<'py>(
        &self,
        py: Python<'py>,
        steps: &Bound<'py, PyList>,
        counted: HashSet<TensorId>,
        start: HashMap<TensorId, (i64, u64)>,
        dying: HashSet<TensorId>,
    ) -> PyResult<FragmentResult> {
        let (nt, no) = (self.graph.tensors.len(), self.graph.ops.len());
        let mut parsed = Vec::with_capacity(steps.len());
        for item in steps.iter() {
            let pair = item.cast::<PyTuple>()?;
            let kind = pair.get_item(0)?;
            let id: usize = pair.get_item(1)?.extract()?;
            let kind = kind.cast::<PyString>()?;
            let step = match kind.to_str()? {
                "compute" if id < no => Step::Compute(id),
                "free" if id < nt => Step::Free(id),
                "compute" | "free" => {
                    return Err(PyValueError::new_err(format!(
                        "fragment step {item}: id out of range ({no} ops, {nt} tensors)"
                    )))
                }
                other => {
                    return Err(PyValueError::new_err(format!(
                        "fragment step kind '{other}': expected 'compute' or 'free'"
                    )))
                }
            };
            parsed.push(step);
        }
        if let Some(t) = start
            .keys()
            .chain(&dying)
            .chain(&counted)
            .find(|&&t| t >= nt)
        {
            return Err(PyValueError::new_err(format!(
                "fragment tensor id {t} out of range (the graph has {nt} tensors)"
            )));
        }
        let start: Vec<HeldTensor> = start.into_iter().map(|(t, (id, b))| (t, id, b)).collect();
        let dying: Vec<TensorId> = dying.into_iter().collect();
        Ok(py.detach(|| {
            fragment_peak(&self.graph, &self.roots, &parsed, &counted, &start, &dying)
        }))
    }
}

/// The runtime's backward chunking of a schedule (`hrockmate_core::chunking`): (cut positions
/// int64, peak with generator states, peak without them). `gradient_ids`: tensors handed to
/// autograd; `state_op`/`state_bytes`: replayed random ops and their generator state's bytes;
/// `current_state`: (first, last step position, bytes) of each chain of replays, which holds
/// the generator's current state.
#[pyfunction]
#[pyo3(signature = (step_kind, step_id, forward_len, gradient_ids, state_op, state_bytes,
                    current_state, **graph))]
#[allow(clippy::too_many_arguments)]
fn gradient_chunks<'py>(
    py: Python<'py>,
    step_kind: PyReadonlyArray1<'py, i8>,
    step_id: PyReadonlyArray1<'py, i64>,
    forward_len: i64,
    gradient_ids: Vec<usize>,
    state_op: Vec<usize>,
    state_bytes: Vec<u64>,
    current_state: Vec<(usize, usize, u64)>,
    graph: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Bound<'py, PyArray1<i64>>, u64, u64)> {
    let input = graph_input(graph)?;
    let kind: Vec<i8> = step_kind.as_array().iter().copied().collect();
    let id: Vec<i64> = step_id.as_array().iter().copied().collect();
    let r = run_native(py, None, |stop| {
        let g = input.build()?;
        let s = schedule_from_arrays(&kind, &id, forward_len)?;
        let mut gradient = vec![false; g.tensors.len()];
        for &t in &gradient_ids {
            *gradient.get_mut(t).ok_or_else(|| {
                Failure::InvalidArgument(format!(
                    "gradient tensor id {t} out of range (the graph has {} tensors)",
                    g.tensors.len()
                ))
            })? = true;
        }
        let mut per_op = vec![0u64; g.ops.len()];
        for (&j, &b) in state_op.iter().zip(&state_bytes) {
            *per_op.get_mut(j).ok_or_else(|| {
                Failure::InvalidArgument(format!(
                    "op id {j} out of range (the graph has {} ops)",
                    g.ops.len()
                ))
            })? = b;
        }
        if let Some(&(first, last, _)) = current_state.iter().find(|(f, l, _)| f > l) {
            return Err(Failure::InvalidArgument(format!(
                "current-state stretch ({first}, {last}) ends before it starts"
            )));
        }
        Ok(gradient_chunks_core(&g, &s, &gradient, &per_op, &current_state, stop)?)
    })?;
    let cuts: Vec<i64> = r.cuts.iter().map(|&c| c as i64).collect();
    Ok((cuts.into_pyarray(py), r.peak_bytes, r.held_peak_bytes))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MemoryModel>()?;
    m.add_function(wrap_pyfunction!(gradient_chunks, m)?)?;
    Ok(())
}
