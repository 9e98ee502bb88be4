//! Random valid training graphs for property tests and benchmarks.
//!
//! `random_training_graph(seed, &GenParams)` builds a forward DAG (with views, multi-output ops,
//! workspace, random ops, buffer updates, extra outputs) ending in a scalar loss, then the
//! backward pass the way autograd would: one backward op per forward op that receives a
//! gradient (`differentiates` set), gradient accumulation ops where a tensor has several
//! readers, `param_grad`s and optionally an `input_grad`. Ops are in execution order. The result
//! always passes `io::validate`. Deterministic for a given seed; O(ops) time.

use crate::graph::{Graph, Op, OpId, Phase, Role, Tensor, TensorId};

/// A small deterministic generator (splitmix64), so that no RNG crate is needed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (hi exclusive, hi > lo).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// Shape of the generated graphs.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Forward ops before the loss op.
    pub n_forward: usize,
    /// Parameters (read by forward ops with probability `param_read_prob`).
    pub n_params: usize,
    /// Most tensors a forward op reads (>= 1).
    pub max_inputs: usize,
    /// Inputs are drawn from the last `window` forward tensors (locality, like real models).
    pub window: usize,
    pub param_read_prob: f64,
    /// A forward op is a view of its first input.
    pub view_prob: f64,
    /// A forward op produces two tensors.
    pub multi_output_prob: f64,
    /// An op uses temporary workspace.
    pub workspace_prob: f64,
    /// A forward op reads a buffer and produces its `buffer_update`.
    pub buffer_prob: f64,
    pub random_prob: f64,
    /// A forward tensor is also returned as an `output`.
    pub extra_output_prob: f64,
    /// The model input requires a gradient (`input_grad`).
    pub input_grad: bool,
    /// Tensor sizes are uniform in `1..=max_bytes`.
    pub max_bytes: u64,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            n_forward: 20,
            n_params: 4,
            max_inputs: 3,
            window: 8,
            param_read_prob: 0.4,
            view_prob: 0.15,
            multi_output_prob: 0.15,
            workspace_prob: 0.2,
            buffer_prob: 0.05,
            random_prob: 0.05,
            extra_output_prob: 0.05,
            input_grad: true,
            max_bytes: 1000,
        }
    }
}

struct Builder<'a> {
    g: Graph,
    rng: &'a mut Rng,
    max_bytes: u64,
}

impl Builder<'_> {
    fn tensor(
        &mut self,
        name: String,
        bytes: u64,
        role: Role,
        alias_of: Option<TensorId>,
    ) -> TensorId {
        self.g.tensors.push(Tensor {
            name,
            bytes,
            role,
            alias_of,
            grad_of: None,
            updates: None,
            shape: None,
            dtype: None,
        });
        self.g.tensors.len() - 1
    }

    fn size(&mut self) -> u64 {
        1 + self.rng.next_u64() % self.max_bytes
    }

    fn op(
        &mut self,
        name: String,
        phase: Phase,
        inputs: Vec<TensorId>,
        outputs: Vec<TensorId>,
        workspace_prob: f64,
    ) -> OpId {
        let workspace = if self.rng.chance(workspace_prob) {
            self.size()
        } else {
            0
        };
        let time = 0.1 + self.rng.unit();
        self.g.ops.push(Op {
            name,
            target: "testgen".to_string(),
            phase,
            time,
            workspace,
            inputs,
            outputs,
            differentiates: None,
            random: false,
            mutates_buffer: false,
            module: String::new(),
        });
        self.g.ops.len() - 1
    }

    /// Bytes of the storage behind `t` (views report their root's size, for gradient sizes).
    fn root_bytes(&self, mut t: TensorId) -> u64 {
        while let Some(b) = self.g.tensors[t].alias_of {
            t = b;
        }
        self.g.tensors[t].bytes.max(1)
    }

    /// One gradient from several partial ones (an accumulation op when there are several).
    fn combine(
        &mut self,
        what: TensorId,
        partials: &[TensorId],
        p: &GenParams,
    ) -> Option<TensorId> {
        match partials {
            [] => None,
            [one] => Some(*one),
            many => {
                let name = &self.g.tensors[what].name;
                let out_name = format!("grad_{name}");
                let op_name = format!("accumulate_{name}");
                let bytes = self.root_bytes(what);
                let out = self.tensor(out_name, bytes, Role::Activation, None);
                self.op(
                    op_name,
                    Phase::Backward,
                    many.to_vec(),
                    vec![out],
                    p.workspace_prob,
                );
                Some(out)
            }
        }
    }
}

