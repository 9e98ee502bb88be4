//! Rotor: optimal checkpointing of heterogeneous chains (Beaumont, Eyraud-Dubois, Herrmann,
//! Joly, Shilova), a dynamic program over (first stage, last stage, memory) with memory
//! discretised into slots.
//!
//! Chain model (stages `1..=L`, boundaries `0..=L`):
//! - `a_k`: the output of stage `k` (`a_0` is the chain input, always stored), `x_k` bytes;
//! - `ā_k`: the full state of stage `k` (everything its backward needs, `a_k` included);
//! - `δ_k`: the gradient arriving at boundary `k` (`δ_L` is given, `δ_0` is the result).
//!
//! Operations ([`ChainOp`]): `Forward(k)` computes `a_k` from `a_{k-1}` (stored alone or inside
//! `ā_{k-1}`); `ForwardAll(k)` computes `ā_k`; `Backward(k)` needs `ā_k`, `a_{k-1}`, `δ_k`,
//! produces `δ_{k-1}` and frees `ā_k` and `δ_k`; `Free(k)` frees a stored `a_k`, which is not
//! allowed while `ā_{k+1}` is stored (a full state holds on to its stage's input, which its
//! backward reads).
//! Memory during an operation is what is stored plus what it creates plus its overhead:
//! `Forward(k)`: `+ x_k + fwd_overhead`; `ForwardAll(k)`: `+ state_k + fwd_all_overhead`;
//! `Backward(k)`: `+ grad_{k-1} + bwd_overhead`. [`peak_of`] evaluates a sequence exactly.
//!
//! The program minimises total time over strategies that, for a sub-chain `s..=t` holding
//! `a_{s-1}` and `δ_t`, either store the full state of `s` and recurse on `s+1..=t`, or run the
//! forward to a checkpoint `a_{s'-1}` (keeping only `a_{s-1}`), recurse on `s'..=t`, free the
//! checkpoint and recurse on `s..=s'-1`. O(L^3 · slots) time, O(L^2 · slots) memory.

use super::LiteratureError;

/// One stage of a chain. Times in any unit; sizes in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Time of `Forward` (compute the output only).
    pub fwd_time: f64,
    /// Time of `ForwardAll` (compute and keep the full state).
    pub fwd_all_time: f64,
    pub bwd_time: f64,
    /// `x_k`: bytes of the stage output.
    pub out_bytes: u64,
    /// Bytes of the full state (`ā_k`, includes the output; raised to `out_bytes` if smaller).
    pub state_bytes: u64,
    /// Bytes of the gradient this stage's backward produces (`δ_{k-1}`).
    pub grad_bytes: u64,
    /// Extra bytes during `Forward` beyond what is stored and the output.
    pub fwd_overhead: u64,
    /// Extra bytes during `ForwardAll` beyond what is stored and the full state.
    pub fwd_all_overhead: u64,
    /// Extra bytes during `Backward` beyond what is stored and the gradient produced.
    pub bwd_overhead: u64,
}

/// A heterogeneous chain.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    /// `x_0`: bytes of the chain input (stored for the whole run; 0 if pre-existing).
    pub input_bytes: u64,
    /// `δ_L`: bytes of the gradient given to the last stage (0 if pre-existing).
    pub final_grad_bytes: u64,
    pub stages: Vec<Stage>,
}

/// One operation of a chain schedule (stages are numbered from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainOp {
    Forward(usize),
    ForwardAll(usize),
    Backward(usize),
    /// Free the stored output `a_k` of stage `k`.
    Free(usize),
}

/// The result of the dynamic program.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainSolution {
    pub ops: Vec<ChainOp>,
    /// Total time of `ops`.
    pub time: f64,
    /// Exact peak of `ops` in the chain model (bytes).
    pub peak_bytes: u64,
}

