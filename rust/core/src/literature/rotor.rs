//! Rotor: optimal checkpointing of heterogeneous chains (Beaumont, Eyraud-Dubois, Herrmann,
//! Joly, Shilova), a dynamic program over (first stage, last stage, memory) with memory
//! discretised into slots.
//!
//! Chain model (stages `1..=L`, boundaries `0..=L`):
//! - `a_k`: the output of stage `k` (`a_0` is the chain input, always stored), `x_k` bytes;
//! - `ā_k`: the full state of stage `k` (everything its backward needs, `a_k` included);
//! - `δ_k`: the gradient arriving at boundary `k` (`δ_L` is given, `δ_0` is the result).
//!
//! A stage has one way to compute its output alone and one or more *options* ([`StateOption`])
//! to compute its full state, each with its own state size, forward time and overhead, and the
//! backward time and overhead that go with that state (for instance, the options of a child in
//! a hierarchy level: keep everything, or keep less and recompute some of it in the backward).
//!
//! Operations ([`ChainOp`]): `Forward(k)` computes `a_k` from `a_{k-1}` (stored alone or inside
//! `ā_{k-1}`); `ForwardAll(k, o)` computes `ā_k` with option `o`; `Backward(k)` needs `ā_k`,
//! `a_{k-1}`, `δ_k`, produces `δ_{k-1}` and frees `ā_k` and `δ_k`, with the costs of the option
//! `ā_k` was computed with; `Free(k)` frees a stored `a_k`, which is not allowed while
//! `ā_{k+1}` is stored (a full state holds on to its stage's input, which its backward reads).
//! Memory during an operation is what is stored plus what it creates plus its overhead:
//! `Forward(k)`: `+ x_k + fwd_overhead`; `ForwardAll(k, o)`: `+ state_o + fwd_overhead_o`;
//! `Backward(k)`: `+ grad_{k-1} + bwd_overhead_o`. [`peak_of`] evaluates a sequence exactly.
//!
//! The program minimises total time over strategies that, for a sub-chain `s..=t` holding
//! `a_{s-1}` and `δ_t`, either store the full state of `s` with one of its options and recurse
//! on `s+1..=t`, or run the forward to a checkpoint `a_{s'-1}` (keeping only `a_{s-1}`),
//! recurse on `s'..=t`, free the checkpoint and recurse on `s..=s'-1`.
//! O(L^2 · (L + options) · slots) time, O(L^2 · slots) memory: [`Bounds`] caps the tables
//! (slots are reduced to fit, see [`fit_slots`]) and gives the time limit and cancellation flag
//! the program polls.

use crate::limits::{human_bytes, Stop, TooLarge, MAX_GRAPH_BYTES};

use super::LiteratureError;

/// Default bound on the bytes of the dynamic program's tables (1 GiB).
pub const DEFAULT_MAX_TABLE_BYTES: u64 = 1 << 30;

/// [`solve_refined`] refines the slots only while the tables stay within this (256 MiB), so that
/// refining costs at most a few times the first solve.
pub const REFINE_TABLE_BYTES: u64 = 256 << 20;

/// The fewest slots the program is reduced to when its tables would exceed their bound (fewer
/// only when the caller asks for fewer): below this, rounding sizes up to whole slots loses
/// most budgets.
pub const MIN_SLOTS: usize = 16;

/// Bytes of one table cell: its cost (f64) and its choice (i32).
const CELL_BYTES: u128 = 12;

/// Bounds on one run of the program: the bytes its tables may take, and when to stop.
#[derive(Debug, Clone, Copy)]
pub struct Bounds<'a> {
    pub max_table_bytes: u64,
    pub stop: Stop<'a>,
}

impl Default for Bounds<'_> {
    fn default() -> Self {
        Bounds { max_table_bytes: DEFAULT_MAX_TABLE_BYTES, stop: Stop::never() }
    }
}

/// Number of sub-chains `a..=b` of a chain of `stages` stages (the rows of the tables).
fn sub_chains(stages: usize) -> u128 {
    let l = stages as u128;
    l * (l + 1) / 2
}

/// Bytes of the dynamic program's tables for `stages` stages and `slots` slots.
pub fn table_bytes(stages: usize, slots: usize) -> u128 {
    sub_chains(stages) * (slots as u128 + 1) * CELL_BYTES
}

