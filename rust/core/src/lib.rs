//! hrockmate-core: the pure-Rust half of hrockmate (no Python inside).

pub mod arrays;
pub mod graph;
pub mod io;
pub mod literature;
pub mod schedule;
pub mod schedules;
pub mod simulate;
pub mod testgen;
