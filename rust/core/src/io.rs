//! JSON forms of graphs and schedules, and graph validation (docs/graph-ir.md).
//!
//! Parsing goes through `serde_json::Value` and checks each field by hand, so that every error
//! names the op or tensor (by index and name) and the field at fault instead of a byte offset.
//! Two graph formats are read: the IR JSON (`"format": "hrockmate-graph"`) and networkx
//! node-link JSON (`nodes` + `links`, detected automatically).

use std::collections::HashMap;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::graph::{Graph, Op, OpId, Phase, Role, Tensor, TensorId, FORMAT_NAME, FORMAT_VERSION};
use crate::limits::{MAX_FIELD_VALUE, MAX_GRAPH_BYTES};
use crate::schedule::{Schedule, Step};

pub const SCHEDULE_FORMAT_NAME: &str = "hrockmate-schedule";
pub const SCHEDULE_FORMAT_VERSION: u32 = 1;

/// A malformed graph or schedule (file). Every message says where the problem is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// The text is not JSON at all.
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        line: usize,
        column: usize,
        message: String,
    },
    /// A field is missing, unknown, of the wrong type or out of range.
    #[error("{location}: field '{field}': {message}")]
    Field {
        location: String,
        field: String,
        message: String,
    },
    /// A structural rule of the IR is broken (see docs/graph-ir.md, "Validation").
    #[error("{location}: {message}")]
    Invalid { location: String, message: String },
    /// The ops form a cycle; `op` is one op on it.
    #[error("the ops form a cycle: {location} is on the cycle {cycle}")]
    Cycle {
        op: OpId,
        location: String,
        cycle: String,
    },
}

fn field_err(location: &str, field: &str, message: impl Into<String>) -> GraphError {
    GraphError::Field {
        location: location.to_string(),
        field: field.to_string(),
        message: message.into(),
    }
}

fn invalid(location: impl Into<String>, message: impl Into<String>) -> GraphError {
    GraphError::Invalid {
        location: location.into(),
        message: message.into(),
    }
}

/// "op 3 'mm_3'" (or "op 3" when the op has no name), for messages.
pub fn op_label(g: &Graph, op: OpId) -> String {
    match g.ops.get(op) {
        Some(o) if !o.name.is_empty() => format!("op {op} '{}'", o.name),
        _ => format!("op {op}"),
    }
}