/// The slots to run with: `slots`, reduced if needed so that the tables fit `max_table_bytes`,
/// but not below [`MIN_SLOTS`] (or `slots` when that is smaller). `TooLarge`, naming the stage
/// count and the bytes needed, when even that does not fit.
pub fn fit_slots(stages: usize, slots: usize, max_table_bytes: u64) -> Result<usize, LiteratureError> {
    if table_bytes(stages, slots) <= u128::from(max_table_bytes) {
        return Ok(slots);
    }
    let floor = slots.min(MIN_SLOTS);
    let per_slot = sub_chains(stages) * CELL_BYTES;
    // table_bytes(stages, s) = per_slot * (s + 1) <= max  <=>  s <= max / per_slot - 1
    let fitting = (u128::from(max_table_bytes) / per_slot).saturating_sub(1);
    if fitting >= floor as u128 {
        return Ok(fitting as usize);
    }
    Err(LiteratureError::TooLarge(TooLarge(format!(
        "Rotor on {stages} stages needs {} for its tables even with {floor} memory slots (more \
         than the {} allowed; its tables grow with stages^2 x slots): raise max_table_bytes, or \
         plan this graph with a method that splits it (hrockmate, twremat)",
        human_bytes(table_bytes(stages, floor)),
        human_bytes(u128::from(max_table_bytes)),
    ))))
}

/// A zero-filled table of `len` cells of `T`, or `TooLarge` when the allocation fails (instead
/// of aborting the process).
fn table<T: Clone>(len: usize, fill: T, what: &str) -> Result<Vec<T>, LiteratureError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        LiteratureError::TooLarge(TooLarge(format!(
            "cannot allocate {} for Rotor's {what}: the machine is out of memory; lower \
             max_table_bytes or the slots",
            human_bytes(len as u128 * std::mem::size_of::<T>() as u128)
        )))
    })?;
    v.resize(len, fill);
    Ok(v)
}

/// Index of the sub-chain `a..=b` (1 <= a <= b <= l) in a triangular table.
#[inline]
fn sub_chain(l: usize, a: usize, b: usize) -> usize {
    (a - 1) * (l + 1) - (a - 1) * a / 2 + (b - a)
}

/// One way to run a stage's forward while keeping everything its backward needs (its full
/// state `ā_k`), with the backward that goes with it. Times in any unit; sizes in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct StateOption {
    /// Time of `ForwardAll` with this option.
    pub fwd_time: f64,
    /// Bytes of the full state kept by this option (includes the stage output; raised to
    /// `out_bytes` if smaller).
    pub state_bytes: u64,
    /// Extra bytes during `ForwardAll` beyond what is stored and the full state.
    pub fwd_overhead: u64,
    /// Time of `Backward` from this option's full state.
    pub bwd_time: f64,
    /// Extra bytes during `Backward` beyond what is stored and the gradient produced.
    pub bwd_overhead: u64,
}

/// One stage of a chain. Times in any unit; sizes in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Time of `Forward` (compute the output only).
    pub fwd_time: f64,
    /// `x_k`: bytes of the stage output.
    pub out_bytes: u64,
    /// Bytes of the gradient this stage's backward produces (`δ_{k-1}`).
    pub grad_bytes: u64,
    /// Extra bytes during `Forward` beyond what is stored and the output.
    pub fwd_overhead: u64,
    /// The ways to keep the full state (at least one; `ForwardAll(k, o)` picks `options[o]`).
    pub options: Vec<StateOption>,
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

/// One operation of a chain schedule (stages are numbered from 1, options from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainOp {
    Forward(usize),
    /// Compute the full state of stage `k` with its option `o`.
    ForwardAll(usize, usize),
    /// The backward of stage `k`, with the option its stored full state was computed with.
    Backward(usize),
    /// Free the stored output `a_k` of stage `k`.
    Free(usize),
}

