//! TW-Remat (Kumar et al., "Efficient Rematerialization for Deep Networks", NeurIPS 2019),
//! adapted to training graphs whose backward ops run exactly once.
//!
//! The useful forward ops are split recursively: a region (a connected set of forward ops) is cut
//! by a balanced separator taken from a tree decomposition of its undirected op graph
//! ([`super::treedec`]); the components left become child regions. Every op of the global
//! execution order is a *target* (forward ops in the forward segment, then backward ops once
//! each). Computing a forward op inside region `R` first computes the separator ops of `R` it
//! transitively needs (each from its inputs, recursing into the children that hold them), then
//! descends into the child that holds the op. Separator results stay cached while later work
//! stays inside `R`; entering another child of `R` drops the caches of the child left, so what
//! is alive at any time is the separator ops along one root-to-leaf path (O(k log n) ops for
//! treewidth k), plus the inputs of the op being computed.
//!
//! Knob: `depth_limit`. Regions at that depth are leaves that keep everything they compute
//! (store-all inside the leaf). Limit 0 is plain store-all; larger limits keep less and recompute
//! more, down to full recursion at [`TwRemat::height`].

use crate::graph::{Graph, OpId, Phase, Role, TensorId};
use crate::limits::{Stop, Stopped, MAX_SCHEDULE_STEPS};
use crate::schedule::Schedule;
use crate::schedules::execution_order;
use crate::simulate::{simulate_within, SimResult, SimulateError};

use super::treedec::{balanced_separator, components};
use super::{checked, Emitter, LiteratureError};

/// A region of the recursion: a connected set of forward ops, its separator and children.
#[derive(Debug, Clone)]
struct Region {
    depth: usize,
    ops: Vec<OpId>,
    sep: Vec<OpId>,
    children: Vec<usize>,
}

/// The recursion tree of TW-Remat for one graph; build once, schedule at many depth limits.
#[derive(Debug, Clone)]
pub struct TwRemat {
    regions: Vec<Region>,
    /// Per op: the regions from the root down to its home (the region whose separator holds it,
    /// or the childless region holding it). Empty for ops that are not useful forward ops.
    path: Vec<Vec<usize>>,
    /// Per op: its home region holds it in its separator.
    home_is_sep: Vec<bool>,
    /// Per region: the regions from the root down to it.
    region_path: Vec<Vec<usize>>,
    order: Vec<OpId>,
    producer: Vec<Option<OpId>>,
}

/// One (memory, time) point: the schedule for a depth limit and its simulation.
#[derive(Debug, Clone)]
pub struct TwRematPoint {
    pub depth_limit: usize,
    pub schedule: Schedule,
    pub sim: SimResult,
}

/// Ops that must run: every backward op and the ancestors of backward ops and required tensors.
/// Returned in execution order.
pub(crate) fn useful_order(g: &Graph, producer: &[Option<OpId>]) -> Vec<OpId> {
    let mut useful = vec![false; g.ops.len()];
    let mut stack: Vec<OpId> = Vec::new();
    for (i, op) in g.ops.iter().enumerate() {
        if op.phase == Phase::Backward {
            stack.push(i);
        }
    }
    for (t, tensor) in g.tensors.iter().enumerate() {
        if tensor.role.is_required() {
            if let Some(p) = producer[t] {
                stack.push(p);
            }
        }
    }
    while let Some(op) = stack.pop() {
        if std::mem::replace(&mut useful[op], true) {
            continue;
        }
        for &t in &g.ops[op].inputs {
            if let Some(p) = producer[t] {
                if !useful[p] {
                    stack.push(p);
                }
            }
        }
    }
    execution_order(g).into_iter().filter(|&o| useful[o]).collect()
}

impl TwRemat {
    /// Build the recursion tree of `g` (a validated graph).
    pub fn new(g: &Graph) -> TwRemat {
        Self::new_within(g, &Stop::never()).expect("no stop was asked for")
    }

