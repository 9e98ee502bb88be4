//! Greedy eviction planned ahead, in the style of dynamic tensor rematerialization (DTR,
//! Kirisame et al., ICLR 2021): run the ops in [`execution_order`]; before an op whose new
//! storages would pass the budget, evict the alive storage with the smallest score (its
//! [`EvictionScore`]); a value needed again after its eviction is recomputed from what is
//! alive, recursively. It needs no structure (no pairing, no chain, no blocks), so it serves
//! graphs with long skips that the block strategies cannot cut.
//!
//! Memory is the simulator's ([`crate::memory::Memory`]): an op is computed, and when the
//! memory during its step passes the budget its new outputs are released again, a storage is
//! evicted, and it is tried again; so a schedule it returns is within the budget by
//! construction. A storage is evicted with every alive tensor on it, and only when all of them
//! may be evicted (forward values, not outputs). Storages rooted at pre-existing tensors are
//! never counted.

use crate::graph::{Graph, OpId, Phase, Role, TensorId};
use crate::limits::{Stop, Stopped, MAX_SCHEDULE_STEPS};
use crate::memory::{Memory, NOT_ALIVE, UNCOUNTED};
use crate::schedule::{Schedule, Step};
use crate::schedules::execution_order;

/// Which alive storage greedy eviction gives up first: the one with the smallest recompute
/// time / (bytes x a [`Distance`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionScore {
    pub distance: Distance,
    /// Whether the recompute time also counts the producers of the value's inputs that are
    /// not alive (one level of what undoing the eviction would recompute, as DTR's evicted
    /// neighbourhood does); else only the value's own producer.
    pub with_inputs: bool,
}

/// The distance in an [`EvictionScore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Distance {
    /// The ops run since the storage's last use (DTR's staleness: all an online method knows).
    Staleness,
    /// The ops until its next use in the op order (known ahead of time: a storage not read
    /// again until the backward goes before one read by the next op, as in Belady's rule).
    NextUse,
}

impl EvictionScore {
    /// DTR's score: staleness, the value's own producer.
    pub const DTR: EvictionScore = EvictionScore { distance: Distance::Staleness, with_inputs: false };

    /// Every score, by name: `staleness` or `next_use`, with `+inputs` for `with_inputs`.
    pub const NAMES: [&'static str; 4] = ["staleness", "next_use", "staleness+inputs", "next_use+inputs"];

    /// The score a name of [`Self::NAMES`] stands for.
    pub fn from_name(name: &str) -> Option<EvictionScore> {
        let (base, with_inputs) = match name.strip_suffix("+inputs") {
            Some(base) => (base, true),
            None => (name, false),
        };
        let distance = match base {
            "staleness" => Distance::Staleness,
            "next_use" => Distance::NextUse,
            _ => return None,
        };
        Some(EvictionScore { distance, with_inputs })
    }
}

struct State<'g> {
    g: &'g Graph,
    score: EvictionScore,
    /// Per tensor, the positions in the op order of the ops that read it (ascending).
    reads_at: Vec<Vec<u32>>,
    /// The position in the op order of the op being made ready.
    pos: u32,
    roots: Vec<TensorId>,
    producer: Vec<Option<OpId>>,
    evictable: Vec<bool>,
    mem: Memory<Vec<u32>>,
    /// Alive tensors on each counted storage instance (indexed by the instance).
    inst_tensors: Vec<Vec<TensorId>>,
    /// Instances with alive tensors, for the eviction scan.
    live_insts: Vec<u32>,
    budget: u64,
    last_access: Vec<u64>,
    clock: u64,
    steps: Vec<Step>,
    /// Scratch: tensors that may not be evicted now.
    locked: Vec<bool>,
}