/// "tensor 7 'x'" (or "tensor 7" when the tensor has no name), for messages.
pub fn tensor_label(g: &Graph, t: TensorId) -> String {
    match g.tensors.get(t) {
        Some(x) if !x.name.is_empty() => format!("tensor {t} '{}'", x.name),
        _ => format!("tensor {t}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Typed access to JSON objects with located errors
// ---------------------------------------------------------------------------------------------

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn parse_json(text: &str) -> Result<Value, GraphError> {
    serde_json::from_str(text).map_err(|e| GraphError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })
}

/// A JSON object being read, with the location used in its error messages.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    loc: String,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Value, loc: String) -> Result<Self, GraphError> {
        match v {
            Value::Object(map) => Ok(Obj { map, loc }),
            other => Err(invalid(
                loc,
                format!("expected an object, got {}", type_name(other)),
            )),
        }
    }

    fn reject_unknown(&self, allowed: &[&str]) -> Result<(), GraphError> {
        for key in self.map.keys() {
            if !allowed.contains(&key.as_str()) {
                return Err(field_err(
                    &self.loc,
                    key,
                    format!("unknown field (allowed: {})", allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// The value of `key`; `None` when absent or null.
    fn opt(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn req(&self, key: &str) -> Result<&'a Value, GraphError> {
        self.opt(key)
            .ok_or_else(|| field_err(&self.loc, key, "missing (required)"))
    }

    fn wrong(&self, key: &str, expected: &str, got: &Value) -> GraphError {
        field_err(
            &self.loc,
            key,
            format!("expected {expected}, got {}", short_value(got)),
        )
    }

    fn string(&self, key: &str) -> Result<String, GraphError> {
        let v = self.req(key)?;
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.wrong(key, "a string", v))
    }

    fn nonempty_string(&self, key: &str) -> Result<String, GraphError> {
        let s = self.string(key)?;
        if s.is_empty() {
            return Err(field_err(&self.loc, key, "must not be empty"));
        }
        Ok(s)
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>, GraphError> {
        match self.opt(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }

    fn uint(&self, key: &str) -> Result<u64, GraphError> {
        let v = self.req(key)?;
        as_uint(v).ok_or_else(|| self.wrong(key, UINT_EXPECTED, v))
    }

    fn opt_uint(&self, key: &str) -> Result<Option<u64>, GraphError> {
        match self.opt(key) {
            None => Ok(None),
            Some(v) => as_uint(v)
                .map(Some)
                .ok_or_else(|| self.wrong(key, UINT_EXPECTED, v)),
        }
    }

    fn float(&self, key: &str) -> Result<f64, GraphError> {
        let v = self.req(key)?;
        match v.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(self.wrong(key, "a number >= 0", v)),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<bool, GraphError> {
        match self.opt(key) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }

    fn id_list(&self, key: &str) -> Result<Vec<usize>, GraphError> {
        let v = self.req(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| self.wrong(key, "a list of ids", v))?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                as_uint(x).map(|u| u as usize).ok_or_else(|| {
                    field_err(
                        &self.loc,
                        key,
                        format!(
                            "item {i}: expected an id ({UINT_EXPECTED}), got {}",
                            short_value(x)
                        ),
                    )
                })
            })
            .collect()
    }
}

/// What sizes, ids and counts may be: they cross into Python as int64.
const UINT_EXPECTED: &str = "an integer >= 0 (at most 2^63-1)";

/// An integer from 0 to [`MAX_FIELD_VALUE`] (2^63-1); integral floats (as some JSON writers
/// produce) are accepted.
fn as_uint(v: &Value) -> Option<u64> {
    if let Some(u) = v.as_u64() {
        return Some(u).filter(|&u| u <= MAX_FIELD_VALUE);
    }
    match v.as_f64() {
        // (2^63 - 1 rounds to 2^63, the first float out of range.)
        Some(x) if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < MAX_FIELD_VALUE as f64 => {
            Some(x as u64)
        }
        _ => None,
    }
}

fn short_value(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        let cut: String = s.chars().take(37).collect();
        format!("{} {cut}...", type_name(v))
    } else {
        format!("{} {s}", type_name(v))
    }
}

// ---------------------------------------------------------------------------------------------
// Graph JSON
// ---------------------------------------------------------------------------------------------

/// Parse a graph from IR JSON or networkx node-link JSON (auto-detected) and validate it.
pub fn parse_graph_json(text: &str) -> Result<Graph, GraphError> {
    let value = parse_json(text)?;
    let top = Obj::new(&value, "graph".to_string())?;
    let g = if top.map.contains_key("format") || !top.map.contains_key("nodes") {
        parse_ir(&top)?
    } else {
        parse_node_link(&top)?
    };
    validate(&g)?;
    Ok(g)
}

fn parse_ir(top: &Obj) -> Result<Graph, GraphError> {
    top.reject_unknown(&[
        "format",
        "version",
        "name",
        "time_unit",
        "tensors",
        "ops",
        "meta",
    ])?;
    let format = top.opt("format").ok_or_else(|| {
        field_err(
            "graph",
            "format",
            format!(
                "missing: not a '{FORMAT_NAME}' file and not a networkx node-link graph (no 'nodes'/'links')"
            ),
        )
    })?;
    if format.as_str() != Some(FORMAT_NAME) {
        return Err(top.wrong("format", &format!("\"{FORMAT_NAME}\""), format));
    }
    let version = top.uint("version")?;
    if version != u64::from(FORMAT_VERSION) {
        return Err(field_err(
            "graph",
            "version",
            format!("unsupported version {version} (this build reads version {FORMAT_VERSION})"),
        ));
    }
    let tensors_v = top.req("tensors")?;
    let tensors_a = tensors_v
        .as_array()
        .ok_or_else(|| top.wrong("tensors", "a list", tensors_v))?;
    let ops_v = top.req("ops")?;
    let ops_a = ops_v
        .as_array()
        .ok_or_else(|| top.wrong("ops", "a list", ops_v))?;
    let meta = match top.opt("meta") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => return Err(top.wrong("meta", "an object", v)),
    };
    let tensors = tensors_a
        .iter()
        .enumerate()
        .map(|(i, v)| parse_tensor(i, v))
        .collect::<Result<Vec<_>, _>>()?;
    let ops = ops_a
        .iter()
        .enumerate()
        .map(|(i, v)| parse_op(i, v))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Graph {
        name: top.opt_string("name")?.unwrap_or_default(),
        time_unit: top
            .opt_string("time_unit")?
            .unwrap_or_else(|| "s".to_string()),
        tensors,
        ops,
        meta,
    })
}

/// The location of list item `i` before its name is known: "tensor 3 'x'" if the name reads.
fn item_loc(kind: &str, i: usize, v: &Value) -> String {
    match v
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    {
        Some(name) => format!("{kind} {i} '{name}'"),
        None => format!("{kind} {i}"),
    }
}

fn parse_tensor(i: usize, v: &Value) -> Result<Tensor, GraphError> {
    let o = Obj::new(v, item_loc("tensor", i, v))?;
    o.reject_unknown(&[
        "name", "bytes", "role", "alias_of", "grad_of", "updates", "shape", "dtype",
    ])?;
    let role_v = o.req("role")?;
    let role = role_v
        .as_str()
        .and_then(role_from_str)
        .ok_or_else(|| o.wrong("role", &format!("one of {}", role_names()), role_v))?;
    let shape = match o.opt("shape") {
        None => None,
        Some(s) => {
            let items = s
                .as_array()
                .ok_or_else(|| o.wrong("shape", "a list of integers", s))?;
            Some(
                items
                    .iter()
                    .map(|d| {
                        d.as_i64()
                            .ok_or_else(|| o.wrong("shape", "a list of integers", s))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            )
        }
    };
    Ok(Tensor {
        name: o.nonempty_string("name")?,
        bytes: o.uint("bytes")?,
        role,
        alias_of: o.opt_uint("alias_of")?.map(|x| x as usize),
        grad_of: o.opt_uint("grad_of")?.map(|x| x as usize),
        updates: o.opt_uint("updates")?.map(|x| x as usize),
        shape,
        dtype: o.opt_string("dtype")?,
    })
}

fn parse_op(i: usize, v: &Value) -> Result<Op, GraphError> {
    let o = Obj::new(v, item_loc("op", i, v))?;
    o.reject_unknown(&[
        "name",
        "target",
        "phase",
        "time",
        "workspace",
        "inputs",
        "outputs",
        "differentiates",
        "random",
        "mutates_buffer",
        "module",
    ])?;
    let phase_v = o.req("phase")?;
    let phase = match phase_v.as_str() {
        Some("forward") => Phase::Forward,
        Some("backward") => Phase::Backward,
        _ => return Err(o.wrong("phase", "\"forward\" or \"backward\"", phase_v)),
    };
    Ok(Op {
        name: o.nonempty_string("name")?,
        target: o.opt_string("target")?.unwrap_or_default(),
        phase,
        time: o.float("time")?,
        workspace: o.opt_uint("workspace")?.unwrap_or(0),
        inputs: o.id_list("inputs")?,
        outputs: o.id_list("outputs")?,
        differentiates: o.opt_uint("differentiates")?.map(|x| x as usize),
        random: o.opt_bool("random")?,
        mutates_buffer: o.opt_bool("mutates_buffer")?,
        module: o.opt_string("module")?.unwrap_or_default(),
    })
}

fn role_from_str(s: &str) -> Option<Role> {
    Role::ALL.iter().copied().find(|r| r.as_str() == s)
}

fn role_names() -> String {
    Role::ALL
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Canonical IR JSON (field order as in docs/graph-ir.md, one line).
pub fn graph_to_json(g: &Graph) -> String {
    #[derive(Serialize)]
    struct Out<'a> {
        format: &'a str,
        version: u32,
        name: &'a str,
        time_unit: &'a str,
        tensors: &'a [Tensor],
        ops: &'a [Op],
        meta: &'a Map<String, Value>,
    }
    serde_json::to_string(&Out {
        format: FORMAT_NAME,
        version: FORMAT_VERSION,
        name: &g.name,
        time_unit: &g.time_unit,
        tensors: &g.tensors,
        ops: &g.ops,
        meta: &g.meta,
    })
    .expect("a graph always serialises (finite floats, string keys)")
}

// ---------------------------------------------------------------------------------------------
// networkx node-link graphs
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum NodeLinkKind {
    /// Checkmate training graphs: `backward`, `cost_cpu`, `cost_ram`.
    Checkmate,
    /// Random layered DAGs: `duration`, `out_cost`, `param_cost`.
    Layered,
}

fn parse_node_link(top: &Obj) -> Result<Graph, GraphError> {
    if top.opt("directed").and_then(Value::as_bool) == Some(false) {
        return Err(field_err(
            "graph",
            "directed",
            "the node-link graph is undirected; a data-flow graph needs directed links",
        ));
    }
    let nodes_v = top.req("nodes")?;
    let nodes = nodes_v
        .as_array()
        .ok_or_else(|| top.wrong("nodes", "a list", nodes_v))?;
    let links_key = if top.map.contains_key("links") {
        "links"
    } else {
        "edges"
    };
    let links_v = top.req(links_key)?;
    let links = links_v
        .as_array()
        .ok_or_else(|| top.wrong(links_key, "a list", links_v))?;

    // Node ids: `id` when present, else `name`. Keys are the JSON text, so 0 and "0" differ.
    let mut index: HashMap<String, usize> = HashMap::with_capacity(nodes.len());
    let mut names: Vec<String> = Vec::with_capacity(nodes.len());
    let mut objs: Vec<Obj> = Vec::with_capacity(nodes.len());
    for (i, v) in nodes.iter().enumerate() {
        let o = Obj::new(v, format!("node {i}"))?;
        let id_key = if o.map.contains_key("id") {
            "id"
        } else {
            "name"
        };
        let id = o.req(id_key)?;
        if !(id.is_string() || id.is_number()) {
            return Err(o.wrong(id_key, "a string or a number", id));
        }
        if index.insert(id.to_string(), i).is_some() {
            return Err(field_err(&o.loc, id_key, format!("duplicate node id {id}")));
        }
        let name = match o.opt("name") {
            Some(Value::String(s)) => s.clone(),
            Some(other @ Value::Number(_)) => other.to_string(),
            Some(other) => return Err(o.wrong("name", "a string or a number", other)),
            None => match id {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
        };
        names.push(name.clone());
        objs.push(Obj {
            map: o.map,
            loc: format!("node {i} '{name}'"),
        });
    }
    let kind = match objs.first() {
        None => NodeLinkKind::Layered,
        Some(o) if o.map.contains_key("backward") || o.map.contains_key("cost_ram") => {
            NodeLinkKind::Checkmate
        }
        Some(o) if o.map.contains_key("out_cost") || o.map.contains_key("duration") => {
            NodeLinkKind::Layered
        }
        Some(o) => {
            return Err(invalid(
                &o.loc,
                "unknown node-link graph kind: expected Checkmate nodes (backward, cost_cpu, \
                 cost_ram) or random layered DAG nodes (duration, out_cost, param_cost)",
            ))
        }
    };

    // Predecessors of each node, in link order.
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    let mut has_succ = vec![false; nodes.len()];
    for (k, l) in links.iter().enumerate() {
        let o = Obj::new(l, format!("link {k}"))?;
        let (sk, tk) = if o.map.contains_key("source") {
            ("source", "target")
        } else {
            ("0", "1")
        };
        let end = |key: &str| -> Result<usize, GraphError> {
            let v = o.req(key)?;
            index.get(&v.to_string()).copied().ok_or_else(|| {
                field_err(
                    &o.loc,
                    key,
                    format!("refers to node id {v}, which does not exist"),
                )
            })
        };
        let s = end(sk)?;
        let t = end(tk)?;
        preds[t].push(s);
        has_succ[s] = true;
    }

    let mut g = Graph {
        name: match top.opt("graph").and_then(|x| x.get("name")) {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        },
        time_unit: "units".to_string(),
        ..Graph::default()
    };
    g.meta
        .insert("source_format".into(), Value::from("networkx-node-link"));
    g.meta.insert(
        "source_kind".into(),
        Value::from(match kind {
            NodeLinkKind::Checkmate => "checkmate-training",
            NodeLinkKind::Layered => "random-layered",
        }),
    );

    // One op and one produced tensor per node, with the same index.
    let mut backward = vec![false; nodes.len()];
    for (i, o) in objs.iter().enumerate() {
        let (bytes, time, is_bwd) = match kind {
            NodeLinkKind::Checkmate => {
                let b = match o.opt("backward") {
                    None => return Err(field_err(&o.loc, "backward", "missing (required)")),
                    Some(v) => v
                        .as_bool()
                        .ok_or_else(|| o.wrong("backward", "true or false", v))?,
                };
                (o.uint("cost_ram")?, o.float("cost_cpu")?, b)
            }
            NodeLinkKind::Layered => (o.uint("out_cost")?, o.float("duration")?, false),
        };
        backward[i] = is_bwd;
        let role = match kind {
            NodeLinkKind::Checkmate if is_bwd && !has_succ[i] => Role::InputGrad,
            NodeLinkKind::Layered if !has_succ[i] => Role::Output,
            _ => Role::Activation,
        };
        g.tensors.push(Tensor {
            name: names[i].clone(),
            bytes,
            role,
            alias_of: None,
            grad_of: None,
            updates: None,
            shape: None,
            dtype: None,
        });
        g.ops.push(Op {
            name: names[i].clone(),
            target: String::new(),
            phase: if is_bwd {
                Phase::Backward
            } else {
                Phase::Forward
            },
            time,
            workspace: 0,
            inputs: preds[i].clone(),
            outputs: vec![i],
            differentiates: None,
            random: false,
            mutates_buffer: false,
            module: String::new(),
        });
    }
    match kind {
        NodeLinkKind::Checkmate => {
            // `X_backward` differentiates the forward node `X`.
            let by_name: HashMap<&str, usize> = names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), i))
                .collect();
            for i in 0..nodes.len() {
                if let Some(base) = names[i].strip_suffix("_backward") {
                    if let Some(&f) = by_name.get(base) {
                        if backward[i] && !backward[f] {
                            g.ops[i].differentiates = Some(f);
                        }
                    }
                }
            }
        }
        NodeLinkKind::Layered => {
            for (i, o) in objs.iter().enumerate() {
                let p = o.opt_uint("param_cost")?.unwrap_or(0);
                if p > 0 {
                    let t = g.tensors.len();
                    g.tensors.push(Tensor {
                        name: format!("{}.param", names[i]),
                        bytes: p,
                        role: Role::Parameter,
                        alias_of: None,
                        grad_of: None,
                        updates: None,
                        shape: None,
                        dtype: None,
                    });
                    g.ops[i].inputs.push(t);
                }
            }
        }
    }
    Ok(g)
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// Check every rule of docs/graph-ir.md "Validation"; the error names the first offender.
pub fn validate(g: &Graph) -> Result<(), GraphError> {
    validate_with(g, true)
}

/// Validation without the `grad_of`/`updates` link rules, for graphs built from flat arrays
/// (which do not carry those links).
pub fn validate_structure(g: &Graph) -> Result<(), GraphError> {
    validate_with(g, false)
}

fn validate_with(g: &Graph, check_links: bool) -> Result<(), GraphError> {
    let nt = g.tensors.len();
    let no = g.ops.len();
    let tl = |t: usize| tensor_label(g, t);
    let ol = |o: usize| op_label(g, o);

    check_unique_names(g.tensors.iter().map(|t| t.name.as_str()), "tensor")?;
    check_unique_names(g.ops.iter().map(|o| o.name.as_str()), "op")?;

    // Ids in range.
    for (i, t) in g.tensors.iter().enumerate() {
        for (field, id) in [
            ("alias_of", t.alias_of),
            ("grad_of", t.grad_of),
            ("updates", t.updates),
        ] {
            if let Some(x) = id {
                if x >= nt {
                    return Err(field_err(
                        &tl(i),
                        field,
                        format!("tensor id {x} out of range (the graph has {nt} tensors)"),
                    ));
                }
            }
        }
    }
    for (i, o) in g.ops.iter().enumerate() {
        for (field, ids) in [("inputs", &o.inputs), ("outputs", &o.outputs)] {
            if let Some(&x) = ids.iter().find(|&&x| x >= nt) {
                return Err(field_err(
                    &ol(i),
                    field,
                    format!("tensor id {x} out of range (the graph has {nt} tensors)"),
                ));
            }
        }
        if let Some(d) = o.differentiates {
            if d >= no {
                return Err(field_err(
                    &ol(i),
                    "differentiates",
                    format!("op id {d} out of range (the graph has {no} ops)"),
                ));
            }
            if o.phase != Phase::Backward {
                return Err(field_err(
                    &ol(i),
                    "differentiates",
                    "set on a forward op; only backward ops differentiate a forward op",
                ));
            }
            if g.ops[d].phase != Phase::Forward {
                return Err(field_err(
                    &ol(i),
                    "differentiates",
                    format!("points at {}, which is not a forward op", ol(d)),
                ));
            }
        }
        if !(o.time.is_finite() && o.time >= 0.0) {
            return Err(field_err(
                &ol(i),
                "time",
                format!("must be a finite number >= 0, got {}", o.time),
            ));
        }
    }

    // Producers: non-pre-existing tensors exactly once, pre-existing ones never.
    let mut producer: Vec<Option<OpId>> = vec![None; nt];
    for (i, o) in g.ops.iter().enumerate() {
        for &t in &o.outputs {
            if g.tensors[t].role.is_preexisting() {
                return Err(invalid(ol(i), format!(
                    "outputs {} whose role '{}' is pre-existing (alive before the iteration; no op may produce it)",
                    tl(t), g.tensors[t].role.as_str()
                )));
            }
            if let Some(p) = producer[t] {
                return Err(invalid(
                    tl(t),
                    if p == i {
                        format!("listed twice in the outputs of {}", ol(i))
                    } else {
                        format!(
                            "is an output of both {} and {}; every tensor has at most one producer",
                            ol(p),
                            ol(i)
                        )
                    },
                ));
            }
            producer[t] = Some(i);
        }
    }
    for (t, tensor) in g.tensors.iter().enumerate() {
        if !tensor.role.is_preexisting() && producer[t].is_none() {
            return Err(invalid(
                tl(t),
                format!(
                    "role '{}' must be the output of exactly one op, but no op produces it",
                    tensor.role.as_str()
                ),
            ));
        }
        if tensor.role == Role::Output {
            if let Some(p) = producer[t] {
                if g.ops[p].phase != Phase::Forward {
                    return Err(invalid(
                        tl(t),
                        format!(
                            "is an 'output' (returned by the forward call) but is produced by backward {}",
                            ol(p)
                        ),
                    ));
                }
            }
        }
    }

    // Aliases: acyclic chains, views own no bytes, pre-existing tensors only alias pre-existing ones.
    let mut state = vec![0u8; nt]; // 0 unvisited, 1 on the current chain, 2 done
    for start in 0..nt {
        let mut t = start;
        let mut chain = Vec::new();
        while state[t] == 0 {
            state[t] = 1;
            chain.push(t);
            match g.tensors[t].alias_of {
                Some(base) => {
                    if state[base] == 1 {
                        return Err(invalid(tl(base), "its alias_of chain loops back to itself; views must lead to a tensor that owns its storage"));
                    }
                    t = base;
                }
                None => break,
            }
        }
        for c in chain {
            state[c] = 2;
        }
    }
    for (t, tensor) in g.tensors.iter().enumerate() {
        if let Some(base) = tensor.alias_of {
            if tensor.bytes != 0 {
                return Err(field_err(&tl(t), "bytes", format!(
                    "is {} but the tensor is a view (alias_of {}); a view owns no storage, so bytes must be 0",
                    tensor.bytes, tl(base)
                )));
            }
            if tensor.role.is_preexisting() && !g.tensors[base].role.is_preexisting() {
                return Err(field_err(
                    &tl(t),
                    "alias_of",
                    format!(
                        "a pre-existing '{}' tensor cannot be a view of {}, which the iteration produces",
                        tensor.role.as_str(),
                        tl(base)
                    ),
                ));
            }
        }
    }

    check_total_bytes(g)?;

    // grad_of / updates links.
    if check_links {
        for (t, tensor) in g.tensors.iter().enumerate() {
            let role = tensor.role;
            match (role, tensor.grad_of) {
                (Role::ParamGrad | Role::InputGrad, Some(x)) => {
                    let want = if role == Role::ParamGrad {
                        Role::Parameter
                    } else {
                        Role::Input
                    };
                    if g.tensors[x].role != want {
                        return Err(field_err(
                            &tl(t),
                            "grad_of",
                            format!(
                                "a '{}' must point at a '{}', but {} is a '{}'",
                                role.as_str(),
                                want.as_str(),
                                tl(x),
                                g.tensors[x].role.as_str()
                            ),
                        ));
                    }
                }
                (_, Some(_)) if !matches!(role, Role::ParamGrad | Role::InputGrad) => {
                    return Err(field_err(
                        &tl(t),
                        "grad_of",
                        format!(
                            "only 'param_grad' and 'input_grad' tensors may set it (this one is '{}')",
                            role.as_str()
                        ),
                    ));
                }
                _ => {}
            }
            match (role, tensor.updates) {
                (Role::BufferUpdate, None) => {
                    return Err(field_err(
                        &tl(t),
                        "updates",
                        "a 'buffer_update' must name the buffer it updates",
                    ));
                }
                // (an input updated in place, as a QA head clamps its start positions, is
                // written back as a buffer is)
                (Role::BufferUpdate, Some(x))
                    if !matches!(g.tensors[x].role, Role::Buffer | Role::Input) =>
                {
                    return Err(field_err(
                        &tl(t),
                        "updates",
                        format!(
                            "must point at a 'buffer' or an 'input', but {} is a '{}'",
                            tl(x),
                            g.tensors[x].role.as_str()
                        ),
                    ));
                }
                (r, Some(_)) if r != Role::BufferUpdate => {
                    return Err(field_err(
                        &tl(t),
                        "updates",
                        format!(
                            "only 'buffer_update' tensors may set it (this one is '{}')",
                            r.as_str()
                        ),
                    ));
                }
                _ => {}
            }
        }
    }

    // Forward ops read no tangent and nothing a backward op produced.
    for (i, o) in g.ops.iter().enumerate() {
        if o.phase != Phase::Forward {
            continue;
        }
        for &t in &o.inputs {
            if g.tensors[t].role == Role::Tangent {
                return Err(invalid(
                    ol(i),
                    format!(
                        "is a forward op but reads {}, a tangent (tangents exist only in backward)",
                        tl(t)
                    ),
                ));
            }
            if let Some(p) = producer[t] {
                if g.ops[p].phase == Phase::Backward {
                    return Err(invalid(
                        ol(i),
                        format!(
                            "is a forward op but reads {}, produced by backward {}",
                            tl(t),
                            ol(p)
                        ),
                    ));
                }
            }
        }
    }

    check_acyclic(g, &producer)
}

/// The sizes of `g` must add up to at most [`MAX_GRAPH_BYTES`] (see there why); the error names
/// the tensor or op at which the running sum passes it. Needs acyclic alias chains.
fn check_total_bytes(g: &Graph) -> Result<(), GraphError> {
    let roots = g.storage_roots();
    let past_limit = |location: String, field: &str, what: String| {
        field_err(&location, field, format!(
            "{what}, which takes the graph's sizes past 2^62-1 bytes (4 EiB), the most the planner \
             adds up exactly (every tensor's storage bytes, a view counting its base's, plus every \
             op's workspace); check the units of the sizes"
        ))
    };
    let mut total: u64 = 0;
    for (t, &root) in roots.iter().enumerate() {
        let bytes = g.tensors[root].bytes;
        total = match total.checked_add(bytes).filter(|&s| s <= MAX_GRAPH_BYTES) {
            Some(s) => s,
            None if root == t => {
                return Err(past_limit(tensor_label(g, t), "bytes", format!("is {bytes}")));
            }
            None => {
                let base = tensor_label(g, root);
                return Err(past_limit(tensor_label(g, t), "alias_of", format!("views {base} of {bytes} bytes")));
            }
        };
    }
    for (i, o) in g.ops.iter().enumerate() {
        total = total
            .checked_add(o.workspace)
            .filter(|&s| s <= MAX_GRAPH_BYTES)
            .ok_or_else(|| past_limit(op_label(g, i), "workspace", format!("is {}", o.workspace)))?;
    }
    Ok(())
}

fn check_unique_names<'a>(
    names: impl Iterator<Item = &'a str>,
    kind: &str,
) -> Result<(), GraphError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, n) in names.enumerate() {
        // Graphs built from flat arrays may be unnamed; the JSON parser requires names.
        if n.is_empty() {
            continue;
        }
        if let Some(j) = seen.insert(n, i) {
            return Err(field_err(
                &format!("{kind} {i} '{n}'"),
                "name",
                format!("duplicate name: {kind} {j} has the same name"),
            ));
        }
    }
    Ok(())
}

/// Kahn's algorithm over op -> op edges (producer of an input -> reader); on failure, walk
/// predecessors inside the unresolved set until an op repeats, which yields a cycle.
fn check_acyclic(g: &Graph, producer: &[Option<OpId>]) -> Result<(), GraphError> {
    let order = topo_order(g, producer);
    if order.len() == g.ops.len() {
        return Ok(());
    }
    let mut done = vec![false; g.ops.len()];
    for &o in &order {
        done[o] = true;
    }
    let start = (0..g.ops.len())
        .find(|&o| !done[o])
        .expect("some op is unresolved");
    // Every unresolved op has an unresolved predecessor, so this walk must revisit an op.
    let mut pos: HashMap<OpId, usize> = HashMap::new();
    let mut path = vec![start];
    let mut cur = start;
    loop {
        pos.insert(cur, path.len() - 1);
        let next = g.ops[cur]
            .inputs
            .iter()
            .filter_map(|&t| producer[t])
            .find(|&p| !done[p])
            .expect("an unresolved op has an unresolved predecessor");
        if let Some(&k) = pos.get(&next) {
            let mut cycle: Vec<OpId> = path[k..].to_vec();
            cycle.reverse(); // producers first
            let op = cycle[0];
            let mut names: Vec<String> = cycle.iter().map(|&o| op_label(g, o)).collect();
            names.push(op_label(g, op));
            return Err(GraphError::Cycle {
                op,
                location: op_label(g, op),
                cycle: names.join(" -> "),
            });
        }
        path.push(next);
        cur = next;
    }
}

/// A topological order of the ops (by producer -> reader edges), smallest ready id first.
/// Shorter than `g.ops.len()` when the ops contain a cycle.
pub fn topo_order(g: &Graph, producer: &[Option<OpId>]) -> Vec<OpId> {
    topo_order_by(g, producer, |_| 0)
}

/// Topological order preferring ready ops with the smallest `(class(op), op)`; used with the
/// phase as class to put every forward op before any backward op.
pub(crate) fn topo_order_by(
    g: &Graph,
    producer: &[Option<OpId>],
    class: impl Fn(OpId) -> u8,
) -> Vec<OpId> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let n = g.ops.len();
    let mut indeg = vec![0usize; n];
    let mut succ: Vec<Vec<OpId>> = vec![Vec::new(); n];
    for (i, o) in g.ops.iter().enumerate() {
        for &t in &o.inputs {
            if let Some(p) = producer.get(t).copied().flatten() {
                succ[p].push(i);
                indeg[i] += 1;
            }
        }
    }
    let mut heap: BinaryHeap<Reverse<(u8, OpId)>> = (0..n)
        .filter(|&i| indeg[i] == 0)
        .map(|i| Reverse((class(i), i)))
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse((_, i))) = heap.pop() {
        order.push(i);
        for &s in &succ[i] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                heap.push(Reverse((class(s), s)));
            }
        }
    }
    order
}