/// The option used by each operation of a valid sequence: `Some(o)` for `ForwardAll(_, o)` and
/// for the `Backward` that consumes that full state, `None` otherwise (and for a `Backward`
/// with no full state before it).
pub fn op_options(ops: &[ChainOp]) -> Vec<Option<usize>> {
    let mut stored: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    ops.iter()
        .map(|&op| match op {
            ChainOp::ForwardAll(k, o) => {
                stored.insert(k, o);
                Some(o)
            }
            ChainOp::Backward(k) => stored.remove(&k),
            _ => None,
        })
        .collect()
}

/// The result of the dynamic program.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainSolution {
    pub ops: Vec<ChainOp>,
    /// Total time of `ops`.
    pub time: f64,
    /// Exact peak of `ops` in the chain model (bytes).
    pub peak_bytes: u64,
    /// The memory slots the program ran with (fewer than asked when its tables had to fit
    /// their bound).
    pub slots: usize,
}

/// Simulate `ops` on `chain` in the chain model: `Ok((peak bytes, time))`, or an error naming
/// the first operation whose requirements do not hold.
pub fn peak_of(chain: &Chain, ops: &[ChainOp]) -> Result<(u64, f64), String> {
    check_sizes(chain).map_err(|e| e.to_string())?;
    let l = chain.stages.len();
    let st = |k: usize| &chain.stages[k - 1];
    let x = |k: usize| if k == 0 { chain.input_bytes } else { st(k).out_bytes };
    let xb = |k: usize, o: usize| st(k).options[o].state_bytes.max(st(k).out_bytes);
    let mut a = vec![false; l + 1];
    // The option of each stored full state.
    let mut abar: Vec<Option<usize>> = vec![None; l + 1];
    a[0] = true;
    let mut delta = l;
    let mut cur = chain.input_bytes + chain.final_grad_bytes;
    let mut peak = cur;
    let mut time = 0.0;
    let has_input = |a: &[bool], abar: &[Option<usize>], k: usize| a[k - 1] || abar[k - 1].is_some();
    for (i, &op) in ops.iter().enumerate() {
        let bad = |m: &str| Err(format!("operation {i} ({op:?}): {m}"));
        match op {
            ChainOp::Forward(k) | ChainOp::ForwardAll(k, _) => {
                if k == 0 || k > l {
                    return bad("no such stage");
                }
                if !has_input(&a, &abar, k) {
                    return bad("its input is not stored");
                }
                if a[k] || abar[k].is_some() {
                    return bad("its result is already stored");
                }
                match op {
                    ChainOp::ForwardAll(_, o) => {
                        let Some(opt) = st(k).options.get(o) else {
                            return bad(&format!("no such option (the stage has {})", st(k).options.len()));
                        };
                        peak = peak.max(cur + xb(k, o) + opt.fwd_overhead);
                        cur += xb(k, o);
                        abar[k] = Some(o);
                        time += opt.fwd_time;
                    }
                    _ => {
                        peak = peak.max(cur + x(k) + st(k).fwd_overhead);
                        cur += x(k);
                        a[k] = true;
                        time += st(k).fwd_time;
                    }
                }
            }
            ChainOp::Backward(k) => {
                if k == 0 || k > l || delta != k {
                    return bad("the gradient it needs is not available");
                }
                let Some(o) = abar[k].filter(|_| has_input(&a, &abar, k)) else {
                    return bad("its full state or its input is not stored");
                };
                let opt = &st(k).options[o];
                peak = peak.max(cur + st(k).grad_bytes + opt.bwd_overhead);
                let g_k = if k == l { chain.final_grad_bytes } else { st(k + 1).grad_bytes };
                cur = cur + st(k).grad_bytes - xb(k, o) - g_k;
                abar[k] = None;
                delta = k - 1;
                time += opt.bwd_time;
            }
            ChainOp::Free(k) => {
                if k == 0 || k > l || !a[k] {
                    return bad("that output is not stored on its own");
                }
                if k < l && abar[k + 1].is_some() {
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

/// Choice table entries: 0 none, `sp > 0` checkpoint before stage `sp`, negative: store the
/// full state with option `-1 - choice`.
const NO_CHOICE: i32 = 0;

fn store_all_choice(o: usize) -> i32 {
    -1 - o as i32
}

/// Sizes of one state option in slots.
struct OptionSlots {
    /// Full state (raised to the output).
    xb: usize,
    /// `ForwardAll` overhead.
    foa: usize,
    /// `Backward` overhead.
    bo: usize,
}

/// Chain sizes in slots (rounded up), 1-based like the model.
struct Slots {
    x: Vec<usize>,
    g: Vec<usize>,
    fo: Vec<usize>,
    opts: Vec<Vec<OptionSlots>>,
}

impl Slots {
    fn new(chain: &Chain, slot: u64) -> Slots {
        let l = chain.stages.len();
        let q = |b: u64| b.div_ceil(slot) as usize;
        let mut s = Slots { x: vec![0; l + 1], g: vec![0; l + 1], fo: vec![0; l + 1], opts: Vec::with_capacity(l + 1) };
        s.opts.push(Vec::new());
        s.x[0] = q(chain.input_bytes);
        s.g[l] = q(chain.final_grad_bytes);
        for (i, st) in chain.stages.iter().enumerate() {
            let k = i + 1;
            s.x[k] = q(st.out_bytes);
            s.g[k - 1] = q(st.grad_bytes);
            s.fo[k] = q(st.fwd_overhead);
            s.opts.push(
                st.options
                    .iter()
                    .map(|o| OptionSlots {
                        xb: q(o.state_bytes.max(st.out_bytes)),
                        foa: q(o.fwd_overhead),
                        bo: q(o.bwd_overhead),
                    })
                    .collect(),
            );
        }
        s
    }

    /// Memory needed by storing the full state of `s` with option `o` (given what the
    /// sub-chain `s+1..=t` needs).
    fn store_all_need(&self, s: usize, t: usize, o: usize) -> usize {
        let op = &self.opts[s][o];
        let fwd = self.x[s - 1] + self.g[t] + op.xb + op.foa;
        let bwd = self.x[s - 1] + op.xb + self.g[s] + self.g[s - 1] + op.bo;
        fwd.max(bwd)
    }

    /// What the sub-chain `s+1..=t` runs beside when the full state of `s` (option `o`) is
    /// stored: `a_{s-1}` and `ā_s` minus its output `a_s` (counted by the sub-chain).
    fn store_all_outside(&self, s: usize, o: usize) -> usize {
        self.x[s - 1] + self.opts[s][o].xb - self.x[s]
    }

    /// Peak of running the forward from `a_{s-1}` through stage `k` keeping `a_{s-1}`
    /// (only stage `k`'s own step; the running max is taken by the caller).
    fn forward_step_need(&self, s: usize, t: usize, k: usize) -> usize {
        let prev = if k == s { 0 } else { self.x[k - 1] };
        self.g[t] + self.x[s - 1] + prev + self.x[k] + self.fo[k]
    }
}

/// The smallest memory (bytes) with which the chain can be processed in the model, over the
/// strategies the dynamic program considers. Exact (no discretisation). Errors for an invalid
/// chain, or when its table (stages² / 2 × 8 bytes) exceeds [`DEFAULT_MAX_TABLE_BYTES`].
pub fn min_memory(chain: &Chain) -> Result<u64, LiteratureError> {
    min_memory_within(chain, &Bounds::default())
}

/// [`min_memory`] within `bounds` (O(L³) time: it polls `bounds.stop`).
pub fn min_memory_within(chain: &Chain, bounds: &Bounds) -> Result<u64, LiteratureError> {
    check_chain(chain)?;
    let l = chain.stages.len();
    if l == 0 {
        return Ok(chain.input_bytes + chain.final_grad_bytes);
    }
    let needed = sub_chains(l) * 8;
    if needed > u128::from(bounds.max_table_bytes) {
        return Err(LiteratureError::TooLarge(TooLarge(format!(
            "the smallest memory of a Rotor chain of {l} stages needs a table of {} (more than the \
             {} allowed): raise max_table_bytes, or plan with a method that splits the graph",
            human_bytes(needed),
            human_bytes(u128::from(bounds.max_table_bytes))
        ))));
    }
    let s = Slots::new(chain, 1);
    let mut mm: Vec<usize> = table(sub_chains(l) as usize, usize::MAX, "minimum-memory table")?;
    let idx = |a: usize, b: usize| sub_chain(l, a, b);
    for len in 0..l {
        bounds.stop.check()?;
        for a in 1..=l - len {
            let b = a + len;
            if a % 256 == 0 {
                bounds.stop.check()?;
            }
            let mut best = usize::MAX;
            for o in 0..s.opts[a].len() {
                let mut need = s.store_all_need(a, b, o);
                if a < b {
                    let rest = mm[idx(a + 1, b)];
                    need = if rest == usize::MAX {
                        usize::MAX
                    } else {
                        need.max((rest + s.x[a - 1] + s.opts[a][o].xb).saturating_sub(s.x[a]))
                    };
                }
                best = best.min(need);
            }
            if a < b {
                let mut fpeak = 0;
                for sp in a + 1..=b {
                    fpeak = fpeak.max(s.forward_step_need(a, b, sp - 1));
                    let need = fpeak.max(mm[idx(sp, b)].saturating_add(s.x[a - 1])).max(mm[idx(a, sp - 1)]);
                    best = best.min(need);
                }
            }
            mm[idx(a, b)] = best;
        }
    }
    Ok(mm[idx(1, l)] as u64)
}

fn check_time(where_: &str, what: &str, v: f64) -> Result<(), LiteratureError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(LiteratureError::InvalidArgument(format!("{where_}: {what} is {v}; times must be finite and >= 0")))
    }
}

/// The sizes of a chain must add up to at most [`MAX_GRAPH_BYTES`] (as a graph's): then every
/// memory figure of the model is exact in `u64`. The error names the stage where the running
/// sum passes it.
fn check_sizes(chain: &Chain) -> Result<(), LiteratureError> {
    let past = |k: usize| {
        LiteratureError::InvalidArgument(format!(
            "the chain's sizes add up past 2^62-1 bytes (4 EiB) at stage {k} (the input and final \
             gradient, then every stage's output, gradient, overhead and options), more than \
             Rotor adds up exactly; check the units of the sizes"
        ))
    };
    let mut total = u128::from(chain.input_bytes) + u128::from(chain.final_grad_bytes);
    for (i, st) in chain.stages.iter().enumerate() {
        total += u128::from(st.out_bytes) + u128::from(st.grad_bytes) + u128::from(st.fwd_overhead);
        for o in &st.options {
            total += u128::from(o.state_bytes) + u128::from(o.fwd_overhead) + u128::from(o.bwd_overhead);
        }
        if total > u128::from(MAX_GRAPH_BYTES) {
            return Err(past(i + 1));
        }
    }
    if total > u128::from(MAX_GRAPH_BYTES) {
        return Err(past(0));
    }
    Ok(())
}

/// A chain the program can run on: finite times >= 0, at least one option per stage, sizes
/// within [`check_sizes`]. Errors name the stage and field.
fn check_chain(chain: &Chain) -> Result<(), LiteratureError> {
    for (i, st) in chain.stages.iter().enumerate() {
        let k = i + 1;
        check_time(&format!("stage {k}"), "fwd_time", st.fwd_time)?;
        if st.options.is_empty() {
            return Err(LiteratureError::InvalidArgument(format!(
                "stage {k} has no state option; give each stage at least one"
            )));
        }
        if st.options.len() > i32::MAX as usize {
            return Err(LiteratureError::InvalidArgument(format!("stage {k} has too many state options")));
        }
        for (o, opt) in st.options.iter().enumerate() {
            check_time(&format!("stage {k} option {o}"), "fwd_time", opt.fwd_time)?;
            check_time(&format!("stage {k} option {o}"), "bwd_time", opt.bwd_time)?;
        }
    }
    check_sizes(chain)
}

/// Solve the chain for a memory limit with `slots` memory slots (`limit_bytes / slots` bytes
/// each; sizes are rounded up to whole slots, so the result never exceeds the limit), within
/// the default [`Bounds`].
/// The returned sequence is optimal for the discretised sizes, over every option of every
/// stage (ties go to the lower option index).
pub fn solve(chain: &Chain, limit_bytes: u64, slots: usize) -> Result<ChainSolution, LiteratureError> {
    solve_within(chain, limit_bytes, slots, &Bounds::default())
}

/// [`solve`] within `bounds`: the slots are reduced when the tables would exceed
/// `bounds.max_table_bytes` ([`fit_slots`]; [`ChainSolution::slots`] says how many were used),
/// and the program stops with `Stopped` when `bounds.stop` says so.
pub fn solve_within(
    chain: &Chain,
    limit_bytes: u64,
    slots: usize,
    bounds: &Bounds,
) -> Result<ChainSolution, LiteratureError> {
    if slots == 0 {
        return Err(LiteratureError::InvalidArgument("slots must be at least 1".into()));
    }
    check_chain(chain)?;
    let l = chain.stages.len();
    let infeasible = |detail: String| match min_memory_within(chain, bounds) {
        Ok(min_bytes) => LiteratureError::Infeasible { limit_bytes, min_bytes, detail },
        Err(e) => e,
    };
    if l == 0 {
        if chain.input_bytes + chain.final_grad_bytes > limit_bytes {
            return Err(infeasible("the chain input and gradient alone exceed it".into()));
        }
        let peak_bytes = chain.input_bytes + chain.final_grad_bytes;
        return Ok(ChainSolution { ops: Vec::new(), time: 0.0, peak_bytes, slots });
    }
    let slots = fit_slots(l, slots, bounds.max_table_bytes)?;
    let slot = limit_bytes.div_ceil(slots as u64).max(1);
    let m_max = (limit_bytes / slot) as usize;
    let s = Slots::new(chain, slot);
    let w = m_max + 1;
    let cell = |a: usize, b: usize, m: usize| sub_chain(l, a, b) * w + m;
    let cells = sub_chains(l) as usize * w;
    let mut cost = table(cells, f64::INFINITY, "cost table")?;
    let mut choice = table(cells, NO_CHOICE, "choice table")?;
    let st = |k: usize| &chain.stages[k - 1];

    for len in 0..l {
        bounds.stop.check()?;
        for a in 1..=l - len {
            let b = a + len;
            // A sub-chain costs O(len * slots): poll every few of them.
            if a % 64 == 0 {
                bounds.stop.check()?;
            }
            let here = cell(a, b, 0);
            // Store the full state of stage a, with each of its options.
            for (o, opt) in st(a).options.iter().enumerate() {
                let need_a = s.store_all_need(a, b, o);
                let outside = s.store_all_outside(a, o);
                for m in need_a.max(if a < b { outside } else { 0 })..w {
                    let c = if a == b {
                        opt.fwd_time + opt.bwd_time
                    } else {
                        opt.fwd_time + cost[cell(a + 1, b, m - outside)] + opt.bwd_time
                    };
                    if c < cost[here + m] {
                        cost[here + m] = c;
                        choice[here + m] = store_all_choice(o);
                    }
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
            c if c < 0 => {
                let o = (-1 - c) as usize;
                ops.push(ChainOp::ForwardAll(a, o));
                tasks.push(Task::Emit(ChainOp::Backward(a)));
                if a < b {
                    tasks.push(Task::Solve(a + 1, b, m - s.store_all_outside(a, o)));
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
    Ok(ChainSolution { ops, time, peak_bytes, slots })
}

/// [`solve_within`], refining the slots (x4, while the tables stay within
/// [`REFINE_TABLE_BYTES`] and `bounds.max_table_bytes`) when rounding sizes up to slots makes a
/// limit fail that the exact model meets (`limit_bytes >= min_memory`). With large enough
/// tables the limit then always succeeds, since one byte per slot is exact.
pub fn solve_refined(
    chain: &Chain,
    limit_bytes: u64,
    slots: usize,
    bounds: &Bounds,
) -> Result<ChainSolution, LiteratureError> {
    let l = chain.stages.len().max(1);
    let refine_bytes = u128::from(REFINE_TABLE_BYTES.min(bounds.max_table_bytes));
    let mut slots = slots;
    loop {
        match solve_within(chain, limit_bytes, slots, bounds) {
            Err(LiteratureError::Infeasible { min_bytes, .. })
                if limit_bytes >= min_bytes
                    // Beyond one byte per slot nothing changes.
                    && (slots as u64) < limit_bytes
                    && table_bytes(l, slots.saturating_mul(4)) <= refine_bytes =>
            {
                slots *= 4;
            }
            other => return other,
        }
    }
}