impl State<'_> {
    fn alive(&self, x: TensorId) -> bool {
        self.mem.is_alive(x)
    }

    /// The position in the op order of the next op at or after the current one that reads
    /// `x` (u32::MAX when none does).
    fn next_read(&self, x: TensorId) -> u32 {
        let reads = &self.reads_at[x];
        let k = reads.partition_point(|&p| p < self.pos);
        reads.get(k).copied().unwrap_or(u32::MAX)
    }

    fn free(&mut self, x: TensorId) {
        let inst = self.mem.instance(x);
        self.mem.release(x);
        self.steps.push(Step::Free(x));
        if inst != UNCOUNTED && inst != NOT_ALIVE {
            let held = &mut self.inst_tensors[inst as usize];
            held.retain(|&y| y != x);
            if held.is_empty() {
                if let Some(k) = self.live_insts.iter().position(|&i| i == inst) {
                    self.live_insts.swap_remove(k);
                }
            }
        }
    }

    /// Evict the storage with the lowest score (ties: the one holding the lowest tensor id);
    /// false when none may be evicted.
    fn evict_one(&mut self) -> bool {
        let mut best: Option<(f64, TensorId, u32)> = None;
        for &inst in &self.live_insts {
            let xs = &self.inst_tensors[inst as usize];
            let bytes = self.mem.instance_bytes(inst);
            if bytes == 0 || xs.iter().any(|&x| !self.evictable[x] || self.locked[x]) {
                continue;
            }
            let distance = match self.score.distance {
                Distance::Staleness => {
                    let newest = xs.iter().map(|&x| self.last_access[x]).max().unwrap_or(0);
                    (self.clock - newest + 1) as f64
                }
                Distance::NextUse => {
                    let next = xs.iter().map(|&x| self.next_read(x)).min().unwrap_or(u32::MAX);
                    (next.saturating_sub(self.pos) as f64) + 1.0
                }
            };
            let mut redo = 0.0;
            for p in xs.iter().filter_map(|&x| self.producer[x]) {
                redo += self.g.ops[p].time;
                if self.score.with_inputs {
                    for &y in &self.g.ops[p].inputs {
                        if !self.alive(y) {
                            redo += self.producer[y].map_or(0.0, |q| self.g.ops[q].time);
                        }
                    }
                }
            }
            let score = (redo + 1e-12) / (bytes as f64 * distance);
            let first = xs.iter().copied().min().unwrap_or(usize::MAX);
            if best.is_none_or(|(s, f, _)| score < s || (score == s && first < f)) {
                best = Some((score, first, inst));
            }
        }
        let Some((_, _, inst)) = best else { return false };
        let mut xs = self.inst_tensors[inst as usize].clone();
        xs.sort_unstable_by(|a, b| b.cmp(a));
        for x in xs {
            self.free(x);
        }
        true
    }

    /// Compute op `o` (its inputs alive), evicting while the memory during its step would pass
    /// the budget; `lock` holds the tensors that may not be evicted now besides `o`'s own.
    fn run(&mut self, o: OpId, lock: &[TensorId]) -> bool {
        let g = self.g;
        let op = &g.ops[o];
        let marks: Vec<TensorId> = lock.iter().chain(&op.inputs).chain(&op.outputs).copied().collect();
        for &x in &marks {
            self.locked[x] = true;
        }
        let counted = |root: TensorId| !g.tensors[root].role.is_preexisting();
        let ok = loop {
            let made: Vec<TensorId> = op.outputs.iter().copied().filter(|&x| !self.alive(x)).collect();
            if self.mem.compute(g, &self.roots, o, counted) <= self.budget {
                for x in made {
                    let inst = self.mem.instance(x);
                    if inst != UNCOUNTED && inst != NOT_ALIVE {
                        let i = inst as usize;
                        if self.inst_tensors.len() <= i {
                            self.inst_tensors.resize(i + 1, Vec::new());
                        }
                        if self.inst_tensors[i].is_empty() {
                            self.live_insts.push(inst);
                        }
                        self.inst_tensors[i].push(x);
                    }
                }
                break true;
            }
            for x in made {
                self.mem.release(x);
            }
            if !self.evict_one() {
                break false;
            }
        };
        for &x in &marks {
            self.locked[x] = false;
        }
        if !ok {
            return false;
        }
        self.steps.push(Step::Compute(o));
        self.clock += 1;
        for &x in op.inputs.iter().chain(&op.outputs) {
            self.last_access[x] = self.clock;
        }
        true
    }

    /// Make op `o`'s inputs alive, recomputing evicted forward values (iteratively).
    fn ensure(&mut self, o: OpId, n_ops: usize) -> bool {
        let g = self.g;
        let mut stack = vec![o];
        while let Some(&k) = stack.last() {
            match g.ops[k].inputs.iter().find(|&&x| !self.alive(x)) {
                None => {
                    stack.pop();
                    if k != o {
                        let lock: Vec<TensorId> =
                            stack.iter().flat_map(|&q| g.ops[q].inputs.iter().copied()).collect();
                        if !self.run(k, &lock) {
                            return false;
                        }
                    }
                }
                Some(&x) => match self.producer[x] {
                    Some(q) if g.ops[q].phase == Phase::Forward && stack.len() <= n_ops => stack.push(q),
                    _ => return false,
                },
            }
        }
        true
    }
}