    /// [`Self::new`], polling `stop` while it splits regions.
    pub fn new_within(g: &Graph, stop: &Stop) -> Result<TwRemat, Stopped> {
        let producer = g.producers();
        let order = useful_order(g, &producer);
        let n_ops = g.ops.len();
        let fwd: Vec<OpId> = order.iter().copied().filter(|&o| g.ops[o].phase == Phase::Forward).collect();
        let mut is_fwd = vec![false; n_ops];
        for &o in &fwd {
            is_fwd[o] = true;
        }
        // Undirected producer-reader graph over the useful forward ops.
        let mut adj: Vec<Vec<usize>> = vec![Vec::new(); n_ops];
        for &o in &fwd {
            for &t in &g.ops[o].inputs {
                if let Some(p) = producer[t] {
                    if is_fwd[p] && p != o {
                        adj[o].push(p);
                        adj[p].push(o);
                    }
                }
            }
        }
        for a in &mut adj {
            a.sort_unstable();
            a.dedup();
        }

        let mut regions = vec![Region { depth: 0, ops: fwd, sep: Vec::new(), children: Vec::new() }];
        let mut parent: Vec<Option<usize>> = vec![None];
        let mut mark = vec![0u8; n_ops];
        let mut todo = vec![0usize];
        while let Some(r) = todo.pop() {
            stop.check()?;
            let ops = regions[r].ops.clone();
            if ops.len() <= 1 {
                continue;
            }
            let comps = components(&adj, &ops, &mut mark);
            let (sep, comps) = if comps.len() > 1 {
                (Vec::new(), comps)
            } else {
                let sep = balanced_separator(&adj, &ops, stop)?;
                let in_sep: std::collections::HashSet<OpId> = sep.iter().copied().collect();
                let rest: Vec<OpId> = ops.iter().copied().filter(|o| !in_sep.contains(o)).collect();
                (sep, components(&adj, &rest, &mut mark))
            };
            let depth = regions[r].depth;
            regions[r].sep = sep;
            for comp in comps {
                let id = regions.len();
                regions.push(Region { depth: depth + 1, ops: comp, sep: Vec::new(), children: Vec::new() });
                parent.push(Some(r));
                regions[r].children.push(id);
                todo.push(id);
            }
        }

        let mut home = vec![usize::MAX; n_ops];
        let mut home_is_sep = vec![false; n_ops];
        for (r, region) in regions.iter().enumerate() {
            for &o in &region.sep {
                home[o] = r;
                home_is_sep[o] = true;
            }
            if region.children.is_empty() {
                for &o in &region.ops {
                    if !home_is_sep[o] {
                        home[o] = r;
                    }
                }
            }
        }
        // Regions are created after their parent, so parents' paths are ready.
        let mut region_path: Vec<Vec<usize>> = Vec::with_capacity(regions.len());
        for r in 0..regions.len() {
            let mut p = parent[r].map_or_else(Vec::new, |up| region_path[up].clone());
            p.push(r);
            region_path.push(p);
        }
        let path: Vec<Vec<usize>> =
            home.iter().map(|&h| if h == usize::MAX { Vec::new() } else { region_path[h].clone() }).collect();
        Ok(TwRemat { regions, path, home_is_sep, region_path, order, producer })
    }

    /// The deepest region depth: depth limits at or above it all give the full recursion.
    pub fn height(&self) -> usize {
        self.regions.iter().map(|r| r.depth).max().unwrap_or(0)
    }

    /// Number of regions in the recursion tree.
    pub fn num_regions(&self) -> usize {
        self.regions.len()
    }

    /// Size of the largest separator (at most the treewidth found plus one).
    pub fn max_separator(&self) -> usize {
        self.regions.iter().map(|r| r.sep.len()).max().unwrap_or(0)
    }

    /// The schedule at `depth_limit` (any value; values above [`Self::height`] act as it).
    /// `g` must be the graph this recursion tree was built from.
    pub fn schedule(&self, g: &Graph, depth_limit: usize) -> Result<Schedule, LiteratureError> {
        self.schedule_capped(g, depth_limit, usize::MAX)
    }

