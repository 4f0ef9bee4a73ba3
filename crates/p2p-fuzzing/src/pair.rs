//! Two connection machines ([`Proto`]) wired together in memory: what one
//! sends, the other receives (encoded, then decoded, as on the wire, with
//! an inline transfer's bytes after its frame), and the net requests both
//! post are carried out by a mover that copies bytes between the two
//! sides' memories, matching the k-th send of a set with the peer's k-th
//! receive of that set, as the nets do; where the pair pulls ([`Pair::pulling`]),
//! a pulled write's requests copy straight from the writer's memory, as the
//! same-host net's do (the key of a run: its address and length there). No
//! sockets, no threads, no clock: the time is a number the test moves.
//!
//! A [`Side`] keeps what the engine's `Conn` keeps around its machine: its
//! transfers (events left, how each ended), the requests it posted and not yet moved, the
//! requests serving the peer's accepted requests, the notifications it
//! received. Tests and the fuzz harness assert on bytes and on those ends.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tcpx_p2p::fuzzing::{
    op_refs, plan_ops, pull_refs, requests, Answer, Effect, Failure, Gather, Limits, MemRef,
    OpPlan, Payload, Pieces, Proto, Region, Registry, RemoteRef, Requested, Set, Setup,
};
use tcpx_p2p::MemKind;
use tcpx_p2p_wire::{Control, Lease, PullRun, RmaItem, Token};

/// The agreed chunk of the pair: small, so that short transfers take
/// several requests.
pub const CHUNK: usize = 4096;
/// Segments a request may gather.
pub const SEGS: usize = 16;

/// Who a posted request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// One of our transfers.
    Ours(u64),
    /// The requests serving a peer's request (a key into `serving`).
    Serve(u64),
    /// An empty filler of a cancelled write.
    Fill,
}

/// One net request: the memory it reads or fills, in order.
#[derive(Debug)]
pub struct Req {
    owner: Owner,
    segs: Vec<(u64, usize)>,
    expect: Option<usize>,
    /// A pull: the peer's memory the bytes come from.
    remote: Vec<RemoteRef>,
    /// Where in its transfer's runs one of ours lies (to find a grant's
    /// keys).
    plan: Option<OpPlan>,
}

/// How a transfer ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Pending,
    Done,
    Failed(Failure),
}

/// One of our transfers.
#[derive(Debug)]
pub struct Xfer {
    /// Events still awaited.
    pub left: usize,
    pub end: End,
    /// A piece went wrong in a way another event explains.
    poison: Option<Failure>,
    /// A two-sided receive's number.
    recv_seq: Option<u64>,
}

/// Requests serving one of the peer's accepted requests.
struct Serving {
    xfer: u64,
    weight: usize,
    answer: Answer,
    left: usize,
    poison: Option<Failure>,
}

/// A frame on the in-memory control connection, with the bytes after it.
pub struct Frame {
    pub body: Vec<u8>,
    pub payload: Vec<u8>,
}

/// One end of the pair.
pub struct Side {
    pub name: &'static str,
    pub reg: Arc<Registry>,
    /// This side's memory, registered as one host region.
    pub mem: Vec<u8>,
    base: u64,
    region: Arc<Region>,
    pub proto: Proto<Vec<Req>>,
    /// Requests posted and not yet moved, per set: sends, receives.
    sends: [VecDeque<Req>; 2],
    recvs: [VecDeque<Req>; 2],
    /// Pulls posted and not yet made (they pair with no send).
    pulls: VecDeque<Req>,
    /// Pushes posted and not yet made: our writes into the peer's leases.
    pushes: VecDeque<Req>,
    /// Our writes are offered for pulling, and the peer's pulled; our reads
    /// are offered for us to copy, and the peer's granted.
    pull: bool,
    /// Our reads the peer granted: their ends are answered `ReadDone`.
    granted: std::collections::HashSet<u64>,
    /// The peer's reads we granted: the key of the requests serving each.
    grants: HashMap<u64, u64>,
    /// Our reads copying from the peer's leases: the leases (token ids)
    /// each uses, told to the machine at its end.
    leased: HashMap<u64, Vec<u64>>,
    /// Leases we answered `Revoked` for and have not used since: no pull
    /// of ours may copy from them any more.
    revoked_sent: std::collections::HashSet<u64>,
    /// This side's connection id (what advertisements are made for).
    conn: u64,
    /// Our records leased for writes ([`Side::advertise_leased`]): a grant
    /// of one leases it for writes too, as `Conn::lease_of` does.
    records: std::collections::HashSet<u64>,
    /// Reads of ours that copied from leases, writes into them, and
    /// revokes we answered.
    pub leased_reads: u64,
    pub leased_writes: u64,
    pub revokes_answered: u64,
    pub xfers: HashMap<u64, Xfer>,
    serving: HashMap<u64, Serving>,
    next: u64,
    /// Notifications received: (name, message).
    pub notifs: Vec<(String, Vec<u8>)>,
    /// Why the connection failed, as this side saw it.
    pub failed: Option<Failure>,
    /// What this side wrote, not yet read by the peer.
    pub out: VecDeque<Frame>,
    gather: Gather,
    /// One-sided transfers up to this many bytes go inline.
    pub inline_max: usize,
}

