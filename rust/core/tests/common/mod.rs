//! Test graphs for the integration tests: the repository's own node-link files
//! (tests/data/graphs, written by tests/data/make_graphs.py) always, plus optional third-party
//! graphs from HROCKMATE_GRAPHS_DIR (default: a `shared/data/graphs` folder beside the
//! repository) when that folder exists. Tests that need the third-party files say so and skip.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use hrockmate_core::graph::Graph;
use hrockmate_core::io::parse_graph_json;

/// The repository's test graphs.
pub fn repo_graphs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/graphs")
}

/// The optional third-party graphs folder, or None (with a note on stderr) when it is absent.
pub fn third_party_graphs_dir() -> Option<PathBuf> {
    let dir = match std::env::var("HROCKMATE_GRAPHS_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/graphs"),
    };
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "skipping the third-party graphs: not found at {} (optional: set HROCKMATE_GRAPHS_DIR)",
            dir.display()
        );
        None
    }
}

/// The `.json` files of a folder, sorted by name.
pub fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("graphs folder {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

/// The repository's graphs, then the third-party ones when present.
pub fn corpus_files() -> Vec<PathBuf> {
    let mut files = json_files(&repo_graphs_dir());
    assert!(files.len() >= 9, "expected the repository's test graphs, found {files:?}");
    if let Some(dir) = third_party_graphs_dir() {
        files.extend(json_files(&dir));
    }
    files
}

pub fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

pub fn load(path: &Path) -> Graph {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_graph_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One of the repository's graphs by file name.
pub fn load_repo(name: &str) -> Graph {
    load(&repo_graphs_dir().join(name))
}