/// The greedy eviction schedule of `g` within `budget` bytes, by DTR's score; see
/// [`greedy_eviction_scored`].
pub fn greedy_eviction(
    g: &Graph,
    budget: u64,
    time_limit: Option<f64>,
    stop: &Stop,
) -> Result<Option<Schedule>, Stopped> {
    greedy_eviction_scored(g, budget, EvictionScore::DTR, time_limit, stop)
}

/// The greedy eviction schedule of `g` within `budget` bytes, evicting by `score`; None when it
/// gets stuck (nothing left to evict), when `time_limit` (seconds) passes, or when the schedule
/// grows past [`MAX_SCHEDULE_STEPS`] (chains recomputed over and over under a tight budget grow
/// as n^2). `stop` is polled for cancellation.
pub fn greedy_eviction_scored(
    g: &Graph,
    budget: u64,
    score: EvictionScore,
    time_limit: Option<f64>,
    stop: &Stop,
) -> Result<Option<Schedule>, Stopped> {
    // (a limit that is not a number of seconds >= 0 means none)
    let limit = Stop::new(None, time_limit).unwrap_or_default();
    let order = execution_order(g);
    let nt = g.tensors.len();
    let producer = g.producers();
    let never_free: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting() || t.role == Role::Output).collect();
    let evictable: Vec<bool> = (0..nt)
        .map(|x| producer[x].is_some_and(|p| g.ops[p].phase == Phase::Forward) && !never_free[x])
        .collect();
    // reads still to come in the op order (an op reading a tensor twice counts once)
    let mut uses = vec![0usize; nt];
    let mut reads_at: Vec<Vec<u32>> = vec![Vec::new(); if score.distance == Distance::NextUse { nt } else { 0 }];
    let mut buf: Vec<TensorId> = Vec::new();
    for (n, &o) in order.iter().enumerate() {
        buf.clear();
        buf.extend_from_slice(&g.ops[o].inputs);
        buf.sort_unstable();
        buf.dedup();
        for &x in &buf {
            uses[x] += 1;
            if let Some(r) = reads_at.get_mut(x) {
                r.push(n as u32);
            }
        }
    }
    let mut mem = Memory::new(vec![NOT_ALIVE; nt]);
    for (t, tensor) in g.tensors.iter().enumerate() {
        if tensor.role.is_preexisting() {
            mem.hold(t, UNCOUNTED);
        }
    }
    let mut st = State {
        g,
        score,
        reads_at,
        pos: 0,
        roots: g.storage_roots(),
        producer,
        evictable,
        mem,
        inst_tensors: Vec::new(),
        live_insts: Vec::new(),
        budget,
        last_access: vec![0; nt],
        clock: 0,
        steps: Vec::new(),
        locked: vec![false; nt],
    };
    let mut forward_len = None;
    for (n, &o) in order.iter().enumerate() {
        if n % 64 == 0 {
            stop.check()?;
            if limit.should_stop() {
                return Ok(None);
            }
        }
        if g.ops[o].phase == Phase::Backward && forward_len.is_none() {
            forward_len = Some(st.steps.len());
        }
        st.pos = n as u32;
        if !st.ensure(o, order.len()) || !st.run(o, &[]) || st.steps.len() > MAX_SCHEDULE_STEPS {
            return Ok(None);
        }
        buf.clear();
        buf.extend_from_slice(&g.ops[o].inputs);
        buf.sort_unstable();
        buf.dedup();
        for &x in &buf {
            uses[x] -= 1;
        }
        buf.extend_from_slice(&g.ops[o].outputs);
        buf.sort_unstable();
        buf.dedup();
        for &x in &buf {
            if st.alive(x) && !never_free[x] && uses[x] == 0 {
                st.free(x);
            }
        }
    }
    let forward_len = forward_len.unwrap_or(st.steps.len());
    Ok(Some(Schedule { steps: st.steps, forward_len }))
}