fn set_index(s: Set) -> usize {
    match s {
        Set::Msg => 0,
        Set::Rma => 1,
    }
}

impl Side {
    /// A side with `mem` bytes of memory, its connection numbered `conn`.
    pub fn new(name: &'static str, conn: u64, mem: usize, limits: Limits) -> Side {
        Side::with_pull(name, conn, mem, limits, false)
    }

    /// As [`Side::new`]; with `pull`, writes go as the same-host net's do.
    pub fn with_pull(
        name: &'static str,
        conn: u64,
        mem: usize,
        limits: Limits,
        pull: bool,
    ) -> Side {
        let reg = Arc::new(Registry::new());
        let mem = vec![0u8; mem];
        let base = mem.as_ptr() as u64;
        let region = reg.register(base, mem.len()).expect("register the memory");
        let gather = Gather::new(CHUNK, SEGS);
        let proto = Proto::new(Setup {
            registry: reg.clone(),
            conn,
            chunk: CHUNK,
            gather,
            limits,
            now: 0,
            pull,
        });
        Side {
            name,
            reg,
            mem,
            base,
            region,
            proto,
            sends: Default::default(),
            recvs: Default::default(),
            pulls: VecDeque::new(),
            pushes: VecDeque::new(),
            granted: Default::default(),
            grants: HashMap::new(),
            leased: HashMap::new(),
            revoked_sent: Default::default(),
            conn,
            records: Default::default(),
            leased_reads: 0,
            leased_writes: 0,
            revokes_answered: 0,
            pull,
            xfers: HashMap::new(),
            serving: HashMap::new(),
            next: 1,
            notifs: Vec::new(),
            failed: None,
            out: VecDeque::new(),
            gather,
            inline_max: 0,
        }
    }

    /// Advertises `len` bytes at `off` for the peer (to this side's
    /// connection, or any with `conn` None): the item a peer's request
    /// names.
    pub fn advertise(&self, off: usize, len: usize, conn: Option<u64>) -> RmaItem {
        let token = self
            .reg
            .advertise(self.region.id, self.base + off as u64, len, conn)
            .expect("advertise");
        RmaItem {
            token,
            addr: self.base + off as u64,
            len: len as u64,
        }
    }

    /// As [`Side::advertise`] for this side's connection, leased to the
    /// peer at once for reads and writes, as an `advertise_ipc` record is
    /// (`Proto::lease_record`; the lease is not given past the bound).
    pub fn advertise_leased(&mut self, off: usize, len: usize) -> RmaItem {
        let it = self.advertise(off, len, Some(self.conn));
        self.records.insert(it.token.id);
        if self.alive() && !self.proto.lease_wanted(&[it.token]).is_empty() {
            let lease = Lease {
                token: it.token,
                addr: it.addr,
                len: it.len,
                gpu: false,
                write: true,
                key: pull_key(it.addr, len),
            };
            self.proto.lease_record(lease, self.region.clone());
            self.effects();
        }
        it
    }

    /// An item naming memory with a made-up token.
    pub fn forged(&self, off: usize, len: u64) -> RmaItem {
        RmaItem {
            token: Token {
                id: 999_999,
                secret: 7,
            },
            addr: self.base + off as u64,
            len,
        }
    }

    fn local(&self, ranges: &[(usize, usize)]) -> Pieces {
        let mut out = Pieces::with_capacity(ranges.len());
        for &(off, len) in ranges {
            assert!(off + len <= self.mem.len(), "a range outside the memory");
            let mem = MemRef {
                addr: self.base + off as u64,
                len,
                kind: MemKind::Host,
            };
            out.push(mem, &self.region);
        }
        out
    }

