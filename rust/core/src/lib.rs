//! hrockmate-core: the pure-Rust half of hrockmate (no Python inside).
//!
//! Pipeline stages owned here: graph IR and its JSON forms (`graph`, `io`), the schedule
//! simulator (`simulate`) and the storage rules it shares with the planner (`memory`), reference schedules (`schedules`; per-block checkpointing in `checkpointing`, greedy eviction in `greedy`), graph simplification
//! (`simplify`), hierarchical partitioning (`partition`) and leaf option enumeration (`options`).
//! `limits` holds the bounds on all of it: byte sizes, schedule lengths, time and cancellation.

pub mod arrays;
pub mod checkpointing;
pub mod chunking;
pub mod graph;
pub mod greedy;
pub mod io;
pub mod limits;
pub mod memory;
pub mod options;
pub mod literature;
pub mod partition;
pub mod schedule;
pub mod schedules;
pub mod simplify;
pub mod simulate;
pub mod testgen;