/// Simulate `ops` on `chain` in the chain model: `Ok((peak bytes, time))`, or an error naming
/// the first operation whose requirements do not hold.
pub fn peak_of(chain: &Chain, ops: &[ChainOp]) -> Result<(u64, f64), String> {
    let l = chain.stages.len();
    let st = |k: usize| &chain.stages[k - 1];
    let x = |k: usize| if k == 0 { chain.input_bytes } else { st(k).out_bytes };
    let xb = |k: usize| st(k).state_bytes.max(st(k).out_bytes);
    let mut a = vec![false; l + 1];
    let mut abar = vec![false; l + 1];
    a[0] = true;
    let mut delta = l;
    let mut cur = chain.input_bytes + chain.final_grad_bytes;
    let mut peak = cur;
    let mut time = 0.0;
    let has_input = |a: &[bool], abar: &[bool], k: usize| a[k - 1] || abar[k - 1];
    for (i, &op) in ops.iter().enumerate() {
        let bad = |m: &str| Err(format!("operation {i} ({op:?}): {m}"));
        match op {
            ChainOp::Forward(k) | ChainOp::ForwardAll(k) => {
                if k == 0 || k > l {
                    return bad("no such stage");
                }
                if !has_input(&a, &abar, k) {
                    return bad("its input is not stored");
                }
                if a[k] || abar[k] {
                    return bad("its result is already stored");
                }
                if let ChainOp::Forward(_) = op {
                    peak = peak.max(cur + x(k) + st(k).fwd_overhead);
                    cur += x(k);
                    a[k] = true;
                    time += st(k).fwd_time;
                } else {
                    peak = peak.max(cur + xb(k) + st(k).fwd_all_overhead);
                    cur += xb(k);
                    abar[k] = true;
                    time += st(k).fwd_all_time;
                }
            }
            ChainOp::Backward(k) => {
                if k == 0 || k > l || delta != k {
                    return bad("the gradient it needs is not available");
                }
                if !abar[k] || !has_input(&a, &abar, k) {
                    return bad("its full state or its input is not stored");
                }
                peak = peak.max(cur + st(k).grad_bytes + st(k).bwd_overhead);
                let g_k = if k == l { chain.final_grad_bytes } else { st(k + 1).grad_bytes };
                cur = cur + st(k).grad_bytes - xb(k) - g_k;
                abar[k] = false;
                delta = k - 1;
                time += st(k).bwd_time;
            }
            ChainOp::Free(k) => {
                if k == 0 || k > l || !a[k] {
                    return bad("that output is not stored on its own");
                }
                if k < l && abar[k + 1] {
                    return bad("the full state of the next stage is stored and its backward needs this input");
                }
                a[k] = false;
                cur -= x(k);
            }
        }
    }
    if delta != 0 {
        return Err(format!("the sequence ends before the backward of stage {} ran", delta.max(1)));
    }
    Ok((peak, time))
}

const NO_CHOICE: i32 = 0;
const STORE_ALL: i32 = -1;

/// Chain sizes in slots (rounded up), 1-based like the model.
struct Slots {
    x: Vec<usize>,
    xb: Vec<usize>,
    g: Vec<usize>,
    fo: Vec<usize>,
    foa: Vec<usize>,
    bo: Vec<usize>,
}

impl Slots {
    fn new(chain: &Chain, slot: u64) -> Slots {
        let l = chain.stages.len();
        let q = |b: u64| b.div_ceil(slot) as usize;
        let mut s = Slots {
            x: vec![0; l + 1],
            xb: vec![0; l + 1],
            g: vec![0; l + 1],
            fo: vec![0; l + 1],
            foa: vec![0; l + 1],
            bo: vec![0; l + 1],
        };
        s.x[0] = q(chain.input_bytes);
        s.g[l] = q(chain.final_grad_bytes);
        for (i, st) in chain.stages.iter().enumerate() {
            let k = i + 1;
            s.x[k] = q(st.out_bytes);
            s.xb[k] = q(st.state_bytes.max(st.out_bytes));
            s.g[k - 1] = q(st.grad_bytes);
            s.fo[k] = q(st.fwd_overhead);
            s.foa[k] = q(st.fwd_all_overhead);
            s.bo[k] = q(st.bwd_overhead);
        }
        s
    }

    /// Memory needed by storing the full state of `s` (given what the sub-chain `s+1..=t` needs).
    fn store_all_need(&self, s: usize, t: usize) -> usize {
        let fwd = self.x[s - 1] + self.g[t] + self.xb[s] + self.foa[s];
        let bwd = self.x[s - 1] + self.xb[s] + self.g[s] + self.g[s - 1] + self.bo[s];
        fwd.max(bwd)
    }

    /// Peak of running the forward from `a_{s-1}` through stage `k` keeping `a_{s-1}`
    /// (only stage `k`'s own step; the running max is taken by the caller).
    fn forward_step_need(&self, s: usize, t: usize, k: usize) -> usize {
        let prev = if k == s { 0 } else { self.x[k - 1] };
        self.g[t] + self.x[s - 1] + prev + self.x[k] + self.fo[k]
    }
}

/// The smallest memory (bytes) with which the chain can be processed in the model, over the
/// strategies the dynamic program considers. Exact (no discretisation).
pub fn min_memory(chain: &Chain) -> u64 {
    let l = chain.stages.len();
    if l == 0 {
        return chain.input_bytes + chain.final_grad_bytes;
    }
    let s = Slots::new(chain, 1);
    let mut mm = vec![usize::MAX; (l + 1) * (l + 1)];
    let idx = |a: usize, b: usize| a * (l + 1) + b;
    for len in 0..l {
        for a in 1..=l - len {
            let b = a + len;
            let mut best = s.store_all_need(a, b);
            if a < b {
                best = best.max((mm[idx(a + 1, b)] + s.x[a - 1] + s.xb[a]).saturating_sub(s.x[a]));
                let mut fpeak = 0;
                for sp in a + 1..=b {
                    fpeak = fpeak.max(s.forward_step_need(a, b, sp - 1));
                    let need = fpeak.max(mm[idx(sp, b)] + s.x[a - 1]).max(mm[idx(a, sp - 1)]);
                    best = best.min(need);
                }
            }
            mm[idx(a, b)] = best;
        }
    }
    mm[idx(1, l)] as u64
}