    fn reqs(&self, owner: Owner, local: &Pieces, exact: bool) -> (Vec<Req>, usize) {
        let lens: Vec<usize> = local.mems().iter().map(|m| m.len).collect();
        let plan = plan_ops(&lens, CHUNK, self.gather);
        let n = plan.len();
        let mut reqs = requests(local, &plan, exact, |segs, expect| Req {
            owner,
            segs: segs.iter().map(|(m, _)| (m.addr, m.len)).collect(),
            expect,
            remote: vec![],
            plan: None,
        });
        for (r, p) in reqs.iter_mut().zip(&plan) {
            r.plan = Some(*p);
        }
        (reqs, n)
    }

    fn new_xfer(&mut self, events: usize) -> u64 {
        let id = self.next;
        self.next += 1;
        self.xfers.insert(
            id,
            Xfer {
                left: events,
                end: End::Pending,
                poison: None,
                recv_seq: None,
            },
        );
        if events == 0 {
            self.end(id, End::Done);
        }
        id
    }

    /// Whether the connection still takes calls (as `Conn` checks first).
    fn alive(&self) -> bool {
        self.failed.is_none()
    }

    /// A two-sided send of the memory at `ranges`.
    pub fn send(&mut self, ranges: &[(usize, usize)]) -> Option<u64> {
        if !self.alive() {
            return None;
        }
        let local = self.local(ranges);
        let id = self.next;
        let (reqs, n) = self.reqs(Owner::Ours(id), &local, false);
        let id = self.new_xfer(n);
        self.proto.post_send(id, reqs);
        self.effects();
        Some(id)
    }

    /// A two-sided receive into the memory at `ranges`.
    pub fn recv(&mut self, ranges: &[(usize, usize)]) -> Option<u64> {
        if !self.alive() {
            return None;
        }
        let local = self.local(ranges);
        let id = self.next;
        let (reqs, n) = self.reqs(Owner::Ours(id), &local, false);
        let id = self.new_xfer(n);
        let seq = self.proto.post_recv(reqs);
        self.effects();
        let x = self.xfers.get_mut(&id).expect("just made");
        x.recv_seq = Some(seq);
        if x.end != End::Pending {
            let end = x.end.clone();
            self.recv_ended(seq, end);
        }
        Some(id)
    }

    /// A one-sided write (`read` false) or read between our memory at
    /// `ranges` and the peer's `items` (one item per range, of its length):
    /// inline when it fits `inline_max` and the machine has room.
    pub fn rma(
        &mut self,
        read: bool,
        ranges: &[(usize, usize)],
        items: Vec<RmaItem>,
    ) -> Option<u64> {
        if !self.alive() {
            return None;
        }
        let local = self.local(ranges);
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let runs = vec![1u32; items.len()];
        if total > 0 && total <= self.inline_max && self.proto.inline_room(read, 0) {
            let id = self.new_xfer(1);
            if read {
                self.proto.post_inline_read(id, local, items, runs);
            } else {
                self.proto.post_inline_write(id, local, items, runs);
            }
            self.effects();
            return Some(id);
        }
        if self.pull && total > 0 {
            // A read (or write) the peer's leases cover: pulled (pushed)
            // with no request.
            let ours_gpu = vec![false; runs.len()];
            if let Some((srcs, used)) = self.proto.leased(!read, &items, &runs, &ours_gpu) {
                let id = self.next;
                let (mut reqs, n) = self.reqs(Owner::Ours(id), &local, true);
                for r in &mut reqs {
                    let lens: Vec<usize> = r.segs.iter().map(|s| s.1).collect();
                    r.remote = op_refs(r.plan, &lens, &srcs).expect("a lease covers its read");
                }
                for t in &used {
                    self.revoked_sent.remove(t);
                }
                let id = self.new_xfer(n);
                self.leased.insert(id, used);
                if read {
                    self.leased_reads += 1;
                    self.pulls.extend(reqs);
                } else {
                    self.leased_writes += 1;
                    self.pushes.extend(reqs);
                }
                self.effects();
                return Some(id);
            }
        }
        let id = self.next;
        let (reqs, n) = self.reqs(Owner::Ours(id), &local, true);
        let id = self.new_xfer(n + 1);
        if read && self.pull {
            let dst_gpu = vec![false; runs.len()];
            self.proto.post_read_offer(id, reqs, items, runs, dst_gpu);
        } else if read {
            self.proto.post_read(id, reqs, items, runs);
        } else if self.pull {
            let src = local
                .iter()
                .map(|(m, _)| PullRun {
                    gpu: false,
                    key: pull_key(m.addr, m.len),
                })
                .collect();
            self.proto.post_write_pull(id, reqs, items, runs, src);
        } else {
            self.proto.post_write(id, reqs, items, runs);
        }
        self.effects();
        Some(id)
    }

