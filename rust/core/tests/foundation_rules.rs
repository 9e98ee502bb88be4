//! Parser errors, validation rules, simulator rules and hand-computed peaks on small graphs.

use hrockmate_core::arrays::{graph_from_arrays, graph_to_arrays};
use hrockmate_core::graph::Graph;
use hrockmate_core::io::{
    graph_to_json, parse_graph_json, parse_schedule_json, schedule_to_json, GraphError,
};
use hrockmate_core::schedule::{Schedule, Step};
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::{simulate, ScheduleError};
use serde_json::{json, Value};

use Step::{Compute as C, Free as F};

fn tensor(name: &str, bytes: u64, role: &str) -> Value {
    json!({"name": name, "bytes": bytes, "role": role})
}

fn view(name: &str, of: usize) -> Value {
    json!({"name": name, "bytes": 0, "role": "activation", "alias_of": of})
}

fn op(name: &str, phase: &str, inputs: &[usize], outputs: &[usize]) -> Value {
    json!({"name": name, "phase": phase, "time": 1.0, "inputs": inputs, "outputs": outputs})
}

fn doc(tensors: Vec<Value>, ops: Vec<Value>) -> Value {
    json!({"format": "hrockmate-graph", "version": 1, "name": "t", "tensors": tensors, "ops": ops})
}

fn parse(v: &Value) -> Result<Graph, GraphError> {
    parse_graph_json(&v.to_string())
}

/// The hand-computed example (ids in comments):
///   x(0) input 100, w(1) parameter 50
///   f0(0): [x, w] -> a(2) 1000, workspace 300
///   f1(1): [a] -> v(3) view of a
///   f2(2): [v] -> b(4) 200, c(5) 30
///   loss(3): [b] -> L(6) output 4
///   loss_b(4): [tL(7) tangent, b] -> db(8) 200
///   f2_b(5): [db, v] -> da(9) 1000
///   f0_b(6): [da, x, w] -> dw(10) param_grad 50, dx(11) input_grad 100
fn example() -> Value {
    let mut d = doc(
        vec![
            tensor("x", 100, "input"),
            tensor("w", 50, "parameter"),
            tensor("a", 1000, "activation"),
            view("v", 2),
            tensor("b", 200, "activation"),
            tensor("c", 30, "activation"),
            tensor("L", 4, "output"),
            tensor("tL", 4, "tangent"),
            tensor("db", 200, "activation"),
            tensor("da", 1000, "activation"),
            json!({"name": "dw", "bytes": 50, "role": "param_grad", "grad_of": 1}),
            json!({"name": "dx", "bytes": 100, "role": "input_grad", "grad_of": 0}),
        ],
        vec![
            op("f0", "forward", &[0, 1], &[2]),
            op("f1", "forward", &[2], &[3]),
            op("f2", "forward", &[3], &[4, 5]),
            op("loss", "forward", &[4], &[6]),
            op("loss_b", "backward", &[7, 4], &[8]),
            op("f2_b", "backward", &[8, 3], &[9]),
            op("f0_b", "backward", &[9, 0, 1], &[10, 11]),
        ],
    );
    d["ops"][0]["workspace"] = json!(300);
    d["ops"][4]["differentiates"] = json!(3);
    d["ops"][5]["differentiates"] = json!(2);
    d["ops"][6]["differentiates"] = json!(0);
    d
}

fn example_graph() -> Graph {
    parse(&example()).unwrap()
}

// ---- parser -----------------------------------------------------------------------------------

fn err_text(v: &Value) -> String {
    parse(v).expect_err("must be rejected").to_string()
}