    /// As [`Self::schedule`], but gives up with `StepLimit` once the schedule exceeds
    /// `max_steps` steps (recomputation grows quickly with depth on graphs of large treewidth).
    pub fn schedule_capped(&self, g: &Graph, depth_limit: usize, max_steps: usize) -> Result<Schedule, LiteratureError> {
        self.schedule_within(g, depth_limit, max_steps, &Stop::never())
    }

    /// [`Self::schedule_capped`], polling `stop` as it goes (`Stopped` when it says so).
    pub fn schedule_within(
        &self,
        g: &Graph,
        depth_limit: usize,
        max_steps: usize,
        stop: &Stop,
    ) -> Result<Schedule, LiteratureError> {
        if g.ops.len() != self.path.len() {
            return Err(LiteratureError::InvalidArgument(format!(
                "the recursion tree was built for a graph of {} ops, this one has {}; build it for this graph",
                self.path.len(),
                g.ops.len()
            )));
        }
        let mut run = Run::new(g, self, depth_limit, stop);
        run.max_steps = max_steps;
        run.run()
    }
}

/// TW-Remat on the whole graph at one depth limit (`None`: full recursion), simulated.
pub fn twremat(g: &Graph, depth_limit: Option<usize>) -> Result<(Schedule, SimResult), LiteratureError> {
    let tw = TwRemat::new(g);
    let s = tw.schedule(g, depth_limit.unwrap_or(usize::MAX))?;
    let sim = checked(g, &s)?;
    Ok((s, sim))
}

/// The step cap [`twremat_points`] uses: a few hundred compute/free steps per op, and at most
/// [`MAX_SCHEDULE_STEPS`].
pub fn default_step_cap(g: &Graph) -> usize {
    (200 * g.ops.len() + 10_000).min(MAX_SCHEDULE_STEPS)
}

/// TW-Remat at every depth limit from 0 (store-all) towards the full recursion, each
/// simulated. Points are in depth order; identical schedules are reported once. Stops at the
/// first depth whose schedule would exceed `max_steps` steps (`None`: [`default_step_cap`]).
pub fn twremat_points(g: &Graph, max_steps: Option<usize>) -> Result<Vec<TwRematPoint>, LiteratureError> {
    twremat_points_within(g, None, max_steps, &Stop::never())
}

/// TW-Remat at `depth_limits` (values above [`TwRemat::height`] act as it; a schedule longer
/// than `max_steps`, by default unlimited, is an error), or, with `None`, as
/// [`twremat_points`], which also stops listing once its points hold more than
/// [`MAX_SCHEDULE_STEPS`] steps in all. Polls `stop` throughout.
pub fn twremat_points_within(
    g: &Graph,
    depth_limits: Option<&[usize]>,
    max_steps: Option<usize>,
    stop: &Stop,
) -> Result<Vec<TwRematPoint>, LiteratureError> {
    let tw = TwRemat::new_within(g, stop)?;
    let all = depth_limits.is_none();
    let every_depth: Vec<usize> = (0..=tw.height()).collect();
    let cap = max_steps.unwrap_or_else(|| if all { default_step_cap(g) } else { usize::MAX });
    let mut points: Vec<TwRematPoint> = Vec::new();
    let mut total_steps = 0usize;
    for &depth in depth_limits.unwrap_or(&every_depth) {
        let schedule = match tw.schedule_within(g, depth, cap, stop) {
            Ok(s) => s,
            // Listing every depth stops where schedules get too long.
            Err(LiteratureError::StepLimit { .. }) if all && !points.is_empty() => break,
            Err(e) => return Err(e),
        };
        // When listing every depth, a depth that changes nothing is reported once.
        if all && points.last().is_some_and(|p| p.schedule == schedule) {
            continue;
        }
        total_steps += schedule.steps.len();
        if all && total_steps > MAX_SCHEDULE_STEPS && !points.is_empty() {
            break;
        }
        let sim = simulate_within(g, &schedule, stop).map_err(|e| match e {
            SimulateError::Stopped(s) => LiteratureError::Stopped(s),
            SimulateError::Schedule(e) => LiteratureError::Internal(e.to_string()),
        })?;
        points.push(TwRematPoint { depth_limit: depth.min(tw.height()), schedule, sim });
    }
    Ok(points)
}