    /// A notification for the peer.
    pub fn notify(&mut self, name: &str, msg: &[u8]) {
        if self.alive() {
            self.proto.send_notif(name.into(), msg.to_vec());
            self.effects();
        }
    }

    /// Cancels our transfer `id` (see `Proto::cancel`).
    pub fn cancel(&mut self, id: u64) -> bool {
        let c = self.proto.cancel(id);
        self.effects();
        c
    }

    /// A timer tick at `now` ms.
    pub fn tick(&mut self, now: u64, keepalive: u64, deadline: u64) {
        if let Err(f) = self.proto.tick(now, keepalive, deadline) {
            self.fail(f);
        }
        self.effects();
    }

    /// Ends our transfer `id` unless it has ended (the first end decides,
    /// as a `Transfer`'s does).
    fn end(&mut self, id: u64, end: End) {
        let Some(x) = self.xfers.get_mut(&id) else {
            return;
        };
        if x.end != End::Pending {
            return;
        }
        x.end = end.clone();
        if let Some(seq) = x.recv_seq {
            self.recv_ended(seq, end);
        }
        if self.granted.remove(&id) {
            self.proto.granted_ended(id);
        }
        if let Some(used) = self.leased.remove(&id) {
            self.proto.leased_ended(&used);
        }
    }

    /// Our region is being deregistered: the machine revokes the leases
    /// of it (the memory itself stays, for the test to go on).
    pub fn revoke_leases(&mut self) {
        if self.alive() {
            self.proto.revoke_region(self.region.id);
            self.effects();
        }
    }

    /// Leases given and held (see `Proto::leases`).
    pub fn leases(&self) -> (usize, usize) {
        self.proto.leases()
    }

    fn recv_ended(&mut self, seq: u64, end: End) {
        let outcome = match end {
            End::Done => Ok(()),
            End::Failed(f) => Err(f),
            End::Pending => return,
        };
        if let Err(f) = self.proto.recv_ended(seq, outcome) {
            self.fail(f);
        }
    }

    /// One event of our transfer `id` happened.
    fn complete_one(&mut self, id: u64) {
        let Some(x) = self.xfers.get_mut(&id) else {
            return;
        };
        x.left = x.left.saturating_sub(1);
        if x.left == 0 {
            self.complete_all(id);
        }
    }

    fn complete_all(&mut self, id: u64) {
        let poison = self.xfers.get_mut(&id).and_then(|x| x.poison.take());
        self.end(id, poison.map_or(End::Done, End::Failed));
    }

    /// Reads `len` bytes at `addr` of this side's memory.
    fn bytes(&self, addr: u64, len: usize) -> &[u8] {
        let off = (addr - self.base) as usize;
        &self.mem[off..off + len]
    }

    fn write_bytes(&mut self, addr: u64, data: &[u8]) {
        let off = addr.checked_sub(self.base).expect("inside our memory") as usize;
        assert!(
            off + data.len() <= self.mem.len(),
            "{}: {} bytes landing outside our memory",
            self.name,
            data.len()
        );
        self.mem[off..off + data.len()].copy_from_slice(data);
    }

