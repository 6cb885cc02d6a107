//! A lane's progress thread: it takes the lane's ops in issue order, builds (and caches)
//! their schedules, runs them on the links and reports failures, poison and staging bytes
//! (LANE-1 to LANE-9 for what it keeps).

use super::*;

/// Asks the scheduler for a `us` microsecond slice on this thread ([`crate::config::
/// LANE_SLICE_US`]), keeping its nice value. Best effort: a kernel without custom slices
/// refuses or ignores it, and nothing else depends on it.
#[cfg(target_os = "linux")]
pub(crate) fn request_slice(us: u64) {
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
        util_min: u32,
        util_max: u32,
    }
    if us == 0 {
        return;
    }
    // SAFETY: plain syscalls on the calling thread (pid 0) with a fully initialised,
    // correctly sized sched_attr (SCHED_ATTR_SIZE_VER1) that outlives the call.
    unsafe {
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        let attr = SchedAttr {
            size: std::mem::size_of::<SchedAttr>() as u32,
            policy: libc::SCHED_OTHER as u32,
            flags: 0,
            nice,
            priority: 0,
            runtime: us.saturating_mul(1000),
            deadline: 0,
            period: 0,
            util_min: 0,
            util_max: 0,
        };
        let _ = libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32);
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn request_slice(_us: u64) {}

pub(crate) struct Worker {
    /// The lane's sent-bytes counter (LANE-8).
    pub(crate) sent: Arc<AtomicU64>,
    pub(crate) name: Arc<str>,
    pub(crate) hash: u32,
    pub(crate) shared: Arc<Shared>,
    pub(crate) links: Box<dyn LaneLinks>,
    pub(crate) exec: Executor,
    pub(crate) failed: Option<CollectiveError>,
    pub(crate) next_seq: u64,
    /// Schedules by (kind, algorithm, count, root): steady-state training repeats the same
    /// few ops, so each schedule is built once.
    pub(crate) schedules: HashMap<(OpKind, Algorithm, usize, usize), Arc<Schedule>>,
    /// Told the lane's staging bytes whenever they change (`Lane::set_account`).
    pub(crate) account: Option<(Arc<dyn PoolAccount>, usize)>,
}

impl Worker {
    /// The links' staging and the executor's scratch.
    pub(crate) fn staging_bytes(&self) -> usize {
        self.links.staging_bytes() + self.exec.scratch_bytes()
    }

    /// Reports the staging bytes to the account when they changed.
    fn report_staging(&mut self) {
        let now = self.staging_bytes();
        if let Some((a, told)) = &mut self.account {
            if *told != now {
                // A refusal cannot take back scratch an op needs: the account keeps its
                // old figure (the accountant reports its refusals itself).
                a.held(now as u64);
                *told = now;
            }
        }
    }
}

/// Most schedules a lane keeps; beyond it the cache starts over.
pub(crate) const SCHEDULE_CACHE: usize = 64;

pub(crate) struct OpCtx {
    pub(crate) seq: u64,
    pub(crate) deadline: Instant,
    pub(crate) timeout: Duration,
    pub(crate) tag: Tag,
}

