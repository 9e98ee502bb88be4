//! Benchmarks of the literature solvers: TW-Remat (recursion tree + schedules at every depth)
//! and Rotor (chain detection, dynamic program, IR schedule) on synthetic and third-party graphs.
//! Sample counts and measurement times are small so that the whole run stays around a minute.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use hrockmate_core::graph::Graph;
use hrockmate_core::io::parse_graph_json;
use hrockmate_core::literature::chain::rotor;
use hrockmate_core::literature::rotor::{min_memory, solve, Chain, Stage, StateOption};
use hrockmate_core::literature::twremat::{twremat_points, TwRemat};
use hrockmate_core::partition::synthetic;
use hrockmate_core::schedules::store_all;
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, GenParams};

fn third_party(name: &str) -> Option<Graph> {
    let dir = match std::env::var("HROCKMATE_GRAPHS_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/graphs"),
    };
    let text = std::fs::read_to_string(dir.join(name)).ok()?;
    parse_graph_json(&text).ok()
}

fn bench_twremat(c: &mut Criterion) {
    let mut group = c.benchmark_group("twremat");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    let mut graphs: Vec<(String, Graph)> = vec![
        ("chain_1000".into(), synthetic::chain(1000, 1)),
        (
            "random_2000".into(),
            random_training_graph(7, &GenParams { n_forward: 2000, window: 12, ..GenParams::default() }),
        ),
    ];
    if let Some(g) = third_party("resnet50_train.json") {
        graphs.push(("resnet50".into(), g));
    }
    for (name, g) in &graphs {
        group.bench_with_input(BenchmarkId::new("build", name), g, |b, g| b.iter(|| TwRemat::new(g)));
        let tw = TwRemat::new(g);
        let full = tw.height();
        group.bench_with_input(BenchmarkId::new("schedule_full_depth", name), g, |b, g| {
            b.iter(|| tw.schedule(g, full).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("all_points", name), g, |b, g| b.iter(|| twremat_points(g, None).unwrap()));
    }
    group.finish();
}

fn homogeneous(n: usize) -> Chain {
    let stage = Stage {
        fwd_time: 1.0,
        out_bytes: 100,
        grad_bytes: 100,
        fwd_overhead: 20,
        options: vec![StateOption { fwd_time: 1.2, state_bytes: 250, fwd_overhead: 20, bwd_time: 2.0, bwd_overhead: 50 }],
    };
    Chain { input_bytes: 100, final_grad_bytes: 100, stages: vec![stage; n] }
}

fn bench_rotor(c: &mut Criterion) {
    let mut group = c.benchmark_group("rotor");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    for (n, slots) in [(20usize, 500usize), (50, 500), (100, 200)] {
        let chain = homogeneous(n);
        let limit = min_memory(&chain).unwrap() * 2;
        group.bench_function(BenchmarkId::new("dp", format!("{n}_stages_{slots}_slots")), |b| {
            b.iter(|| solve(&chain, limit, slots).unwrap())
        });
    }
    for name in ["vgg16_train.json", "resnet50_train.json"] {
        let Some(g) = third_party(name) else { continue };
        let store = simulate(&g, &store_all(&g)).unwrap().peak_bytes;
        let budget = store - store / 10;
        group.bench_function(BenchmarkId::new("graph", name), |b| b.iter(|| rotor(&g, budget, 200).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, bench_twremat, bench_rotor);
criterion_main!(benches);