    /// Carries out the machine's effects, as `Conn` does.
    pub fn effects(&mut self) {
        while let Some(e) = self.proto.poll() {
            match e {
                Effect::Send(m) => {
                    if let Control::Revoked { token } = &m {
                        self.revoked_sent.insert(token.id);
                        self.revokes_answered += 1;
                    }
                    let mut body = Vec::new();
                    m.encode(&mut body);
                    self.out.push_back(Frame {
                        body,
                        payload: Vec::new(),
                    });
                }
                Effect::SendWithPayload(m, local) => {
                    let mut body = Vec::new();
                    m.encode(&mut body);
                    let mut payload = Vec::new();
                    for (mr, _) in &local {
                        payload.extend_from_slice(self.bytes(mr.addr, mr.len));
                    }
                    self.out.push_back(Frame { body, payload });
                }
                Effect::Post {
                    set,
                    send,
                    requests: r,
                } => {
                    let r = match r {
                        Requested::Granted { xfer, ops, src } => {
                            self.granted.insert(xfer);
                            let keys: Vec<(Arc<[u8]>, u64)> =
                                src.into_iter().map(|p| (Arc::from(p.key), 0)).collect();
                            let mut pulls = Vec::new();
                            let mut bad = false;
                            for mut op in ops {
                                let lens: Vec<usize> = op.segs.iter().map(|s| s.1).collect();
                                match op_refs(op.plan, &lens, &keys) {
                                    Some(refs) => op.remote = refs,
                                    None => bad = true,
                                }
                                pulls.push(op);
                            }
                            if bad {
                                self.end(
                                    xfer,
                                    End::Failed(Failure::Protocol("a grant short of keys".into())),
                                );
                            } else {
                                self.pulls.extend(pulls);
                            }
                            continue;
                        }
                        r => r,
                    };
                    let (r, mut refs) = match r {
                        Requested::Remote { serve, runs } => {
                            let refs = pull_refs(&serve.local, &serve.plan, runs);
                            (Requested::Serve(serve), Some(refs.into_iter()))
                        }
                        r => (r, None),
                    };
                    let one_sided = refs.is_some();
                    let reqs = match r {
                        Requested::Ours(reqs) => reqs,
                        Requested::Remote { .. } | Requested::Granted { .. } => {
                            unreachable!("made a serve above, or taken before")
                        }
                        Requested::Serve(s) => {
                            let key = self.next;
                            self.next += 1;
                            let exact = requests(&s.local, &s.plan, true, |segs, expect| Req {
                                owner: Owner::Serve(key),
                                segs: segs.iter().map(|(m, _)| (m.addr, m.len)).collect(),
                                expect,
                                remote: refs.as_mut().and_then(|r| r.next()).unwrap_or_default(),
                                plan: None,
                            });
                            self.serving.insert(
                                key,
                                Serving {
                                    xfer: s.xfer,
                                    weight: s.weight,
                                    answer: s.answer,
                                    left: exact.len(),
                                    poison: None,
                                },
                            );
                            if exact.is_empty() {
                                self.served(key, Ok(()));
                            }
                            exact
                        }
                        Requested::Fill(n) => (0..n)
                            .map(|_| Req {
                                owner: Owner::Fill,
                                segs: vec![],
                                expect: None,
                                remote: vec![],
                                plan: None,
                            })
                            .collect(),
                    };
                    let q = if one_sided {
                        &mut self.pulls
                    } else if send {
                        &mut self.sends[set_index(set)]
                    } else {
                        &mut self.recvs[set_index(set)]
                    };
                    q.extend(reqs);
                }
                Effect::Complete(x) => self.complete_one(x),
                Effect::CompleteAll(x) => self.complete_all(x),
                Effect::Fail(x, f) => self.end(x, End::Failed(f)),
                Effect::Grant { serve, tokens } => {
                    let key = self.next;
                    self.next += 1;
                    let src = serve
                        .local
                        .iter()
                        .map(|(m, _)| PullRun {
                            gpu: false,
                            key: pull_key(m.addr, m.len),
                        })
                        .collect();
                    let mut body = Vec::new();
                    let mut leases = Vec::new();
                    for t in self.proto.lease_wanted(&tokens) {
                        if let Ok((addr, len, region)) = self.reg.leasable(t, self.conn) {
                            leases.push(Lease {
                                token: t,
                                addr,
                                len,
                                gpu: false,
                                write: self.records.contains(&t.id),
                                key: pull_key(addr, len as usize),
                            });
                            self.proto.lease_given(t, region);
                        }
                    }
                    Control::ReadGrant {
                        xfer: serve.xfer,
                        src,
                        leases,
                    }
                    .encode(&mut body);
                    self.out.push_back(Frame {
                        body,
                        payload: Vec::new(),
                    });
                    self.serving.insert(
                        key,
                        Serving {
                            xfer: serve.xfer,
                            weight: serve.weight,
                            answer: serve.answer,
                            left: 1,
                            poison: None,
                        },
                    );
                    self.grants.insert(serve.xfer, key);
                }
                Effect::Release(xfer) => {
                    if let Some(key) = self.grants.remove(&xfer) {
                        self.served(key, Ok(()));
                    }
                }
                Effect::Abandon(reqs, f) => {
                    for r in reqs {
                        if let Owner::Ours(x) = r.owner {
                            self.end(x, End::Failed(f.clone()));
                        }
                    }
                }
            }
        }
    }

