//! Python bindings: `hrockmate._native`.
//!
//! Graphs and schedules cross as numpy arrays (docs/graph-ir.md, "Flat array form"); heavy work
//! runs detached from the interpreter. Each submodule registers its own functions.
use pyo3::prelude::*;

mod errors;
mod graph_api;
mod literature_api;
mod memory_api;
mod solver_api;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    graph_api::register(m)?;
    literature_api::register(m)?;
    memory_api::register(m)?;
    solver_api::register(m)?;
    Ok(())
}