impl Worker {
    /// Takes the next message, polling briefly first: ops issued back to back then skip the
    /// thread wake-up (yielding keeps the poll cheap when cores are oversubscribed).
    fn next(rx: &Receiver<Msg>) -> Option<Msg> {
        let start = Instant::now();
        while start.elapsed() < POLL_BEFORE_BLOCK {
            match rx.try_recv() {
                Ok(m) => return Some(m),
                Err(crossbeam::channel::TryRecvError::Disconnected) => return None,
                Err(crossbeam::channel::TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
        rx.recv().ok()
    }

    pub(crate) fn run(worker: Arc<Mutex<Worker>>, pending: Arc<AtomicUsize>, rx: Receiver<Msg>) {
        request_slice(crate::config::LANE_SLICE_US.get());
        while let Some(msg) = Self::next(&rx) {
            let mut guard = worker.lock().unwrap_or_else(|e| e.into_inner());
            let this = &mut *guard;
            match msg {
                Msg::Job(job) => {
                    this.next_seq = job.seq + 1;
                    this.handle(job);
                    drop(guard);
                    pending.fetch_sub(1, Ordering::AcqRel);
                }
                Msg::Abort => {
                    if this.failed.is_none() {
                        let e = CollectiveError::Aborted {
                            lane: this.name.to_string(),
                            seq: this.next_seq,
                            reason: this.shared.abort_reason(),
                        };
                        let reason = format!("aborted: {}", this.shared.abort_reason());
                        this.fail(e, Some(Reason::Other(reason)));
                    }
                }
            }
        }
    }

    fn fail(&mut self, e: CollectiveError, reason: Option<Reason>) {
        tracing::debug!(lane = %self.name, rank = self.shared.rank, error = %e, "lane failed");
        if let Some(r) = reason {
            self.links.poison(&Poison {
                origin: self.shared.rank,
                reason: fingerprint::format_reason(&r),
            });
        }
        self.failed = Some(e);
    }

    /// Whether `Auto`, resolved to a ring, gathers directly instead: where the transport
    /// prefers it (`LaneLinks::prefers_direct_gather`, the same on every rank).
    fn auto_gathers_direct(&self, asked: Algorithm, resolved: Algorithm) -> bool {
        asked == Algorithm::Auto
            && resolved == Algorithm::Ring
            && self.links.prefers_direct_gather()
    }

    fn resolve(&self, algo: Algorithm, bytes: usize) -> Algorithm {
        match algo {
            Algorithm::Auto => {
                let t = &self.shared.topology;
                if bytes <= self.shared.opts.get_small_bytes() {
                    Algorithm::Direct
                } else if t.nodes() > 1 && t.is_uniform() {
                    Algorithm::Hierarchical
                } else {
                    Algorithm::Ring
                }
            }
            a => a,
        }
    }

    pub(crate) fn handle(&mut self, job: Job) {
        job.body.start(Instant::now());
        let (rank, world) = (self.shared.rank, self.shared.world);
        let shared = self.shared.clone();
        let topo = &shared.topology;
        let mk = |me: &Self, kind, op, algo, count, root| OpCtx {
            seq: job.seq,
            deadline: job.deadline,
            timeout: job.timeout,
            tag: op_tag(me.hash, job.seq, kind, op, algo, count, root),
        };
        match job.body {
            Body::AllReduce { mut buf, op, done } => {
                let n = buf.len();
                let algo = self.resolve(job.algo, n * 4);
                // The ring's all-gather half goes direct where the transport prefers it
                // (every rank decides alike). Not where it prefers pieces: over tcp a direct
                // half in pieces measured the same as the ring (W=4, 64 MiB: 1.32-1.44 GB/s
                // busbw either way), so the ring stays.
                let direct_gather = self.auto_gathers_direct(job.algo, algo);
                let key = (OpKind::AllReduce, algo, n, usize::from(direct_gather));
                let sched = self.schedule(key, || match algo {
                    Algorithm::Direct => algo::direct_all_reduce(rank, world, n),
                    Algorithm::Hierarchical => algo::hier_all_reduce(rank, topo, n),
                    _ if direct_gather => algo::ring_all_reduce_direct_gather(rank, world, n),
                    _ => algo::ring_all_reduce(rank, world, n),
                });
                let ctx = mk(self, OpKind::AllReduce, Some(op), algo, n, None);
                let r = self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(op));
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut buf, world);
                }
                done.complete(r.map(|_| buf));
            }
            Body::Records { mut buf, record_len, combine, done } => {
                let n = buf.len();
                let sched = self.schedule((OpKind::AllReduce, Algorithm::Direct, n, 0), || {
                    algo::direct_all_reduce(rank, world, n)
                });
                // The record length rides in the root field, so ranks that disagree on it
                // get a Mismatch too.
                let ctx = mk(
                    self,
                    OpKind::AllReduceRecords,
                    None,
                    Algorithm::Direct,
                    n,
                    Some(record_len),
                );
                let r = self.execute(
                    &ctx,
                    &sched,
                    Regions::work(&mut buf),
                    Combine::Records { len: record_len, f: combine },
                );
                done.complete(r.map(|_| buf));
            }
            Body::ReduceScatter { mut input, mut output, op, done } => {
                let n = output.len();
                let algo = self.resolve(job.algo, input.len() * 4);
                let ctx = mk(self, OpKind::ReduceScatter, Some(op), algo, input.len(), None);
                // The last step reduces straight into the output where the schedule allows
                // it (ALGO-5): one pass over the own slot less than reducing in place and
                // copying it out.
                let rs = self.reduce_scatter_schedule(algo, n);
                let sched = self.schedule((OpKind::ReduceScatter, algo, n, 1), || {
                    algo::reduce_scatter_into((*rs).clone(), rank, n)
                });
                let r = self.execute(
                    &ctx,
                    &sched,
                    Regions { buf: &mut input, input: &[], output: &mut output },
                    Combine::Op(op),
                );
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut output, world);
                }
                done.complete(r.map(|_| (input, output)));
            }
            Body::AllGather { input, mut output, done } => {
                let n = input.len();
                let algo = self.all_gather_algorithm(job.algo, output.len() * 4);
                // Direct over a transport that prefers it, or in pieces: peers read the shard
                // from the input where the caller left it, and the own copy comes last (in
                // pieces: each piece right after it went out).
                let from_input = algo == Algorithm::Direct
                    && (self.links.prefers_direct_gather() || self.links.prefers_pieced_gather());
                let sched = self.all_gather_schedule(algo, n, from_input);
                let ctx = mk(self, OpKind::AllGather, None, algo, output.len(), None);
                let r = if from_input {
                    self.execute(
                        &ctx,
                        &sched,
                        Regions { buf: &mut output, input: &input, output: &mut [] },
                        Combine::Op(ReduceOp::Sum),
                    )
                } else {
                    crate::memcopy::copy(&mut output[rank * n..(rank + 1) * n], &input);
                    self.execute(
                        &ctx,
                        &sched,
                        Regions::work(&mut output),
                        Combine::Op(ReduceOp::Sum),
                    )
                };
                done.complete(r.map(|_| (input, output)));
            }
            Body::ReduceScatterInPlace { mut buf, op, done } => {
                let n = buf.len() / world;
                // The same schedule (and wire traffic) as the out-of-place form, whose work
                // buffer is its input; only the final copy into a separate output is gone.
                let algo = self.resolve(job.algo, buf.len() * 4);
                let sched = self.reduce_scatter_schedule(algo, n);
                let ctx = mk(self, OpKind::ReduceScatter, Some(op), algo, buf.len(), None);
                let r = self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(op));
                if r.is_ok() && op == ReduceOp::Avg {
                    scale_avg(&mut buf[rank * n..(rank + 1) * n], world);
                }
                done.complete(r.map(|_| buf));
            }
            Body::AllGatherInPlace { mut buf, done } => {
                let n = buf.len() / world;
                let algo = self.all_gather_algorithm(job.algo, buf.len() * 4);
                // The shard already lies in its slot: the schedules that send from the work
                // buffer need no own copy (the direct one is wire-identical to the form that
                // sends from a separate input).
                let sched = self.all_gather_schedule(algo, n, false);
                let ctx = mk(self, OpKind::AllGather, None, algo, buf.len(), None);
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(ReduceOp::Sum));
                done.complete(r.map(|_| buf));
            }
            Body::Broadcast { mut buf, root, done } => {
                let n = buf.len();
                let algo = match self.resolve(job.algo, n * 4) {
                    Algorithm::Direct => Algorithm::Direct,
                    _ => Algorithm::Ring,
                };
                let piece = (self.shared.opts.get_pipeline_bytes() / 4).max(1);
                let sched = self.schedule((OpKind::Broadcast, algo, n, root), || {
                    if algo == Algorithm::Direct {
                        algo::direct_broadcast(rank, world, root, n)
                    } else {
                        let pieces = n.div_ceil(piece).clamp(1, MAX_PIECES);
                        algo::chain_broadcast(rank, world, root, n, pieces)
                    }
                });
                let ctx = mk(self, OpKind::Broadcast, None, algo, n, Some(root));
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut buf), Combine::Op(ReduceOp::Sum));
                done.complete(r.map(|_| buf));
            }
            Body::Barrier { done } => {
                let sched = self.schedule((OpKind::AllReduce, Algorithm::Direct, 0, 0), || {
                    algo::direct_all_reduce(rank, world, 0)
                });
                let ctx = mk(self, OpKind::Barrier, None, Algorithm::Direct, 0, None);
                let r =
                    self.execute(&ctx, &sched, Regions::work(&mut []), Combine::Op(ReduceOp::Sum));
                done.complete(r);
            }
        }
    }

    /// Reduce-scatter's schedule for `n` elements per rank (both forms: the work buffer is
    /// the whole input).
    fn reduce_scatter_schedule(&mut self, algo: Algorithm, n: usize) -> Arc<Schedule> {
        let (rank, world, shared) = (self.shared.rank, self.shared.world, self.shared.clone());
        self.schedule((OpKind::ReduceScatter, algo, n, 0), || match algo {
            Algorithm::Direct => algo::direct_reduce_scatter(rank, world, n),
            Algorithm::Hierarchical => algo::hier_reduce_scatter(rank, &shared.topology, n),
            _ => algo::ring_reduce_scatter(rank, world, n),
        })
    }

    /// All-gather's algorithm: `Auto` resolved, and direct where the transport prefers it,
    /// or prefers pieces at a small world (`LaneLinks::prefers_pieced_gather`; the same on
    /// every rank).
    fn all_gather_algorithm(&self, requested: Algorithm, bytes: usize) -> Algorithm {
        let algo = self.resolve(requested, bytes);
        let pieced = requested == Algorithm::Auto
            && algo == Algorithm::Ring
            && self.links.prefers_pieced_gather()
            && self.shared.world <= crate::transport::PIECED_GATHER_MAX_WORLD;
        if pieced || self.auto_gathers_direct(requested, algo) {
            Algorithm::Direct
        } else {
            algo
        }
    }

    /// All-gather's schedule for `n` elements per rank; `from_input`: direct, sending from
    /// the op's separate input.
    fn all_gather_schedule(
        &mut self,
        algo: Algorithm,
        n: usize,
        from_input: bool,
    ) -> Arc<Schedule> {
        let (rank, world, shared) = (self.shared.rank, self.shared.world, self.shared.clone());
        // Pieces change the steps, not the wire bytes; every rank decides alike (the
        // transport's kind and the size).
        let pieces = if self.links.prefers_pieced_gather() {
            n.div_ceil((shared.opts.get_pipeline_bytes() / 4).max(1)).clamp(1, MAX_PIECES)
        } else {
            1
        };
        self.schedule((OpKind::AllGather, algo, n, usize::from(from_input)), || match algo {
            Algorithm::Direct if from_input => {
                algo::direct_all_gather_from_input(rank, world, n, pieces)
            }
            Algorithm::Direct => algo::direct_all_gather(rank, world, n, pieces),
            Algorithm::Hierarchical => algo::hier_all_gather(rank, &shared.topology, n),
            _ => algo::ring_all_gather(rank, world, n),
        })
    }

    fn schedule(
        &mut self,
        key: (OpKind, Algorithm, usize, usize),
        build: impl FnOnce() -> Schedule,
    ) -> Arc<Schedule> {
        if let Some(s) = self.schedules.get(&key) {
            return s.clone();
        }
        if self.schedules.len() >= SCHEDULE_CACHE {
            self.schedules.clear();
        }
        let s = Arc::new(build());
        self.schedules.insert(key, s.clone());
        s
    }

    fn execute(
        &mut self,
        ctx: &OpCtx,
        sched: &Schedule,
        regions: Regions<'_>,
        combine: Combine,
    ) -> Result<(), CollectiveError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.shared.cancel.load(Ordering::Acquire) {
            let reason = self.shared.abort_reason();
            let e = CollectiveError::Aborted {
                lane: self.name.to_string(),
                seq: ctx.seq,
                reason: reason.clone(),
            };
            self.fail(e.clone(), Some(Reason::Other(format!("aborted: {reason}"))));
            return Err(e);
        }
        let kind = fingerprint::OpKind::from_code(ctx.tag.kind & 0xff).map_or("op", |k| k.name());
        self.shared.recent.start(&self.name, ctx.seq, kind, regions.buf.len() * 4);
        self.exec.reserve_scratch(sched.scratch_len);
        self.report_staging();
        let wire = WireCtx { tag: ctx.tag, deadline: ctx.deadline, cancel: &self.shared.cancel };
        let before = self.exec.sent_bytes();
        let res = self.exec.run(&mut *self.links, sched, regions, combine, wire);
        let sent = self.exec.sent_bytes() - before;
        self.sent.fetch_add(sent, Ordering::AcqRel);
        self.shared.sent.fetch_add(sent, Ordering::AcqRel);
        self.shared.recent.end(&self.name, ctx.seq, res.is_err());
        match res {
            Ok(()) => Ok(()),
            Err(te) => {
                let (e, reason) = self.convert(te, ctx);
                self.fail(e.clone(), reason);
                Err(e)
            }
        }
    }

    /// Maps a transport error to this rank's error and the reason to poison peers with
    /// (LANE-3; none when the error itself came from a peer's poison).
    fn convert(&self, te: TransportError, ctx: &OpCtx) -> (CollectiveError, Option<Reason>) {
        let lane = self.name.to_string();
        let (seq, me) = (ctx.seq, self.shared.rank);
        let timeout_ms = ctx.timeout.as_millis() as u64;
        match te {
            TransportError::Timeout { peer } => (
                CollectiveError::Timeout { lane, seq, peer, timeout_ms },
                Some(Reason::Timeout { peer }),
            ),
            TransportError::PeerLost { peer, detail } => (
                CollectiveError::PeerLost { rank: peer, lane, seq, detail: detail.clone() },
                Some(Reason::Lost { peer, detail }),
            ),
            TransportError::TagMismatch { peer, expected, got } => {
                let (ours, theirs) = describe_pair(&expected, &got);
                (
                    CollectiveError::Mismatch {
                        lane,
                        seq,
                        rank: me,
                        ours: ours.clone(),
                        peer,
                        theirs: theirs.clone(),
                    },
                    Some(Reason::Mismatch { peer, ours, theirs }),
                )
            }
            TransportError::Poisoned(p) => {
                let origin = p.origin;
                let e = match parse_reason(&p.reason) {
                    Reason::Mismatch { peer, ours: a, theirs: b } => {
                        if peer == me {
                            CollectiveError::Mismatch {
                                lane,
                                seq,
                                rank: me,
                                ours: b,
                                peer: origin,
                                theirs: a,
                            }
                        } else {
                            let mine = describe(&ctx.tag);
                            let (peer, theirs) = if mine == b { (origin, a) } else { (peer, b) };
                            CollectiveError::Mismatch {
                                lane,
                                seq,
                                rank: me,
                                ours: mine,
                                peer,
                                theirs,
                            }
                        }
                    }
                    Reason::Timeout { peer } if peer != me => {
                        CollectiveError::Timeout { lane, seq, peer, timeout_ms }
                    }
                    Reason::Timeout { .. } => CollectiveError::PeerFailed {
                        lane,
                        seq,
                        detail: format!("rank {origin} timed out waiting for this rank"),
                    },
                    Reason::Lost { peer, detail } => CollectiveError::PeerLost {
                        rank: peer,
                        lane,
                        seq,
                        detail: format!("{detail} (reported by rank {origin})"),
                    },
                    Reason::Other(s) => CollectiveError::PeerFailed {
                        lane,
                        seq,
                        detail: format!("rank {origin} failed: {s}"),
                    },
                };
                (e, None)
            }
            TransportError::Cancelled => {
                let reason = self.shared.abort_reason();
                (
                    CollectiveError::Aborted { lane, seq, reason: reason.clone() },
                    Some(Reason::Other(format!("aborted: {reason}"))),
                )
            }
            other => {
                let text = other.to_string();
                (CollectiveError::Transport { lane, source: other }, Some(Reason::Other(text)))
            }
        }
    }
}
