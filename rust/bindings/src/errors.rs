//! How native work runs and fails, in one place.
//!
//! [`run_native`] runs work on a worker thread, detached from the interpreter, while the calling
//! thread polls for signals: Ctrl-C sets the cancellation flag of the work's [`Stop`] (the core
//! polls it every few thousand iterations) and KeyboardInterrupt is raised once the work has
//! stopped. Every core error becomes a [`Failure`], and each kind of failure its own Python
//! exception class ([`Failure::into_pyerr`]), subclassing the builtin that fits it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use hrockmate_core::checkpointing::CheckpointError;
use hrockmate_core::io::GraphError;
use hrockmate_core::limits::{Stop, Stopped, TooLarge};
use hrockmate_core::literature::LiteratureError;
use hrockmate_core::options::OptionsError;
use hrockmate_core::partition::PartitionError;
use hrockmate_core::simulate::{ScheduleError, SimulateError};
use pyo3::create_exception;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    hrockmate._native,
    InvalidGraphError,
    PyValueError,
    "A graph breaks a rule of the IR (docs/graph-ir.md); the message names the op, tensor or field."
);
create_exception!(
    hrockmate._native,
    InvalidScheduleError,
    PyValueError,
    "A schedule breaks a rule. `step` is the first bad step (None for a malformed schedule array); the message starts with 'step N:' when there is one."
);
create_exception!(
    hrockmate._native,
    InvalidArgumentError,
    PyValueError,
    "A parameter of a native call is out of range; the message names it."
);
create_exception!(
    hrockmate._native,
    NotAChainError,
    PyValueError,
    "The graph has no chain structure Rotor can use; the message names the op or tensor at fault."
);
create_exception!(
    hrockmate._native,
    InfeasibleError,
    PyValueError,
    "No schedule fits the memory limit. `limit_bytes` is the limit asked for, `min_bytes` the smallest that fits."
);
create_exception!(
    hrockmate._native,
    TooLargeError,
    PyMemoryError,
    "The work would need more memory than its bound allows; the message names the sizes and what to do."
);
create_exception!(
    hrockmate._native,
    TimeLimitError,
    PyTimeoutError,
    "The time limit given to a native call ran out before the work finished."
);
create_exception!(
    hrockmate._native,
    InternalError,
    PyRuntimeError,
    "A bug in the hrockmate core (a produced schedule failed its check, or a panic); please report the graph."
);

/// Why native work returned no result (Send, so that it can leave the worker thread).
#[derive(Debug)]
pub(crate) enum Failure {
    InvalidGraph(String),
    InvalidSchedule { step: Option<usize>, message: String },
    InvalidArgument(String),
    NotAChain(String),
    Infeasible { message: String, limit_bytes: u64, min_bytes: u64 },
    TooLarge(String),
    TimeLimit(String),
    /// Cancelled by Ctrl-C: the pending KeyboardInterrupt is raised instead.
    Cancelled,
    Internal(String),
}

impl Failure {
    pub(crate) fn into_pyerr(self, py: Python<'_>) -> PyErr {
        let with = |err: PyErr, attrs: &[(&str, Option<u64>)]| {
            for (name, value) in attrs {
                if let Err(e) = err.value(py).setattr(*name, *value) {
                    return e;
                }
            }
            err
        };
        match self {
            Failure::InvalidGraph(m) => InvalidGraphError::new_err(m),
            Failure::InvalidSchedule { step, message } => {
                with(InvalidScheduleError::new_err(message), &[("step", step.map(|s| s as u64))])
            }
            Failure::InvalidArgument(m) => InvalidArgumentError::new_err(m),
            Failure::NotAChain(m) => NotAChainError::new_err(m),
            Failure::Infeasible { message, limit_bytes, min_bytes } => with(
                InfeasibleError::new_err(message),
                &[("limit_bytes", Some(limit_bytes)), ("min_bytes", Some(min_bytes))],
            ),
            Failure::TooLarge(m) => TooLargeError::new_err(m),
            Failure::TimeLimit(m) => TimeLimitError::new_err(m),
            // Reached only when cancellation came from elsewhere than a signal.
            Failure::Cancelled => pyo3::exceptions::PyKeyboardInterrupt::new_err("interrupted"),
            Failure::Internal(m) => InternalError::new_err(m),
        }
    }
}

impl From<GraphError> for Failure {
    fn from(e: GraphError) -> Self {
        Failure::InvalidGraph(e.to_string())
    }
}

impl From<ScheduleError> for Failure {
    fn from(e: ScheduleError) -> Self {
        Failure::InvalidSchedule { step: Some(e.step), message: e.to_string() }
    }
}