    /// The requests serving a peer's request `key` ended.
    fn served(&mut self, key: u64, outcome: Result<(), Failure>) {
        if let Some(s) = self.serving.remove(&key) {
            let outcome = match (outcome, s.poison) {
                (Ok(()), Some(p)) => Err(p),
                (o, _) => o,
            };
            self.proto.served_ended(s.xfer, s.weight, s.answer, outcome);
        }
    }

    /// A request of ours finished, having moved `n` bytes.
    fn finished(&mut self, r: &Req, n: usize, set: Set) {
        if let Some(want) = r.expect.filter(|&w| w != n) {
            if set == Set::Msg {
                self.fail(Failure::Protocol(format!(
                    "message size mismatch ({n} bytes arrived, {want} expected)"
                )));
                return;
            }
            let why = Failure::Refused(format!("the peer sent {n} of {want} bytes"));
            match r.owner {
                Owner::Ours(x) => {
                    if let Some(x) = self.xfers.get_mut(&x) {
                        x.poison.get_or_insert(why);
                    }
                }
                Owner::Serve(k) => {
                    if let Some(s) = self.serving.get_mut(&k) {
                        s.poison.get_or_insert(why);
                    }
                }
                Owner::Fill => {}
            }
        }
        match r.owner {
            Owner::Ours(x) => self.complete_one(x),
            Owner::Serve(k) => {
                let done = self.serving.get_mut(&k).map(|s| {
                    s.left -= 1;
                    s.left == 0
                });
                if done == Some(true) {
                    self.served(k, Ok(()));
                }
            }
            Owner::Fill => {}
        }
        self.effects();
    }

    /// The connection fails: the net stops, and everything in flight ends
    /// with the reason (as `Conn::fail`).
    pub fn fail(&mut self, why: Failure) {
        if self.failed.is_none() {
            self.failed = Some(why.clone());
        }
        self.proto.fail(why);
        let why = self.proto.failure().cloned().expect("failed");
        let mut mine = Vec::new();
        for q in self.sends.iter_mut().chain(self.recvs.iter_mut()) {
            mine.extend(q.drain(..));
        }
        self.pulls.clear();
        self.pushes.clear();
        self.grants.clear();
        self.serving.clear();
        self.out.clear();
        self.proto.abandon();
        while let Some(e) = self.proto.poll() {
            if let Effect::Abandon(reqs, _) = e {
                mine.extend(reqs);
            }
        }
        for r in mine {
            if let Owner::Ours(x) = r.owner {
                self.end(x, End::Failed(why.clone()));
            }
        }
        let ids: Vec<u64> = self.xfers.keys().copied().collect();
        for x in ids {
            self.end(x, End::Failed(why.clone()));
        }
    }

    /// Our transfer `id`'s end.
    pub fn end_of(&self, id: u64) -> End {
        self.xfers.get(&id).map_or(End::Pending, |x| x.end.clone())
    }

    /// Net requests posted and not yet moved.
    pub fn queued(&self) -> usize {
        self.sends
            .iter()
            .chain(self.recvs.iter())
            .map(|q| q.len())
            .sum::<usize>()
            + self.pulls.len()
            + self.pushes.len()
    }
}

/// Where the pieces `refs` lie in `exporter`'s memory, as (address,
/// length): each inside the range its key names and inside the memory,
/// together `room` bytes; None otherwise (a net refuses such a request).
fn exported(exporter: &Side, refs: &[RemoteRef], room: usize) -> Option<Vec<(u64, usize)>> {
    let mut out = Vec::with_capacity(refs.len());
    let mut total = 0usize;
    for p in refs {
        let (a, l) = p.key.split_at_checked(8)?;
        let (addr, len) = (
            u64::from_le_bytes(a.try_into().ok()?),
            u64::from_le_bytes(l.try_into().ok()?),
        );
        let end = p.off.checked_add(p.len)?;
        let off = addr.checked_sub(exporter.base)?.checked_add(p.off)?;
        if end > len || off.checked_add(p.len)? > exporter.mem.len() as u64 {
            return None;
        }
        out.push((addr + p.off, p.len as usize));
        total += p.len as usize;
    }
    (total == room).then_some(out)
}

/// The pair's pull key: the run's address and length in the writer's
/// memory.
fn pull_key(addr: u64, len: usize) -> Vec<u8> {
    let mut k = addr.to_le_bytes().to_vec();
    k.extend_from_slice(&(len as u64).to_le_bytes());
    k
}