/// The state of one scheduling pass.
struct Run<'a> {
    g: &'a Graph,
    tw: &'a TwRemat,
    limit: usize,
    em: Emitter,
    pins: Vec<u32>,
    /// Held by the cache of a region on the active path (`cached_in`).
    cached: Vec<bool>,
    cached_in: Vec<usize>,
    /// Never needed again (freed as soon as nothing else holds it).
    dead: Vec<bool>,
    /// Tensors that become dead after each position of the execution order.
    dead_at: Vec<Vec<TensorId>>,
    forward_tensor: Vec<bool>,
    caches: Vec<Vec<TensorId>>,
    /// Regions from the root down to the current one; only these hold caches.
    active: Vec<usize>,
    mark: Vec<u32>,
    epoch: u32,
    max_steps: usize,
    stop: &'a Stop<'a>,
    /// Calls of [`Run::ensure`] so far (the stop is polled every few thousand).
    ensured: u64,
}

fn internal(msg: String) -> LiteratureError {
    LiteratureError::Internal(msg)
}

impl<'a> Run<'a> {
    fn new(g: &'a Graph, tw: &'a TwRemat, limit: usize, stop: &'a Stop<'a>) -> Run<'a> {
        let nt = g.tensors.len();
        let order = &tw.order;
        let mut pos = vec![usize::MAX; g.ops.len()];
        for (i, &o) in order.iter().enumerate() {
            pos[o] = i;
        }
        let mut forward_tensor = vec![false; nt];
        for &o in order {
            if g.ops[o].phase == Phase::Forward {
                for &t in &g.ops[o].outputs {
                    forward_tensor[t] = true;
                }
            }
        }
        // Last position at which each tensor can be needed. With limit 0 nothing is ever
        // recomputed, so a tensor dies after its last reader (exactly store-all). Otherwise a
        // forward tensor may also be needed to recompute its readers' outputs later on.
        let transitive = limit > 0;
        let mut last: Vec<Option<usize>> = vec![None; nt];
        for &o in order {
            for &t in &g.ops[o].outputs {
                last[t] = Some(pos[o]);
            }
        }
        for &c in order.iter().rev() {
            let op = &g.ops[c];
            let mut need = pos[c];
            if transitive && op.phase == Phase::Forward {
                for &t in &op.outputs {
                    if g.tensors[t].role != Role::Output {
                        need = need.max(last[t].unwrap_or(0));
                    }
                }
            }
            for &t in &op.inputs {
                if tw.producer[t].is_some() {
                    last[t] = Some(last[t].map_or(need, |l| l.max(need)));
                }
            }
        }
        let mut dead_at: Vec<Vec<TensorId>> = vec![Vec::new(); order.len()];
        for (t, l) in last.iter().enumerate() {
            if let Some(l) = *l {
                dead_at[l].push(t);
            }
        }
        Run {
            g,
            tw,
            limit,
            em: Emitter::new(g),
            pins: vec![0; nt],
            cached: vec![false; nt],
            cached_in: vec![0; nt],
            dead: vec![false; nt],
            dead_at,
            forward_tensor,
            caches: vec![Vec::new(); tw.regions.len()],
            active: Vec::new(),
            mark: vec![0; g.ops.len()],
            epoch: 0,
            max_steps: usize::MAX,
            stop,
            ensured: 0,
        }
    }

    fn run(mut self) -> Result<Schedule, LiteratureError> {
        let g = self.g;
        let order = &self.tw.order;
        let last_forward = order.iter().rposition(|&o| g.ops[o].phase == Phase::Forward);
        let mut forward_len = 0;
        for (i, &z) in order.iter().enumerate() {
            if g.ops[z].phase == Phase::Forward {
                if self.missing(z) {
                    self.ensure(0, z)?;
                }
            } else {
                let pinned = self.ensure_inputs(z, |run, p| {
                    if run.g.ops[p].phase == Phase::Backward {
                        // Backward results stay alive until their last reader.
                        return Err(internal(format!("backward op {p}'s result was freed before its last reader")));
                    }
                    run.ensure(0, p)
                })?;
                self.compute(z, None);
                self.unpin(&pinned);
            }
            for k in 0..self.dead_at[i].len() {
                let t = self.dead_at[i][k];
                self.dead[t] = true;
                self.cached[t] = false;
                self.maybe_free(t);
            }
            if Some(i) == last_forward {
                forward_len = self.em.steps.len();
            }
        }
        if last_forward.is_none() {
            forward_len = 0;
        }
        if self.em.steps.len() > self.max_steps {
            return Err(LiteratureError::StepLimit { max_steps: self.max_steps });
        }
        Ok(Schedule { steps: self.em.steps, forward_len })
    }

    fn is_leaf(&self, r: usize) -> bool {
        self.tw.regions[r].depth >= self.limit || self.tw.regions[r].children.is_empty()
    }

    fn member(&self, r: usize, op: OpId) -> bool {
        self.tw.path[op].get(self.tw.regions[r].depth) == Some(&r)
    }

    fn in_sep(&self, r: usize, op: OpId) -> bool {
        self.tw.home_is_sep[op] && self.tw.path[op].last() == Some(&r)
    }

    /// Some output of `op` that may still be needed is not alive.
    fn missing(&self, op: OpId) -> bool {
        self.g.ops[op].outputs.iter().any(|&t| !self.em.alive[t] && !self.dead[t])
    }

    fn maybe_free(&mut self, t: TensorId) {
        if self.em.alive[t]
            && self.pins[t] == 0
            && (self.dead[t] || (self.forward_tensor[t] && !self.cached[t]))
        {
            self.em.free(self.g, t);
        }
    }

    fn compute(&mut self, op: OpId, cache_in: Option<usize>) {
        self.em.compute(self.g, op);
        for &t in &self.g.ops[op].outputs {
            if let Some(r) = cache_in.filter(|&r| self.active.get(self.tw.regions[r].depth) == Some(&r)) {
                // Outputs are never freed, so caching them would only hide that they are safe.
                if !self.dead[t] && !self.cached[t] && self.g.tensors[t].role.is_freeable() {
                    self.cached[t] = true;
                    self.cached_in[t] = r;
                    self.caches[r].push(t);
                }
            }
            self.maybe_free(t);
        }
    }

    fn unpin(&mut self, pinned: &[TensorId]) {
        for &t in pinned {
            self.pins[t] -= 1;
            self.maybe_free(t);
        }
    }

    /// Make region `r` current: the active path must go from the root through `r`; regions
    /// that leave it drop their caches. When `r` is already on it, the regions below `r` stay
    /// (later work may return to them).
    fn enter(&mut self, r: usize) {
        let path = &self.tw.region_path[r];
        let keep = self.active.iter().zip(path).take_while(|(a, b)| a == b).count();
        if keep == path.len() {
            return;
        }
        while self.active.len() > keep {
            let old = self.active.pop().unwrap();
            for t in std::mem::take(&mut self.caches[old]) {
                if self.cached[t] {
                    self.cached[t] = false;
                    self.maybe_free(t);
                }
            }
        }
        self.active.extend_from_slice(&path[keep..]);
    }

    /// Pin the inputs of `op`, making the missing ones alive with `make(run, producer)`.
    /// Returns the pinned tensors (to unpin after computing `op`).
    fn ensure_inputs(
        &mut self,
        op: OpId,
        mut make: impl FnMut(&mut Self, OpId) -> Result<(), LiteratureError>,
    ) -> Result<Vec<TensorId>, LiteratureError> {
        let g = self.g;
        let mut inputs = g.ops[op].inputs.clone();
        inputs.sort_unstable();
        inputs.dedup();
        let mut pinned = Vec::with_capacity(inputs.len());
        // Pin what is alive first, so that making the others cannot drop it.
        for &u in &inputs {
            if self.em.alive[u] {
                self.pins[u] += 1;
                pinned.push(u);
            }
        }
        for &u in &inputs {
            if self.em.alive[u] {
                continue;
            }
            let p = self.tw.producer[u]
                .ok_or_else(|| internal(format!("tensor {u} is needed but has no producer")))?;
            make(self, p)?;
            if !self.em.alive[u] {
                return Err(internal(format!("tensor {u} is not alive after computing op {p}")));
            }
            self.pins[u] += 1;
            pinned.push(u);
        }
        Ok(pinned)
    }

    /// Alive and sure to stay alive while work inside `r` goes on: not merely cached by a
    /// region below `r` (entering another child of `r` drops those caches).
    fn stable(&self, r: usize, t: TensorId) -> bool {
        self.em.alive[t]
            && (self.pins[t] > 0 || !self.cached[t] || self.tw.regions[self.cached_in[t]].depth <= self.tw.regions[r].depth)
    }

    /// The ops of region `r` to compute for `y`, in topological (post-)order with `y` last:
    /// everything `y` reaches through tensors that are not [`Self::stable`]. Needs from outside
    /// `r` are always stable (separator ops of ancestors, cached there, or pinned).
    fn closure(&mut self, r: usize, y: OpId) -> Result<Vec<OpId>, LiteratureError> {
        let g = self.g;
        self.epoch += 1;
        let epoch = self.epoch;
        self.mark[y] = epoch;
        let mut post = Vec::new();
        let mut stack: Vec<(OpId, usize)> = vec![(y, 0)];
        while let Some(top) = stack.last_mut() {
            let (op, i) = *top;
            let inputs = &g.ops[op].inputs;
            if i == inputs.len() {
                post.push(op);
                stack.pop();
                continue;
            }
            top.1 += 1;
            let t = inputs[i];
            if self.stable(r, t) {
                continue;
            }
            let p = self.tw.producer[t]
                .ok_or_else(|| internal(format!("tensor {t} is needed but has no producer")))?;
            if self.mark[p] == epoch {
                continue;
            }
            if !self.member(r, p) {
                return Err(internal(format!(
                    "op {p} is needed inside region {r} but lies outside it and is not alive"
                )));
            }
            self.mark[p] = epoch;
            stack.push((p, 0));
        }
        Ok(post)
    }

    /// Compute the forward op `y` (a member of region `r`) and what it needs: first the
    /// separator ops of `r` it needs (cached in `r`), then `y` inside the child that holds it.
    fn ensure(&mut self, r: usize, y: OpId) -> Result<(), LiteratureError> {
        if self.em.steps.len() > self.max_steps {
            return Err(LiteratureError::StepLimit { max_steps: self.max_steps });
        }
        self.ensured += 1;
        if self.ensured & 4095 == 0 {
            self.stop.check()?;
        }
        self.enter(r);
        let post = self.closure(r, y)?;
        if self.is_leaf(r) {
            for op in post {
                if op == y || self.missing(op) {
                    self.compute(op, Some(r));
                }
            }
            return Ok(());
        }
        for op in post {
            if self.in_sep(r, op) {
                self.ensure_sep(r, op)?;
            }
        }
        if !self.in_sep(r, y) && self.missing(y) {
            let child = self.tw.path[y][self.tw.regions[r].depth + 1];
            self.ensure(child, y)?;
        }
        Ok(())
    }

    /// Compute the separator op `s` of region `r` and cache it there.
    fn ensure_sep(&mut self, r: usize, s: OpId) -> Result<(), LiteratureError> {
        if !self.missing(s) {
            return Ok(());
        }
        let pinned = self.ensure_inputs(s, |run, p| {
            if run.member(r, p) {
                run.ensure(r, p)
            } else {
                Err(internal(format!("op {p} is needed by separator op {s} but lies outside region {r}")))
            }
        })?;
        self.compute(s, Some(r));
        self.unpin(&pinned);
        Ok(())
    }
}