/// A random valid training graph (see the module docs). `p.n_forward` may be 0 (loss only).
pub fn random_training_graph(seed: u64, p: &GenParams) -> Graph {
    let mut rng = Rng::new(seed);
    let mut b = Builder {
        g: Graph {
            name: format!("testgen_{seed}"),
            time_unit: "s".to_string(),
            ..Graph::default()
        },
        rng: &mut rng,
        max_bytes: p.max_bytes.max(1),
    };
    let x_bytes = b.size();
    let x = b.tensor("x".to_string(), x_bytes, Role::Input, None);
    let params: Vec<TensorId> = (0..p.n_params)
        .map(|k| {
            let s = b.size();
            b.tensor(format!("p{k}"), s, Role::Parameter, None)
        })
        .collect();

    // Forward.
    let mut recent: Vec<TensorId> = vec![x]; // forward values, most recent last
    let mut fwd_ops: Vec<OpId> = Vec::new();
    for j in 0..p.n_forward {
        let n_in = 1 + b.rng.below(p.max_inputs.max(1));
        let mut inputs = vec![*recent.last().unwrap()];
        let lo = recent.len().saturating_sub(p.window.max(1));
        for _ in 1..n_in {
            if !params.is_empty() && b.rng.chance(p.param_read_prob) {
                inputs.push(params[b.rng.below(params.len())]);
            } else {
                inputs.push(recent[lo + b.rng.below(recent.len() - lo)]);
            }
        }
        let mut outputs = Vec::new();
        if b.rng.chance(p.view_prob) {
            outputs.push(b.tensor(format!("v{j}"), 0, Role::Activation, Some(inputs[0])));
        } else {
            let n_out = if b.rng.chance(p.multi_output_prob) {
                2
            } else {
                1
            };
            for k in 0..n_out {
                let s = b.size();
                outputs.push(b.tensor(format!("a{j}_{k}"), s, Role::Activation, None));
            }
        }
        for &t in &outputs {
            if b.rng.chance(p.extra_output_prob) {
                b.g.tensors[t].role = Role::Output;
            }
        }
        let mut mutates = false;
        if b.rng.chance(p.buffer_prob) {
            let s = b.size();
            let buf = b.tensor(format!("buf{j}"), s, Role::Buffer, None);
            let upd = b.tensor(format!("buf{j}_new"), s, Role::BufferUpdate, None);
            b.g.tensors[upd].updates = Some(buf);
            inputs.push(buf);
            outputs.push(upd);
            mutates = true;
        }
        let values: Vec<TensorId> = outputs
            .iter()
            .copied()
            .filter(|&t| b.g.tensors[t].role != Role::BufferUpdate)
            .collect();
        let op = b.op(
            format!("f{j}"),
            Phase::Forward,
            inputs,
            outputs,
            p.workspace_prob,
        );
        b.g.ops[op].mutates_buffer = mutates;
        b.g.ops[op].random = b.rng.chance(p.random_prob);
        fwd_ops.push(op);
        recent.extend(values);
    }
    let loss = b.tensor("loss".to_string(), 4, Role::Output, None);
    let loss_op = b.op(
        "loss_fn".to_string(),
        Phase::Forward,
        vec![*recent.last().unwrap()],
        vec![loss],
        0.0,
    );
    fwd_ops.push(loss_op);

    // Tangents seed the gradients of every output.
    let n_t = b.g.tensors.len();
    let mut partials: Vec<Vec<TensorId>> = vec![Vec::new(); n_t];
    let outputs: Vec<TensorId> = (0..n_t)
        .filter(|&t| b.g.tensors[t].role == Role::Output)
        .collect();
    for t in outputs {
        {
            let name = format!("tangent_{}", b.g.tensors[t].name);
            let bytes = b.root_bytes(t);
            let tg = b.tensor(name, bytes, Role::Tangent, None);
            partials[t].push(tg);
        }
    }
    let needs_grad = |g: &Graph, t: TensorId| match g.tensors[t].role {
        Role::Activation | Role::Output | Role::Parameter => true,
        Role::Input => p.input_grad,
        _ => false,
    };

    // Backward, in reverse forward order.
    for &f in fwd_ops.iter().rev() {
        let outs = b.g.ops[f].outputs.clone();
        let mut out_grads = Vec::new();
        for &o in &outs {
            let parts = std::mem::take(&mut partials[o]);
            if let Some(gr) = b.combine(o, &parts, p) {
                out_grads.push(gr);
            }
        }
        let mut targets: Vec<TensorId> = Vec::new();
        for &t in &b.g.ops[f].inputs {
            if needs_grad(&b.g, t) && !targets.contains(&t) {
                targets.push(t);
            }
        }
        if out_grads.is_empty() || targets.is_empty() {
            continue;
        }
        // Saved tensors: a random subset of the op's inputs and outputs (not buffers/updates).
        let mut inputs = out_grads;
        let fin = b.g.ops[f].inputs.clone();
        for &t in fin.iter().chain(&outs) {
            let role = b.g.tensors[t].role;
            if !matches!(role, Role::Buffer | Role::BufferUpdate)
                && b.rng.chance(0.5)
                && !inputs.contains(&t)
            {
                inputs.push(t);
            }
        }
        let fname = b.g.ops[f].name.clone();
        let mut outputs = Vec::new();
        for &t in &targets {
            let name = format!("d{fname}_{}", b.g.tensors[t].name);
            let bytes = b.root_bytes(t);
            let d = b.tensor(name, bytes, Role::Activation, None);
            partials[t].push(d);
            outputs.push(d);
        }
        let op = b.op(
            format!("{fname}_backward"),
            Phase::Backward,
            inputs,
            outputs,
            p.workspace_prob,
        );
        b.g.ops[op].differentiates = Some(f);
    }

    // Final gradients of parameters and of the input.
    let mut leaves = params.clone();
    if p.input_grad {
        leaves.push(x);
    }
    for leaf in leaves {
        let parts = std::mem::take(&mut partials[leaf]);
        if let Some(gr) = b.combine(leaf, &parts, p) {
            let role = if leaf == x {
                Role::InputGrad
            } else {
                Role::ParamGrad
            };
            b.g.tensors[gr].role = role;
            b.g.tensors[gr].grad_of = Some(leaf);
        }
    }
    b.g
}

/// The same graph with its ops in a random order (ids renumbered, `differentiates` remapped),
/// to exercise code paths for graphs whose op order is not an execution order.
pub fn shuffle_ops(g: &Graph, seed: u64) -> Graph {
    let mut rng = Rng::new(seed);
    let n = g.ops.len();
    let mut perm: Vec<OpId> = (0..n).collect(); // perm[new] = old
    for i in (1..n).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let mut new_of = vec![0; n];
    for (new, &old) in perm.iter().enumerate() {
        new_of[old] = new;
    }
    let mut out = g.clone();
    out.ops = perm
        .iter()
        .map(|&old| {
            let mut op = g.ops[old].clone();
            op.differentiates = op.differentiates.map(|d| new_of[d]);
            op
        })
        .collect();
    out
}