#[test]
fn invalid_json_reports_line_and_column() {
    let e = parse_graph_json("{\n  \"format\": ,\n}").unwrap_err();
    match e {
        GraphError::Json { line, column, .. } => assert_eq!((line, column), (2, 13)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn wrong_types_and_unknown_fields_name_the_item_and_field() {
    let mut d = example();
    d["tensors"][2]["bytes"] = json!("big");
    let m = err_text(&d);
    assert!(
        m.contains("tensor 2 'a'") && m.contains("'bytes'") && m.contains("\"big\""),
        "{m}"
    );

    let mut d = example();
    d["tensors"][4]["bytes"] = json!(-5);
    assert!(err_text(&d).contains("tensor 4 'b': field 'bytes'"));

    let mut d = example();
    d["ops"][1]["colour"] = json!("red");
    let m = err_text(&d);
    assert!(
        m.contains("op 1 'f1'") && m.contains("'colour'") && m.contains("unknown field"),
        "{m}"
    );

    let mut d = example();
    d["tensors"][0]["size"] = json!(1);
    assert!(err_text(&d).contains("tensor 0 'x': field 'size': unknown field"));

    let mut d = example();
    d["extra"] = json!(1);
    assert!(err_text(&d).contains("graph: field 'extra': unknown field"));

    let mut d = example();
    d["ops"][2].as_object_mut().unwrap().remove("phase");
    assert!(err_text(&d).contains("op 2 'f2': field 'phase': missing"));

    let mut d = example();
    d["ops"][2]["phase"] = json!("sideways");
    assert!(err_text(&d).contains("op 2 'f2': field 'phase'"));

    let mut d = example();
    d["tensors"][5]["role"] = json!("weights");
    let m = err_text(&d);
    assert!(
        m.contains("tensor 5 'c': field 'role'") && m.contains("param_grad"),
        "{m}"
    );

    let mut d = example();
    d["ops"][0]["inputs"] = json!([0, "w"]);
    assert!(err_text(&d).contains("op 0 'f0': field 'inputs': item 1"));

    let mut d = example();
    d["ops"][0]["time"] = json!(-1.0);
    assert!(err_text(&d).contains("op 0 'f0': field 'time'"));

    let mut d = example();
    d["tensors"][1]["name"] = json!("");
    assert!(err_text(&d).contains("tensor 1: field 'name': must not be empty"));
}

#[test]
fn format_and_version_are_checked() {
    let mut d = example();
    d["format"] = json!("other");
    assert!(err_text(&d).contains("field 'format'"));
    let mut d = example();
    d["version"] = json!(2);
    assert!(err_text(&d).contains("unsupported version 2"));
    let m = parse_graph_json("{\"tensors\": []}")
        .unwrap_err()
        .to_string();
    assert!(m.contains("'format'") && m.contains("node-link"), "{m}");
    let m = parse_graph_json("[1, 2]").unwrap_err().to_string();
    assert!(m.contains("expected an object, got a list"), "{m}");
}

#[test]
fn integral_floats_are_accepted_for_integers() {
    let mut d = example();
    d["tensors"][2]["bytes"] = json!(1000.0);
    assert_eq!(parse(&d).unwrap().tensors[2].bytes, 1000);
}

// ---- validation -------------------------------------------------------------------------------

#[test]
fn ids_out_of_range_are_named() {
    let mut d = example();
    d["ops"][1]["inputs"] = json!([42]);
    let m = err_text(&d);
    assert!(
        m.contains("op 1 'f1': field 'inputs': tensor id 42 out of range"),
        "{m}"
    );
    let mut d = example();
    d["tensors"][3]["alias_of"] = json!(99);
    assert!(err_text(&d).contains("tensor 3 'v': field 'alias_of': tensor id 99 out of range"));
    let mut d = example();
    d["ops"][4]["differentiates"] = json!(70);
    assert!(err_text(&d).contains("op 4 'loss_b': field 'differentiates': op id 70 out of range"));
}

#[test]
fn producers_are_checked() {
    let mut d = example();
    d["ops"][2]["outputs"] = json!([4]); // c is produced by nobody
    let m = err_text(&d);
    assert!(
        m.contains("tensor 5 'c'") && m.contains("no op produces it"),
        "{m}"
    );

    let mut d = example();
    d["ops"][3]["outputs"] = json!([6, 5]); // c produced twice
    let m = err_text(&d);
    assert!(
        m.contains("tensor 5 'c'") && m.contains("op 2 'f2'") && m.contains("op 3 'loss'"),
        "{m}"
    );

    let mut d = example();
    d["ops"][2]["outputs"] = json!([4, 5, 5]);
    assert!(err_text(&d).contains("listed twice in the outputs of op 2 'f2'"));

    let mut d = example();
    d["ops"][0]["outputs"] = json!([2, 1]); // produces the parameter
    let m = err_text(&d);
    assert!(
        m.contains("op 0 'f0'") && m.contains("tensor 1 'w'") && m.contains("pre-existing"),
        "{m}"
    );

    let mut d = example();
    d["tensors"][6]["role"] = json!("activation");
    d["tensors"][8]["role"] = json!("output"); // db, produced by a backward op
    assert!(err_text(&d).contains("tensor 8 'db': is an 'output'"));
}

#[test]
fn a_cycle_is_reported_with_an_op_on_it() {
    let d = doc(
        vec![
            tensor("x", 1, "input"),
            tensor("p", 1, "activation"),
            tensor("q", 1, "activation"),
            tensor("r", 1, "activation"),
        ],
        vec![
            op("head", "forward", &[0], &[3]),
            op("one", "forward", &[3, 2], &[1]),
            op("two", "forward", &[1], &[2]),
        ],
    );
    match parse(&d).unwrap_err() {
        GraphError::Cycle { op, cycle, .. } => {
            assert!(op == 1 || op == 2, "{op}");
            assert!(
                cycle.contains("op 1 'one'")
                    && cycle.contains("op 2 'two'")
                    && !cycle.contains("head"),
                "{cycle}"
            );
        }
        other => panic!("{other:?}"),
    }
    // An op reading its own output is a cycle of one.
    let d = doc(
        vec![tensor("p", 1, "activation")],
        vec![op("self", "forward", &[0], &[0])],
    );
    assert!(matches!(
        parse(&d).unwrap_err(),
        GraphError::Cycle { op: 0, .. }
    ));
}

#[test]
fn duplicate_names_are_rejected() {
    let mut d = example();
    d["tensors"][5]["name"] = json!("b");
    let m = err_text(&d);
    assert!(
        m.contains("tensor 5 'b'") && m.contains("duplicate name") && m.contains("tensor 4"),
        "{m}"
    );
    let mut d = example();
    d["ops"][2]["name"] = json!("f0");
    assert!(err_text(&d).contains("op 2 'f0': field 'name': duplicate name"));
    // Ops and tensors are separate namespaces.
    let mut d = example();
    d["ops"][0]["name"] = json!("a");
    assert!(parse(&d).is_ok());
}

#[test]
fn view_rules() {
    let mut d = example();
    d["tensors"][3]["bytes"] = json!(8);
    let m = err_text(&d);
    assert!(
        m.contains("tensor 3 'v': field 'bytes'") && m.contains("view"),
        "{m}"
    );

    let mut d = example();
    d["tensors"][2]["alias_of"] = json!(3);
    d["tensors"][2]["bytes"] = json!(0); // a -> v -> a
    assert!(err_text(&d).contains("alias_of chain loops"));

    let mut d = example();
    d["tensors"][1]["alias_of"] = json!(2);
    d["tensors"][1]["bytes"] = json!(0); // a parameter viewing an activation
    assert!(err_text(&d).contains("tensor 1 'w': field 'alias_of'"));
}

#[test]
fn link_rules() {
    let mut d = example();
    d["tensors"][4]["grad_of"] = json!(1);
    assert!(
        err_text(&d).contains("tensor 4 'b': field 'grad_of': only 'param_grad' and 'input_grad'")
    );
    let mut d = example();
    d["tensors"][10]["grad_of"] = json!(0); // param_grad of the input
    assert!(err_text(&d)
        .contains("tensor 10 'dw': field 'grad_of': a 'param_grad' must point at a 'parameter'"));
    let mut d = example();
    d["tensors"][4]["updates"] = json!(1);
    assert!(err_text(&d).contains("tensor 4 'b': field 'updates': only 'buffer_update'"));
    let mut d = example();
    d["tensors"][5]["role"] = json!("buffer_update");
    assert!(err_text(&d).contains("tensor 5 'c': field 'updates': a 'buffer_update' must name"));
    let mut d = example();
    d["tensors"][5]["role"] = json!("buffer_update");
    d["tensors"][5]["updates"] = json!(1);
    assert!(err_text(&d).contains("must point at a 'buffer'"));
}

#[test]
fn phase_rules() {
    let mut d = example();
    d["ops"][3]["inputs"] = json!([4, 7]); // loss reads the tangent
    let m = err_text(&d);
    assert!(
        m.contains("op 3 'loss'") && m.contains("tensor 7 'tL'") && m.contains("tangent"),
        "{m}"
    );
    let mut d = example();
    d["ops"][3]["inputs"] = json!([4, 8]); // loss reads db
    assert!(err_text(&d).contains(
        "op 3 'loss': is a forward op but reads tensor 8 'db', produced by backward op 4 'loss_b'"
    ));
    let mut d = example();
    d["ops"][1]["differentiates"] = json!(0);
    assert!(err_text(&d).contains("op 1 'f1': field 'differentiates': set on a forward op"));
    let mut d = example();
    d["ops"][5]["differentiates"] = json!(4);
    assert!(err_text(&d).contains("points at op 4 'loss_b', which is not a forward op"));
}

#[test]
fn ir_round_trip_is_exact() {
    let mut d = example();
    d["tensors"][2]["shape"] = json!([10, -1]);
    d["tensors"][2]["dtype"] = json!("float32");
    d["ops"][0]["time"] = json!(1.0000000000000002e-7);
    d["meta"] = json!({"model": {"layers": 3}});
    let g = parse(&d).unwrap();
    let text = graph_to_json(&g);
    assert_eq!(parse_graph_json(&text).unwrap(), g);
    assert!(
        text.starts_with("{\"format\":\"hrockmate-graph\",\"version\":1,"),
        "{text}"
    );
    // Flat arrays keep everything the simulator needs.
    let names_t: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
    let names_o: Vec<String> = g.ops.iter().map(|o| o.name.clone()).collect();
    let back = graph_from_arrays(&graph_to_arrays(&g), Some(&names_t), Some(&names_o)).unwrap();
    assert_eq!(
        back.ops
            .iter()
            .map(|o| (&o.inputs, &o.outputs, o.time, o.workspace, o.differentiates))
            .collect::<Vec<_>>(),
        g.ops
            .iter()
            .map(|o| (&o.inputs, &o.outputs, o.time, o.workspace, o.differentiates))
            .collect::<Vec<_>>()
    );
}

#[test]
fn flat_array_errors_name_the_array() {
    let g = example_graph();
    let mut a = graph_to_arrays(&g);
    a.op_in_ptr[2] = 99;
    let m = graph_from_arrays(&a, None, None).unwrap_err().to_string();
    assert!(m.contains("op_in_ptr"), "{m}");
    let mut a = graph_to_arrays(&g);
    a.tensor_role[3] = 12;
    assert!(graph_from_arrays(&a, None, None)
        .unwrap_err()
        .to_string()
        .contains("tensor_role': item 3 is 12"));
    let mut a = graph_to_arrays(&g);
    a.op_flags.pop();
    assert!(graph_from_arrays(&a, None, None)
        .unwrap_err()
        .to_string()
        .contains("op_flags': has length 6, expected 7"));
    // Unnamed graphs validate, and their messages use ids only.
    let mut a = graph_to_arrays(&g);
    a.op_in_idx[0] = 50;
    let m = graph_from_arrays(&a, None, None).unwrap_err().to_string();
    assert!(
        m.contains("op 0: field 'inputs': tensor id 50 out of range"),
        "{m}"
    );
}

// ---- node-link --------------------------------------------------------------------------------

#[test]
fn node_link_errors() {
    let ok = json!({"directed": true, "nodes": [
        {"id": 0, "name": "a", "backward": false, "cost_cpu": 1, "cost_ram": 8},
        {"id": 1, "name": "a_backward", "backward": true, "cost_cpu": 2, "cost_ram": 8}],
        "links": [{"source": 0, "target": 1}]});
    let g = parse(&ok).unwrap();
    assert_eq!(g.ops[1].differentiates, Some(0));
    assert_eq!(g.tensors[1].role.as_str(), "input_grad");

    let mut d = ok.clone();
    d["links"][0]["target"] = json!(7);
    let m = err_text(&d);
    assert!(
        m.contains("link 0: field 'target'") && m.contains("node id 7"),
        "{m}"
    );
    let mut d = ok.clone();
    d["nodes"][1]["id"] = json!(0);
    assert!(err_text(&d).contains("duplicate node id 0"));
    let mut d = ok.clone();
    d["nodes"][1].as_object_mut().unwrap().remove("cost_ram");
    assert!(err_text(&d).contains("node 1 'a_backward': field 'cost_ram': missing"));
    let mut d = ok.clone();
    d["directed"] = json!(false);
    assert!(err_text(&d).contains("undirected"));
    let mut d = ok.clone();
    d["nodes"][0] = json!({"id": 0, "weight": 3});
    assert!(err_text(&d).contains("unknown node-link graph kind"));
    let mut d = ok.clone();
    d["nodes"][1]["backward"] = json!(false);
    d["links"] = json!([{"source": 1, "target": 0}, {"source": 0, "target": 1}]);
    assert!(matches!(parse(&d).unwrap_err(), GraphError::Cycle { .. }));

    // Layered DAGs: ids by name, links as "0"/"1", parameters as extra tensors.
    let layered = json!({"nodes": [
        {"name": 5, "duration": 0, "out_cost": 10, "param_cost": 0},
        {"name": 9, "duration": 3, "out_cost": 20, "param_cost": 7}],
        "links": [{"0": 5, "1": 9}]});
    let g = parse(&layered).unwrap();
    assert_eq!(g.ops[1].inputs, vec![0, 2]);
    assert_eq!(
        (g.tensors[2].name.as_str(), g.tensors[2].bytes),
        ("9.param", 7)
    );
    assert_eq!(g.tensors[1].role.as_str(), "output");
}

// ---- schedules JSON ---------------------------------------------------------------------------

#[test]
fn schedule_json_round_trip_and_errors() {
    let s = Schedule {
        steps: vec![C(0), F(2), C(1)],
        forward_len: 2,
    };
    assert_eq!(parse_schedule_json(&schedule_to_json(&s)).unwrap(), s);
    let bad = r#"{"format": "hrockmate-schedule", "version": 1, "forward_len": 1, "steps": [["compute", 0], ["drop", 1]]}"#;
    assert!(parse_schedule_json(bad)
        .unwrap_err()
        .to_string()
        .contains("step 1: expected"));
    let bad = r#"{"format": "hrockmate-schedule", "version": 1, "forward_len": 5, "steps": []}"#;
    assert!(parse_schedule_json(bad)
        .unwrap_err()
        .to_string()
        .contains("forward_len"));
    let bad = r#"{"format": "hrockmate-graph", "version": 1, "forward_len": 0, "steps": []}"#;
    assert!(parse_schedule_json(bad)
        .unwrap_err()
        .to_string()
        .contains("field 'format'"));
}

// ---- simulator --------------------------------------------------------------------------------

fn store_all_steps() -> Vec<Step> {
    vec![
        C(0),
        C(1),
        F(2),
        C(2),
        F(5),
        C(3),
        C(4),
        F(4),
        C(5),
        F(8),
        F(3),
        C(6),
        F(9),
        F(10),
        F(11),
    ]
}

#[test]
fn store_all_matches_the_hand_computed_schedule_and_peaks() {
    let g = example_graph();
    let s = store_all(&g);
    assert_eq!(s.steps, store_all_steps());
    assert_eq!(s.forward_len, 6);
    let r = simulate(&g, &s).unwrap();
    assert_eq!(
        r.timeline,
        vec![1300, 1000, 1000, 1230, 1200, 1204, 1404, 1204, 2204, 2004, 1004, 1154, 154, 104, 4]
    );
    assert_eq!((r.peak_bytes, r.peak_step), (2204, 8));
    assert_eq!(
        (r.forward_peak, r.backward_peak, r.bytes_after_forward),
        (1300, 2204, 1204)
    );
    assert_eq!(r.time, 7.0);
    assert_eq!(r.compute_count, vec![1; 7]);
}

#[test]
fn recomputing_an_alive_output_counts_a_temporary() {
    let g = example_graph();
    let mut steps = store_all_steps();
    // After the forward segment, run f2 again while b is alive (c was freed): b is a
    // temporary duplicate (200), c a new storage (30).
    steps.splice(6..6, [C(2), F(5)]);
    let r = simulate(
        &g,
        &Schedule {
            steps,
            forward_len: 6,
        },
    )
    .unwrap();
    assert_eq!(r.timeline[6], 1204 + 200 + 30);
    assert_eq!(r.timeline[7], 1204);
    assert_eq!(r.compute_count[2], 2);
    assert_eq!(r.time, 8.0);
}

#[test]
fn recomputing_a_base_while_its_old_view_is_alive_counts_two_copies() {
    let g = example_graph();
    // a was freed at step 2 but v keeps its storage; producing a again allocates a new one.
    let steps = vec![
        C(0),
        C(1),
        F(2),
        C(0),
        F(2),
        C(2),
        F(5),
        C(3),
        C(4),
        F(4),
        C(5),
        F(8),
        F(3),
        C(6),
    ];
    let r = simulate(
        &g,
        &Schedule {
            steps,
            forward_len: 8,
        },
    )
    .unwrap();
    assert_eq!(r.timeline[3], 1000 + 1000 + 300);
    assert_eq!(r.timeline[4], 1000);
}

#[test]
fn a_view_shares_the_storage_its_op_reads_even_when_its_alias_base_was_freed() {
    // a (1000) <- mm; b = view of a (t1); c = view of a, produced by t2 reading b.
    // After `free a`, b still holds a's storage, so c adds nothing.
    let d = doc(
        vec![
            tensor("x", 8, "input"),
            tensor("a", 1000, "activation"),
            view("b", 1),
            view("c", 1),
            tensor("y", 4, "output"),
        ],
        vec![
            op("mm", "forward", &[0], &[1]),
            op("t1", "forward", &[1], &[2]),
            op("t2", "forward", &[2], &[3]),
            op("out", "forward", &[3], &[4]),
        ],
    );
    let g = parse(&d).unwrap();
    let s = Schedule { steps: vec![C(0), C(1), F(1), C(2), C(3)], forward_len: 5 };
    let r = simulate(&g, &s).unwrap();
    assert_eq!(r.timeline[3], 1000, "c must share b's storage instance");
    assert_eq!(r.peak_bytes, 1004);
}

#[test]
fn views_of_preexisting_tensors_and_of_sibling_outputs() {
    let d = doc(
        vec![
            tensor("w", 64, "parameter"),
            view("wt", 0),
            tensor("m", 500, "activation"),
            view("mv", 2),
            tensor("y", 4, "output"),
        ],
        vec![
            op("t", "forward", &[0], &[1]),
            op("pair", "forward", &[1], &[3, 2]),
            op("out", "forward", &[3], &[4]),
        ],
    );
    let g = parse(&d).unwrap();
    let s = Schedule {
        steps: vec![C(0), C(1), F(1), F(2), C(2), F(3)],
        forward_len: 6,
    };
    let r = simulate(&g, &s).unwrap();
    // wt costs nothing; mv (listed first) shares m's storage; the storage lives until mv goes.
    assert_eq!(r.timeline, vec![0, 500, 500, 500, 504, 4]);
}

fn sim_err(g: &Graph, steps: Vec<Step>, forward_len: usize) -> ScheduleError {
    simulate(g, &Schedule { steps, forward_len }).expect_err("must be rejected")
}

#[test]
fn every_schedule_rule_is_reported_at_its_first_bad_step() {
    let g = example_graph();
    let full = store_all_steps();

    let e = sim_err(&g, vec![C(0), C(70)], 2);
    assert_eq!(e.step, 1);
    assert!(e.message.contains("op id 70 out of range"), "{e}");

    let e = sim_err(&g, vec![C(0), C(2)], 2);
    assert_eq!(e.step, 1);
    assert!(
        e.message
            .contains("op 2 'f2': input tensor 3 'v' is not alive (it has not been computed yet)"),
        "{e}"
    );

    let mut steps = full.clone();
    steps.insert(3, F(3)); // free v, then f2 reads it
    let e = sim_err(&g, steps, 7);
    assert_eq!(e.step, 4);
    assert!(
        e.message
            .contains("tensor 3 'v' is not alive (it was freed)"),
        "{e}"
    );

    let e = sim_err(&g, full.clone(), 7); // loss_b (step 6) inside the forward segment
    assert_eq!(e.step, 6);
    assert!(
        e.message
            .contains("backward op cannot run in the forward segment"),
        "{e}"
    );

    let mut steps = full.clone();
    steps.insert(7, C(4)); // loss_b twice
    let e = sim_err(&g, steps, 6);
    assert_eq!(e.step, 7);
    assert!(
        e.message
            .contains("op 4 'loss_b': backward ops run exactly once"),
        "{e}"
    );

    let mut steps = full.clone();
    steps.insert(6, F(6));
    let e = sim_err(&g, steps, 6);
    assert_eq!(e.step, 6);
    assert!(
        e.message
            .contains("free tensor 6 'L': its role 'output' cannot be freed"),
        "{e}"
    );

    let e = sim_err(&g, vec![F(1)], 1);
    assert!(
        e.step == 0 && e.message.contains("role 'parameter' cannot be freed"),
        "{e}"
    );

    let mut steps = full.clone();
    steps.insert(3, F(2)); // a freed twice
    let e = sim_err(&g, steps, 7);
    assert_eq!(e.step, 3);
    assert!(
        e.message
            .contains("free tensor 2 'a': not alive (it was already freed)"),
        "{e}"
    );

    let e = sim_err(&g, vec![F(4)], 1);
    assert!(e.message.contains("has not been computed yet"), "{e}");
    let e = sim_err(&g, vec![F(40)], 1);
    assert!(e.message.contains("tensor id 40 out of range"), "{e}");

    // The output L is produced only after the forward segment ends.
    let e = sim_err(&g, full.clone(), 5);
    assert_eq!(e.step, 5);
    assert!(
        e.message
            .contains("tensor 6 'L' is an 'output' but was not produced in the forward segment"),
        "{e}"
    );

    // Missing backward op: reported at the end.
    let e = sim_err(&g, full[..11].to_vec(), 6);
    assert_eq!(e.step, 11);
    assert!(e.message.contains("backward op 6 'f0_b' never runs"), "{e}");

    let e = sim_err(&g, full.clone(), 16);
    assert!(
        e.step == 15 && e.message.contains("forward_len 16 exceeds"),
        "{e}"
    );
    assert_eq!(e.to_string(), format!("step 15: {}", e.message));
}

#[test]
fn a_required_buffer_update_must_be_produced() {
    let mut d = doc(
        vec![
            tensor("x", 8, "input"),
            tensor("bn", 8, "buffer"),
            tensor("y", 8, "output"),
            tensor("bn_new", 8, "buffer_update"),
        ],
        vec![
            op("main", "forward", &[0], &[2]),
            op("stats", "forward", &[0, 1], &[3]),
        ],
    );
    d["tensors"][3]["updates"] = json!(1);
    d["ops"][1]["mutates_buffer"] = json!(true);
    let g = parse(&d).unwrap();
    let e = sim_err(&g, vec![C(0)], 1);
    assert_eq!(e.step, 1);
    assert!(
        e.message
            .contains("tensor 3 'bn_new' ('buffer_update') is never produced"),
        "{e}"
    );
    let s = store_all(&g);
    assert_eq!(s.steps, vec![C(0), C(1), F(3)]);
    assert_eq!(simulate(&g, &s).unwrap().peak_bytes, 16);
}

#[test]
fn recompute_all_on_the_example() {
    let g = example_graph();
    let s = recompute_all(&g).unwrap();
    // Forward keeps only L; each backward op recomputes what it reads.
    assert_eq!(
        s.steps,
        vec![
            C(0),
            C(1),
            F(2),
            C(2),
            F(3),
            F(5),
            C(3),
            F(4), // forward
            C(0),
            C(1),
            F(2),
            C(2),
            F(3),
            F(5),
            C(4),
            F(4), // loss_b needs b
            C(0),
            C(1),
            F(2),
            C(5),
            F(3),
            F(8), // f2_b needs v
            C(6),
            F(9),
            F(10),
            F(11),
        ]
    );
    assert_eq!(s.forward_len, 8);
    let r = simulate(&g, &s).unwrap();
    let sa = simulate(&g, &store_all(&g)).unwrap();
    assert_eq!(r.bytes_after_forward, 4);
    assert!(r.peak_bytes <= sa.peak_bytes && r.time > sa.time);
    assert_eq!(r.compute_count, vec![3, 3, 2, 1, 1, 1, 1]);
}

#[test]
fn store_all_orders_a_shuffled_graph_forward_first() {
    let mut d = example();
    // Move the backward op f0_b first: the graph order is no longer an execution order.
    let ops = d["ops"].as_array_mut().unwrap();
    let last = ops.pop().unwrap();
    ops.insert(0, last);
    for o in ops.iter_mut() {
        if let Some(x) = o["differentiates"].as_u64() {
            o["differentiates"] = json!(x + 1);
        }
    }
    let g = parse(&d).unwrap();
    let s = store_all(&g);
    let r = simulate(&g, &s).unwrap();
    assert_eq!(r.peak_bytes, 2204);
    assert_eq!(s.steps[0], C(1));
}