// ---------------------------------------------------------------------------------------------
// Schedule JSON
// ---------------------------------------------------------------------------------------------

/// Parse `{"format": "hrockmate-schedule", "version": 1, "forward_len": N, "steps": [...]}`.
/// Ids are checked against a graph only by the simulator.
pub fn parse_schedule_json(text: &str) -> Result<Schedule, GraphError> {
    let value = parse_json(text)?;
    let top = Obj::new(&value, "schedule".to_string())?;
    top.reject_unknown(&["format", "version", "forward_len", "steps"])?;
    let format = top.req("format")?;
    if format.as_str() != Some(SCHEDULE_FORMAT_NAME) {
        return Err(top.wrong("format", &format!("\"{SCHEDULE_FORMAT_NAME}\""), format));
    }
    let version = top.uint("version")?;
    if version != u64::from(SCHEDULE_FORMAT_VERSION) {
        return Err(field_err(
            "schedule",
            "version",
            format!("unsupported version {version} (this build reads version {SCHEDULE_FORMAT_VERSION})"),
        ));
    }
    let steps_v = top.req("steps")?;
    let items = steps_v.as_array().ok_or_else(|| {
        top.wrong(
            "steps",
            "a list of [\"compute\"|\"free\", id] pairs",
            steps_v,
        )
    })?;
    let mut steps = Vec::with_capacity(items.len());
    for (i, s) in items.iter().enumerate() {
        let bad = || {
            field_err(
                "schedule",
                "steps",
                format!(
                    "step {i}: expected [\"compute\", op id] or [\"free\", tensor id], got {}",
                    short_value(s)
                ),
            )
        };
        let pair = s.as_array().filter(|a| a.len() == 2).ok_or_else(bad)?;
        if pair[1].as_u64().is_some_and(|id| id > MAX_FIELD_VALUE) {
            return Err(field_err(
                "schedule",
                "steps",
                format!("step {i}: id {} is out of range (ids are at most 2^63-1)", pair[1]),
            ));
        }
        let id = as_uint(&pair[1]).ok_or_else(bad)? as usize;
        steps.push(match pair[0].as_str() {
            Some("compute") => Step::Compute(id),
            Some("free") => Step::Free(id),
            _ => return Err(bad()),
        });
    }
    let forward_len = top.uint("forward_len")? as usize;
    if forward_len > steps.len() {
        return Err(field_err(
            "schedule",
            "forward_len",
            format!(
                "{forward_len} exceeds the number of steps ({})",
                steps.len()
            ),
        ));
    }
    Ok(Schedule { steps, forward_len })
}

/// Canonical schedule JSON (one line).
pub fn schedule_to_json(s: &Schedule) -> String {
    let steps: Vec<Value> = s
        .steps
        .iter()
        .map(|st| {
            let kind = match st {
                Step::Compute(_) => "compute",
                Step::Free(_) => "free",
            };
            Value::Array(vec![Value::from(kind), Value::from(st.id() as u64)])
        })
        .collect();
    let mut m = Map::new();
    m.insert("format".into(), Value::from(SCHEDULE_FORMAT_NAME));
    m.insert("version".into(), Value::from(SCHEDULE_FORMAT_VERSION));
    m.insert("forward_len".into(), Value::from(s.forward_len as u64));
    m.insert("steps".into(), Value::Array(steps));
    Value::Object(m).to_string()
}