/// The two sides and the links between them.
pub struct Pair {
    pub a: Side,
    pub b: Side,
}

/// Which way a step goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    AtoB,
    BtoA,
}

impl Pair {
    /// Two sides of `mem` bytes each with the default limits.
    pub fn new(mem: usize) -> Pair {
        Pair::with_limits(mem, Limits::default())
    }

    pub fn with_limits(mem: usize, limits: Limits) -> Pair {
        Pair {
            a: Side::new("a", 1, mem, limits),
            b: Side::new("b", 2, mem, limits),
        }
    }

    /// Two sides whose writes are pulled by their targets (the same-host
    /// net's one-sided path).
    pub fn pulling(mem: usize, limits: Limits) -> Pair {
        Pair {
            a: Side::with_pull("a", 1, mem, limits, true),
            b: Side::with_pull("b", 2, mem, limits, true),
        }
    }

    fn ends(&mut self, d: Dir) -> (&mut Side, &mut Side) {
        match d {
            Dir::AtoB => (&mut self.a, &mut self.b),
            Dir::BtoA => (&mut self.b, &mut self.a),
        }
    }

    /// Delivers one control frame from one side to the other; false if
    /// none waits.
    pub fn deliver(&mut self, d: Dir) -> bool {
        let (from, to) = self.ends(d);
        let Some(f) = from.out.pop_front() else {
            return false;
        };
        Pair::receive(from, to, f);
        true
    }

    /// Hands `to` a frame as if `from` had sent it (a hostile peer's too).
    pub fn inject(&mut self, d: Dir, f: Frame) {
        let (from, to) = self.ends(d);
        Pair::receive(from, to, f);
    }

    fn receive(from: &mut Side, to: &mut Side, f: Frame) {
        if to.failed.is_some() {
            return;
        }
        let m = match Control::decode(&f.body) {
            Ok(m) => m,
            Err(e) => {
                to.fail(Failure::Protocol(format!("malformed control message: {e}")));
                Pair::lost(from);
                return;
            }
        };
        // As a connection's reader does: the frame is heard first (the
        // machine answers it with the receives it has to acknowledge).
        to.proto.heard(0);
        let r = to.proto.on_control(m);
        to.effects();
        let payload = match r {
            Ok(p) => p,
            Err(why) => {
                to.fail(why);
                Pair::lost(from);
                return;
            }
        };
        // The bytes after the frame, as a reader takes them: exactly the
        // length the machine names, or the connection is out of step.
        let want = match &payload {
            Payload::Write { len, .. } => *len,
            Payload::Drop { len, .. } => *len,
            Payload::Read { local, .. } => local.iter().map(|(m, _)| m.len).sum(),
            Payload::Nothing | Payload::Notif { .. } => 0,
        };
        if f.payload.len() != want {
            to.fail(Failure::Lost(format!(
                "control stream out of step: {} payload bytes where {want} were due",
                f.payload.len()
            )));
            Pair::lost(from);
            return;
        }
        match payload {
            Payload::Nothing => {}
            Payload::Notif { name, msg } => to.notifs.push((name, msg)),
            Payload::Write {
                xfer,
                local,
                weight,
                ..
            } => {
                let mut at = 0;
                for (m, _) in &local {
                    to.write_bytes(m.addr, &f.payload[at..at + m.len]);
                    at += m.len;
                }
                to.proto.inline_write_landed(xfer, weight, true);
            }
            Payload::Drop { refusal, .. } => {
                if let Some((xfer, reason)) = refusal {
                    to.proto.inline_write_dropped(xfer, reason);
                }
            }
            Payload::Read { xfer, local } => {
                let mut at = 0;
                for (m, _) in &local {
                    to.write_bytes(m.addr, &f.payload[at..at + m.len]);
                    at += m.len;
                }
                to.proto.inline_read_landed(xfer);
            }
        }
        to.effects();
    }

    /// The other side failed: `peer` sees the control connection close.
    fn lost(peer: &mut Side) {
        if peer.failed.is_none() {
            peer.fail(Failure::Lost("peer went away".into()));
        }
    }

