//! Synthetic training graphs (forward DAG + its mirrored backward) for tests and benchmarks:
//! chains, U-Nets and random DAGs of any size, deterministic for a given seed.
//!
//! Every forward op produces one activation; a backward op per forward op differentiates it,
//! reads the gradients its consumers send back plus the forward tensors it needs, and produces
//! the gradients of its inputs (and of its parameter). All sinks feed a final loss op whose
//! output is the graph's `output`; its gradient comes in as a `tangent`.

use crate::graph::{Graph, Op, Phase, Role, Tensor};

pub use crate::testgen::Rng;

/// Build a training graph from forward predecessor lists (`preds[i]` < i; empty = reads the
/// input). `sizes[i]` are activation bytes, `times[i]` forward times; backward times are twice
/// the forward ones. Every third op has a parameter.
pub fn training_graph(name: &str, preds: &[Vec<usize>], sizes: &[u64], times: &[f64]) -> Graph {
    let n = preds.len();
    let mut g = Graph { name: name.to_string(), time_unit: "units".into(), ..Default::default() };
    let add_t = |g: &mut Graph, name: String, bytes: u64, role: Role| {
        g.tensors.push(Tensor {
            name,
            bytes,
            role,
            alias_of: None,
            grad_of: None,
            updates: None,
            shape: None,
            dtype: None,
        });
        g.tensors.len() - 1
    };
    let add_op = |g: &mut Graph, name: String, phase: Phase, time: f64, inputs: Vec<usize>, outputs: Vec<usize>, diff: Option<usize>| {
        g.ops.push(Op {
            name,
            target: if phase == Phase::Forward { "fwd".into() } else { "bwd".into() },
            phase,
            time,
            workspace: 0,
            inputs,
            outputs,
            differentiates: diff,
            random: false,
            mutates_buffer: false,
            module: String::new(),
        });
        g.ops.len() - 1
    };
    let x = add_t(&mut g, "x".into(), sizes.first().copied().unwrap_or(1), Role::Input);
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n + 1]; // n = the loss op
    let mut act = Vec::with_capacity(n);
    let mut param = vec![None; n];
    for i in 0..n {
        let mut inputs: Vec<usize> = if preds[i].is_empty() { vec![x] } else { preds[i].iter().map(|&p| act[p]).collect() };
        for &p in &preds[i] {
            consumers[p].push(i);
        }
        if i % 3 == 0 {
            let w = add_t(&mut g, format!("w{i}"), 64, Role::Parameter);
            param[i] = Some(w);
            inputs.push(w);
        }
        let a = add_t(&mut g, format!("a{i}"), sizes[i], Role::Activation);
        act.push(a);
        add_op(&mut g, format!("f{i}"), Phase::Forward, times[i], inputs, vec![a], None);
    }
    let sinks: Vec<usize> = (0..n).filter(|&i| consumers[i].is_empty()).collect();
    let loss = add_t(&mut g, "loss".into(), 8, Role::Output);
    for &s in &sinks {
        consumers[s].push(n);
    }
    let loss_op = add_op(&mut g, "loss".into(), Phase::Forward, 1.0, sinks.iter().map(|&s| act[s]).collect(), vec![loss], None);
    let dloss = add_t(&mut g, "dloss".into(), 8, Role::Tangent);
    // grad[(producer, consumer)] = tensor id of d(act[producer]) sent by consumer's backward
    let mut grad: std::collections::HashMap<(usize, usize), usize> = std::collections::HashMap::new();
    // loss backward: sends a gradient to every sink
    let mut outs = Vec::new();
    for &s in &sinks {
        let t = add_t(&mut g, format!("g{s}_loss"), sizes[s], Role::Activation);
        grad.insert((s, n), t);
        outs.push(t);
    }
    add_op(&mut g, "loss_bwd".into(), Phase::Backward, 1.0, vec![dloss], outs, Some(loss_op));
    for i in (0..n).rev() {
        let mut inputs: Vec<usize> = consumers[i].iter().map(|&c| grad[&(i, c)]).collect();
        // the backward reads the forward inputs (saved activations) and, every other op, its output
        inputs.extend(preds[i].iter().map(|&p| act[p]));
        if i % 2 == 1 {
            inputs.push(act[i]);
        }
        let mut outputs = Vec::new();
        for &p in &preds[i] {
            let t = add_t(&mut g, format!("g{p}_{i}"), sizes[p], Role::Activation);
            grad.insert((p, i), t);
            outputs.push(t);
        }
        if let Some(w) = param[i] {
            let t = add_t(&mut g, format!("dw{i}"), 64, Role::ParamGrad);
            g.tensors[t].grad_of = Some(w);
            outputs.push(t);
        }
        if outputs.is_empty() {
            let t = add_t(&mut g, format!("dx{i}"), sizes[i], Role::InputGrad);
            outputs.push(t);
        }
        add_op(&mut g, format!("b{i}"), Phase::Backward, 2.0 * times[i], inputs, outputs, Some(i));
    }
    g
}

fn sizes_times(n: usize, rng: &mut Rng) -> (Vec<u64>, Vec<f64>) {
    let sizes = (0..n).map(|_| rng.range(1, 64) * 1024).collect();
    let times = (0..n).map(|_| rng.range(1, 100) as f64).collect();
    (sizes, times)
}

/// A chain of `n` forward ops (about 2n ops in all).
pub fn chain(n: usize, seed: u64) -> Graph {
    let mut rng = Rng::new(seed);
    let preds: Vec<Vec<usize>> = (0..n).map(|i| if i == 0 { vec![] } else { vec![i - 1] }).collect();
    let (s, t) = sizes_times(n, &mut rng);
    training_graph(&format!("chain{n}"), &preds, &s, &t)
}

/// A U-Net of about `n` forward ops: an encoder chain and a decoder chain with skip connections
/// from each encoder stage to the matching decoder stage (stages of 3 ops).
pub fn unet(n: usize, seed: u64) -> Graph {
    let mut rng = Rng::new(seed);
    let half = (n / 2).max(1);
    let mut preds: Vec<Vec<usize>> = Vec::with_capacity(2 * half);
    for i in 0..half {
        preds.push(if i == 0 { vec![] } else { vec![i - 1] });
    }
    for j in 0..half {
        let i = half + j;
        let mut p = vec![i - 1];
        // decoder op j mirrors encoder op half - 1 - j; a skip at every stage boundary
        let mirror = half - 1 - j;
        if j % 3 == 0 && mirror + 1 < half {
            p.push(mirror);
        }
        preds.push(p);
    }
    let (s, t) = sizes_times(preds.len(), &mut rng);
    training_graph(&format!("unet{n}"), &preds, &s, &t)
}

/// A random DAG of `n` forward ops: each op reads 1 to 3 earlier ops among the last `window`.
pub fn random_dag(n: usize, window: usize, seed: u64) -> Graph {
    let mut rng = Rng::new(seed);
    let mut preds: Vec<Vec<usize>> = Vec::with_capacity(n);
    for i in 0..n {
        if i == 0 {
            preds.push(vec![]);
            continue;
        }
        let k = rng.range(1, 4) as usize;
        let lo = i.saturating_sub(window.max(1));
        let mut p: Vec<usize> = (0..k).map(|_| rng.range(lo as u64, i as u64) as usize).collect();
        if rng.chance(0.7) {
            p.push(i - 1); // mostly sequential, like real networks
        }
        p.sort_unstable();
        p.dedup();
        preds.push(p);
    }
    let (s, t) = sizes_times(n, &mut rng);
    training_graph(&format!("random{n}"), &preds, &s, &t)
}