/// Solve the chain for a memory limit with `slots` memory slots (`limit_bytes / slots` bytes
/// each; sizes are rounded up to whole slots, so the result never exceeds the limit).
/// The returned sequence is optimal for the discretised sizes.
pub fn solve(chain: &Chain, limit_bytes: u64, slots: usize) -> Result<ChainSolution, LiteratureError> {
    if slots == 0 {
        return Err(LiteratureError::InvalidArgument("slots must be at least 1".into()));
    }
    for (i, st) in chain.stages.iter().enumerate() {
        for (what, v) in [("fwd_time", st.fwd_time), ("fwd_all_time", st.fwd_all_time), ("bwd_time", st.bwd_time)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(LiteratureError::InvalidArgument(format!(
                    "stage {}: {what} is {v}; times must be finite and >= 0",
                    i + 1
                )));
            }
        }
    }
    let l = chain.stages.len();
    let infeasible = |detail: String| LiteratureError::Infeasible {
        limit_bytes,
        min_bytes: min_memory(chain),
        detail,
    };
    if l == 0 {
        if chain.input_bytes + chain.final_grad_bytes > limit_bytes {
            return Err(infeasible("the chain input and gradient alone exceed it".into()));
        }
        return Ok(ChainSolution { ops: Vec::new(), time: 0.0, peak_bytes: chain.input_bytes + chain.final_grad_bytes });
    }
    let slot = limit_bytes.div_ceil(slots as u64).max(1);
    let m_max = (limit_bytes / slot) as usize;
    let s = Slots::new(chain, slot);
    let w = m_max + 1;
    let cell = |a: usize, b: usize, m: usize| ((a - 1) * l + (b - 1)) * w + m;
    let mut cost = vec![f64::INFINITY; l * l * w];
    let mut choice = vec![NO_CHOICE; l * l * w];
    let st = |k: usize| &chain.stages[k - 1];

    for len in 0..l {
        for a in 1..=l - len {
            let b = a + len;
            let here = cell(a, b, 0);
            // Store the full state of stage a.
            let need_a = s.store_all_need(a, b);
            // The rest runs beside a_{a-1} and ā_a minus its output a_a.
            let outside = s.x[a - 1] + s.xb[a] - s.x[a];
            for m in need_a.max(if a < b { outside } else { 0 })..w {
                let c = if a == b {
                    st(a).fwd_all_time + st(a).bwd_time
                } else {
                    st(a).fwd_all_time + cost[cell(a + 1, b, m - outside)] + st(a).bwd_time
                };
                if c < cost[here + m] {
                    cost[here + m] = c;
                    choice[here + m] = STORE_ALL;
                }
            }
            // Forward to a checkpoint a_{sp-1}, keeping only a_{a-1}.
            let mut fpeak = s.x[a - 1];
            let mut ftime = 0.0;
            for sp in a + 1..=b {
                fpeak = fpeak.max(s.forward_step_need(a, b, sp - 1));
                ftime += st(sp - 1).fwd_time;
                if fpeak >= w {
                    break;
                }
                let right = cell(sp, b, 0);
                let left = cell(a, sp - 1, 0);
                for m in fpeak..w {
                    let c = ftime + cost[right + m - s.x[a - 1]] + cost[left + m];
                    if c < cost[here + m] {
                        cost[here + m] = c;
                        choice[here + m] = sp as i32;
                    }
                }
            }
        }
    }
    if !cost[cell(1, l, m_max)].is_finite() {
        return Err(infeasible(format!("{slots} slots of {slot} bytes")));
    }
    let mut ops = Vec::new();
    // Explicit stack of sub-chains (a, b, m) to expand, or of operations to emit after them.
    enum Task {
        Solve(usize, usize, usize),
        Emit(ChainOp),
    }
    let mut tasks = vec![Task::Solve(1, l, m_max)];
    while let Some(task) = tasks.pop() {
        let (a, b, m) = match task {
            Task::Emit(op) => {
                ops.push(op);
                continue;
            }
            Task::Solve(a, b, m) => (a, b, m),
        };
        match choice[cell(a, b, m)] {
            STORE_ALL => {
                ops.push(ChainOp::ForwardAll(a));
                tasks.push(Task::Emit(ChainOp::Backward(a)));
                if a < b {
                    tasks.push(Task::Solve(a + 1, b, m - (s.x[a - 1] + s.xb[a] - s.x[a])));
                }
            }
            sp if sp > 0 => {
                let sp = sp as usize;
                ops.push(ChainOp::Forward(a));
                for k in a + 1..sp {
                    ops.push(ChainOp::Forward(k));
                    ops.push(ChainOp::Free(k - 1));
                }
                // Pushed in reverse: right part, free the checkpoint, left part.
                tasks.push(Task::Solve(a, sp - 1, m));
                tasks.push(Task::Emit(ChainOp::Free(sp - 1)));
                tasks.push(Task::Solve(sp, b, m - s.x[a - 1]));
            }
            _ => return Err(LiteratureError::Internal(format!("no choice recorded for stages {a}..={b}"))),
        }
    }
    let (peak_bytes, time) = peak_of(chain, &ops).map_err(LiteratureError::Internal)?;
    Ok(ChainSolution { ops, time, peak_bytes })
}
