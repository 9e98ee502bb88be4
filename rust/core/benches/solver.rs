//! Benchmarks of simplification, partitioning (both partitioners) and leaf option enumeration
//! on synthetic chains, U-Nets and random DAGs (about 1k, 10k and 100k ops in all, forward plus
//! backward) and on the third-party graphs beside the repository (HROCKMATE_GRAPHS_DIR to move
//! them). Besides criterion's own report, writes a JSON summary (median seconds of a few
//! single-threaded runs, plus hierarchy statistics) to bench-results/solver.json at the
//! workspace root.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion};
use hrockmate_core::graph::Graph;
use hrockmate_core::options::{enumerate_all, OptionsConfig};
use hrockmate_core::partition::{build_hierarchy, partitioner_by_name, synthetic, PartitionConfig};
use hrockmate_core::simplify::{simplify, SimplifyConfig};
use serde_json::json;

const PARTITIONERS: [&str; 2] = ["bottom_up", "topo_interval"];
/// Graphs above this size are not enumerated by criterion (see `bench`).
const ENUMERATE_MAX_OPS: usize = 2_000;
/// Graphs above this size are not enumerated in the summary either.
const SUMMARY_ENUMERATE_MAX_OPS: usize = 20_000;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Synthetic graphs: (name, graph). `n` forward ops give about 2n ops in all.
fn synthetic_graphs() -> Vec<(String, Graph)> {
    let mut out = Vec::new();
    for total in [1_000usize, 10_000, 100_000] {
        let n = total / 2;
        out.push((format!("chain_{total}"), synthetic::chain(n, 1)));
        out.push((format!("unet_{total}"), synthetic::unet(n, 2)));
        out.push((format!("random_{total}"), synthetic::random_dag(n, 16, 3)));
    }
    out
}

fn real_graphs() -> Vec<(String, Graph)> {
    let dir = std::env::var("HROCKMATE_GRAPHS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("../shared/data/graphs"));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("note: no third-party graphs at {} (set HROCKMATE_GRAPHS_DIR)", dir.display());
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "json")).collect();
    files.sort();
    files
        .into_iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(&p).ok()?;
            let g = hrockmate_core::io::parse_graph_json(&text).ok()?;
            Some((p.file_stem()?.to_string_lossy().into_owned(), g))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let graphs: Vec<(String, Graph)> = synthetic_graphs().into_iter().chain(real_graphs()).collect();
    let pcfg = PartitionConfig::default();
    let ocfg = OptionsConfig::default();
    let mut group = c.benchmark_group("simplify");
    group.sample_size(10).measurement_time(Duration::from_secs(1)).warm_up_time(Duration::from_millis(200));
    for (name, g) in &graphs {
        group.bench_with_input(BenchmarkId::from_parameter(name), g, |b, g| b.iter(|| simplify(g, &SimplifyConfig::default())));
    }
    group.finish();
    for p in PARTITIONERS {
        let part = partitioner_by_name(p).unwrap();
        let mut group = c.benchmark_group(format!("partition_{p}"));
        group.sample_size(10).measurement_time(Duration::from_secs(1)).warm_up_time(Duration::from_millis(200));
        for (name, g) in &graphs {
            group.bench_with_input(BenchmarkId::from_parameter(name), g, |b, g| b.iter(|| build_hierarchy(g, part.as_ref(), &pcfg).unwrap()));
        }
        group.finish();
    }
    let mut group = c.benchmark_group("enumerate");
    group.sample_size(10).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(200));
    // enumeration grows with the number of distinct leaves; the large synthetic graphs
    // (all leaves distinct) are timed once, in the summary
    for (name, g) in graphs.iter().filter(|(_, g)| g.ops.len() <= ENUMERATE_MAX_OPS) {
        let h = build_hierarchy(g, partitioner_by_name("bottom_up").unwrap().as_ref(), &pcfg).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(name), &(g, h), |b, (g, h)| {
            b.iter(|| enumerate_all(g, h, &ocfg, &AtomicBool::new(false)).unwrap())
        });
    }
    group.finish();
}

/// Median wall time of `runs` calls.
fn median_secs(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// One-thread timings and hierarchy statistics of every graph, as JSON.
fn summary() -> serde_json::Value {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let pcfg = PartitionConfig::default();
    let ocfg = OptionsConfig::default();
    let mut rows = Vec::new();
    for (name, g) in synthetic_graphs().into_iter().chain(real_graphs()) {
        // one run for the largest graphs keeps `cargo bench` within a few minutes
        let runs = if g.ops.len() > SUMMARY_ENUMERATE_MAX_OPS { 1 } else { 3 };
        let simplify_s = median_secs(runs, || {
            simplify(&g, &SimplifyConfig::default());
        });
        let simplified = simplify(&g, &SimplifyConfig::default());
        let mut parts = serde_json::Map::new();
        for p in PARTITIONERS {
            let part = partitioner_by_name(p).unwrap();
            let partition_s = median_secs(runs, || {
                build_hierarchy(&g, part.as_ref(), &pcfg).unwrap();
            });
            let h = build_hierarchy(&g, part.as_ref(), &pcfg).unwrap();
            let enumerated = (g.ops.len() <= SUMMARY_ENUMERATE_MAX_OPS).then(|| {
                pool.install(|| {
                    let s = Instant::now();
                    let all = enumerate_all(&g, &h, &ocfg, &AtomicBool::new(false)).unwrap();
                    (s.elapsed().as_secs_f64(), all)
                })
            });
            let leaves: Vec<_> = h.leaves().collect();
            let distinct = leaves.iter().filter(|c| c.representative == c.id).count();
            let interface: u64 = leaves
                .iter()
                .flat_map(|c| c.outputs.iter())
                .map(|&t| g.tensors[t].bytes)
                .sum();
            parts.insert(
                p.to_string(),
                json!({
                    "partition_s": partition_s,
                    "enumerate_s_one_thread": enumerated.as_ref().map(|e| e.0),
                    "clusters": h.clusters.len(),
                    "leaves": leaves.len(),
                    "distinct_leaves": distinct,
                    "depth": h.depth(),
                    "root_children": h.clusters[h.root].children.len(),
                    "root_own_backward_ops": h.clusters[h.root].own_bwd_ops.len(),
                    "leaf_output_bytes": interface,
                    "options": enumerated.as_ref().map(|(_, all)| all.options.iter().map(|o| o.len()).sum::<usize>()),
                    "inexact_leaves": enumerated.as_ref().map(|(_, all)| leaves.iter().filter(|c| !all.exact[c.id]).count()),
                }),
            );
        }
        println!("summary: {name}: {} ops, simplify {simplify_s:.4}s, {}", g.ops.len(), serde_json::Value::Object(parts.clone()));
        rows.push(json!({
            "graph": name,
            "ops": g.ops.len(),
            "tensors": g.tensors.len(),
            "simplify_s": simplify_s,
            "simplified_ops": simplified.graph.ops.len(),
            "partitioners": parts,
        }));
    }
    json!({
        "unit": "seconds (median of 3 runs, 1 run above 20k ops; enumeration: one run on one thread, null above 20k ops)",
        "host_load_average": std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| l.split_whitespace().next().map(String::from)),
        "results": rows
    })
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let out = workspace_root().join("bench-results");
    std::fs::create_dir_all(&out).expect("create bench-results");
    let path = out.join("solver.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary()).unwrap()).expect("write bench summary");
    println!("wrote {}", path.display());
}