    /// Moves one message of `set` from one side's oldest send to the
    /// other's oldest receive; false if either is missing.
    pub fn move_one(&mut self, d: Dir, set: Set) -> bool {
        let i = set_index(set);
        let (from, to) = self.ends(d);
        if from.failed.is_some() || to.failed.is_some() {
            return false;
        }
        if from.sends[i].is_empty() || to.recvs[i].is_empty() {
            return false;
        }
        let (Some(s), Some(r)) = (from.sends[i].pop_front(), to.recvs[i].pop_front()) else {
            return false;
        };
        let mut data = Vec::new();
        for &(addr, len) in &s.segs {
            data.extend_from_slice(from.bytes(addr, len));
        }
        let room: usize = r.segs.iter().map(|s| s.1).sum();
        if data.len() > room {
            // The receiver's part check refuses it before a byte lands.
            to.fail(Failure::Protocol(format!(
                "a message of {} bytes for a receive of {room}",
                data.len()
            )));
            Pair::lost(from);
            return true;
        }
        let mut at = 0;
        for &(addr, len) in &r.segs {
            let n = len.min(data.len() - at);
            to.write_bytes(addr, &data[at..at + n]);
            at += n;
        }
        let n = data.len();
        from.finished(&s, n, set);
        to.finished(&r, n, set);
        if to.failed.is_some() && from.failed.is_none() {
            from.fail(Failure::Lost("peer went away".into()));
        }
        true
    }

    /// Makes the oldest pull of the side `d` points to, copying from the
    /// other side's memory; false if none waits. A piece outside what the
    /// writer exported, or outside its memory, fails the request (the net
    /// refuses it), and no byte of it lands.
    pub fn pull_one(&mut self, d: Dir) -> bool {
        self.copy_one(d, false)
    }

    /// Makes the oldest push of the side `d` points to, copying into the
    /// other side's memory; false if none waits. A piece outside what the
    /// target leased, or outside its memory, fails the request, and no
    /// byte of it lands.
    pub fn push_one(&mut self, d: Dir) -> bool {
        self.copy_one(d, true)
    }

    /// [`Pair::pull_one`] and [`Pair::push_one`]: the oldest one-sided copy
    /// of that kind the side `d` points to posted, between its memory and
    /// the peer's pieces.
    fn copy_one(&mut self, d: Dir, push: bool) -> bool {
        let (peer, to) = self.ends(d);
        if peer.failed.is_some() || to.failed.is_some() {
            return false;
        }
        let q = if push { &mut to.pushes } else { &mut to.pulls };
        let Some(r) = q.pop_front() else {
            return false;
        };
        if let Owner::Ours(x) = r.owner {
            let used = to.leased.get(&x).map_or(&[][..], |u| &u[..]);
            assert!(
                used.iter().all(|t| !to.revoked_sent.contains(t)),
                "{}: a {} a lease after answering its revoke",
                to.name,
                if push { "push into" } else { "pull from" }
            );
        }
        let room: usize = r.segs.iter().map(|s| s.1).sum();
        let Some(theirs) = exported(peer, &r.remote, room) else {
            // As a net's refusal: the request fails, the connection lives.
            to.finished(&r, usize::MAX, Set::Rma);
            return true;
        };
        let (from, src) = if push {
            (&*to, &r.segs)
        } else {
            (&*peer, &theirs)
        };
        let mut data = Vec::with_capacity(room);
        for &(addr, len) in src {
            data.extend_from_slice(from.bytes(addr, len));
        }
        let (into, dst) = if push {
            (&mut *peer, &theirs)
        } else {
            (&mut *to, &r.segs)
        };
        let mut at = 0;
        for &(addr, len) in dst {
            into.write_bytes(addr, &data[at..at + len]);
            at += len;
        }
        to.finished(&r, room, Set::Rma);
        true
    }

    /// Makes every pull the target of `d` can make, without delivering
    /// what it writes back; returns how many.
    pub fn settle_side(&mut self, d: Dir) -> usize {
        let mut n = 0;
        while self.pull_one(d) {
            n += 1;
        }
        n
    }

    /// Runs every step that can run (frames both ways, messages on both
    /// sets both ways) until none can; returns the steps taken.
    pub fn settle(&mut self) -> usize {
        let mut steps = 0;
        loop {
            let mut any = false;
            for d in [Dir::AtoB, Dir::BtoA] {
                while self.deliver(d) {
                    any = true;
                    steps += 1;
                }
                for set in [Set::Msg, Set::Rma] {
                    while self.move_one(d, set) {
                        any = true;
                        steps += 1;
                    }
                }
                while self.pull_one(d) || self.push_one(d) {
                    any = true;
                    steps += 1;
                }
            }
            if !any {
                return steps;
            }
        }
    }
}