impl From<SimulateError> for Failure {
    fn from(e: SimulateError) -> Self {
        match e {
            SimulateError::Schedule(e) => e.into(),
            SimulateError::Stopped(e) => e.into(),
        }
    }
}

impl From<Stopped> for Failure {
    fn from(e: Stopped) -> Self {
        match e {
            Stopped::TimeLimit { .. } => Failure::TimeLimit(e.to_string()),
            Stopped::Cancelled => Failure::Cancelled,
        }
    }
}

impl From<TooLarge> for Failure {
    fn from(e: TooLarge) -> Self {
        Failure::TooLarge(e.0)
    }
}

impl From<LiteratureError> for Failure {
    fn from(e: LiteratureError) -> Self {
        let message = e.to_string();
        match e {
            LiteratureError::NotAChain(_) => Failure::NotAChain(message),
            LiteratureError::Infeasible { limit_bytes, min_bytes, .. } => {
                Failure::Infeasible { message, limit_bytes, min_bytes }
            }
            LiteratureError::InvalidArgument(_) | LiteratureError::StepLimit { .. } => {
                Failure::InvalidArgument(message)
            }
            LiteratureError::TooLarge(e) => e.into(),
            LiteratureError::Stopped(e) => e.into(),
            LiteratureError::Internal(_) => Failure::Internal(message),
        }
    }
}

impl From<CheckpointError> for Failure {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Internal(m) => Failure::Internal(m),
            CheckpointError::Stopped(s) => s.into(),
        }
    }
}

impl From<PartitionError> for Failure {
    fn from(e: PartitionError) -> Self {
        match e {
            PartitionError::Cancelled => Failure::Cancelled,
            other => Failure::InvalidArgument(other.to_string()),
        }
    }
}

impl From<OptionsError> for Failure {
    fn from(e: OptionsError) -> Self {
        match e {
            OptionsError::Cancelled => Failure::Cancelled,
            OptionsError::Invalid { .. } => Failure::Internal(e.to_string()),
            other => Failure::InvalidArgument(other.to_string()),
        }
    }
}

/// How often the calling thread looks for signals while native work runs.
const SIGNAL_POLL: Duration = Duration::from_millis(20);

/// Stack of the worker thread: room for the recursive parts of the core on deep graphs.
const WORKER_STACK_BYTES: usize = 64 << 20;

/// Run `work` on a worker thread with a [`Stop`] that says when to stop: at `time_limit`
/// seconds (`None`: never), or when Ctrl-C arrives, in which case KeyboardInterrupt is raised
/// as soon as the work has stopped. Failures become their Python exceptions, a panic
/// InternalError.
pub(crate) fn run_native<T: Send>(
    py: Python<'_>,
    time_limit: Option<f64>,
    work: impl FnOnce(&Stop) -> Result<T, Failure> + Send,
) -> PyResult<T> {
    let cancel = AtomicBool::new(false);
    let stop = Stop::new(Some(&cancel), time_limit).map_err(InvalidArgumentError::new_err)?;
    let (outcome, interrupted) = py.detach(|| {
        std::thread::scope(|scope| {
            let (done, finished) = mpsc::channel::<()>();
            let handle = std::thread::Builder::new()
                .name("hrockmate-native".into())
                .stack_size(WORKER_STACK_BYTES)
                .spawn_scoped(scope, move || {
                    let out = work(&stop);
                    let _ = done.send(());
                    out
                })
                .expect("the native worker thread starts");
            let mut interrupted: Option<PyErr> = None;
            // Until the work finishes, or panics (the sender is then dropped).
            while let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(SIGNAL_POLL) {
                if interrupted.is_none() {
                    if let Err(e) = Python::attach(|py| py.check_signals()) {
                        cancel.store(true, Ordering::Relaxed);
                        interrupted = Some(e);
                    }
                }
            }
            (handle.join(), interrupted)
        })
    });
    if let Some(e) = interrupted {
        return Err(e);
    }
    match outcome {
        Ok(result) => result.map_err(|f| f.into_pyerr(py)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(InternalError::new_err(format!("internal error in the hrockmate core: {msg}")))
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("InvalidGraphError", py.get_type::<InvalidGraphError>())?;
    m.add("InvalidScheduleError", py.get_type::<InvalidScheduleError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("NotAChainError", py.get_type::<NotAChainError>())?;
    m.add("InfeasibleError", py.get_type::<InfeasibleError>())?;
    m.add("TooLargeError", py.get_type::<TooLargeError>())?;
    m.add("TimeLimitError", py.get_type::<TimeLimitError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
