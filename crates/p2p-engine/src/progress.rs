//! The progress thread of one connection: it owns the connection's net comms,
//! posts chunk requests within each comm's window, tests the oldest request
//! of every comm, and completes transfers. Chunks of each transfer are dealt
//! across the channels of a set by a cursor that both peers advance in the
//! same order, so send and receive requests line up on every comm.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};

use crate::memory::Region;
use crate::net::{MemRef, MrHandle, RecvComm, ReqId, SendComm};
use crate::transfer::{Failure, Transfer};

/// The two sets of channels of a connection: two-sided messages, and the
/// one-sided (write/read) data whose order the data's receiver decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Set {
    Msg = 0,
    Rma = 1,
}

/// One request's worth of a transfer.
pub struct ChunkOp {
    pub mem: MemRef,
    /// The region the memory belongs to (None for empty filler sends).
    pub region: Option<Arc<Region>>,
    pub xfer: Arc<Transfer>,
    /// For receives: the bytes that must arrive (`None`: any up to `mem.len`).
    pub expect: Option<usize>,
}

pub enum Cmd {
    Send(Set, Vec<ChunkOp>),
    Recv(Set, Vec<ChunkOp>),
    /// A region was deregistered: drop its registrations with the comms.
    DropRegion(u64),
    Shutdown(String),
}

enum Comm {
    Send(Box<dyn SendComm>),
    Recv(Box<dyn RecvComm>),
}

struct CommState {
    comm: Comm,
    window: usize,
    pending: VecDeque<ChunkOp>,
    inflight: VecDeque<(ReqId, ChunkOp)>,
    mrs: HashMap<u64, MrHandle>,
    /// A short message breaks the pairing of later requests (two-sided set);
    /// on the one-sided set an empty message is a refused read's filler.
    mismatch_is_fatal: bool,
}

/// Everything the progress thread drives.
pub struct Progress {
    /// `[set][channel]`, send comms and receive comms.
    sends: [Vec<CommState>; 2],
    recvs: [Vec<CommState>; 2],
    send_cursor: [usize; 2],
    recv_cursor: [usize; 2],
    cmds: Receiver<Cmd>,
    polling: bool,
    spin: Duration,
    conn: u64,
}

impl CommState {
    fn new(comm: Comm, window: usize, mismatch_is_fatal: bool) -> Self {
        CommState {
            comm,
            window,
            mismatch_is_fatal,
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            mrs: HashMap::new(),
        }
    }

    /// Posts what the window allows; true if anything was posted.
    fn post(&mut self) -> Result<bool, String> {
        let mut any = false;
        while self.inflight.len() < self.window {
            let Some(op) = self.pending.front() else {
                break;
            };
            let mr = match &op.region {
                None => MrHandle(0),
                Some(r) => match self.mrs.get(&r.id) {
                    Some(m) => *m,
                    None => {
                        let whole = MemRef {
                            addr: r.addr,
                            len: r.len,
                            kind: op.mem.kind,
                        };
                        let m = match &mut self.comm {
                            Comm::Send(c) => c.reg_mr(whole),
                            Comm::Recv(c) => c.reg_mr(whole),
                        }
                        .map_err(|e| format!("registering region {}: {e}", r.id))?;
                        self.mrs.insert(r.id, m);
                        m
                    }
                },
            };
            let posted = match &mut self.comm {
                Comm::Send(c) => c.isend(op.mem, mr),
                Comm::Recv(c) => c.irecv(op.mem, mr),
            }
            .map_err(|e| e.to_string())?;
            match posted {
                Some(req) => {
                    let op = self.pending.pop_front().expect("front exists");
                    self.inflight.push_back((req, op));
                    any = true;
                }
                None => break,
            }
        }
        Ok(any)
    }

    /// Tests the oldest request, and the next while they complete.
    fn test(&mut self) -> Result<bool, String> {
        let mut any = false;
        while let Some((req, _)) = self.inflight.front() {
            let r = match &mut self.comm {
                Comm::Send(c) => c.test(*req),
                Comm::Recv(c) => c.test(*req),
            }
            .map_err(|e| e.to_string())?;
            let Some(n) = r else { break };
            let (_, op) = self.inflight.pop_front().expect("front exists");
            any = true;
            match op.expect {
                Some(want) if n != want && self.mismatch_is_fatal => {
                    op.xfer.fail(Failure::Lost(format!(
                        "message size mismatch: {n} bytes arrived where {want} were expected (sender and receiver sizes must match)"
                    )));
                    return Err(format!(
                        "message size mismatch ({n} bytes arrived, {want} expected); the message streams are out of step"
                    ));
                }
                Some(want) if n != want => {
                    op.xfer.fail(Failure::Refused(format!(
                        "the peer sent {n} of {want} bytes (request refused)"
                    )));
                }
                _ => op.xfer.complete_one(),
            }
        }
        Ok(any)
    }

    fn fail_all(&mut self, why: &Failure) {
        for (_, op) in self.inflight.drain(..) {
            op.xfer.fail(why.clone());
        }
        for op in self.pending.drain(..) {
            op.xfer.fail(why.clone());
        }
    }

    fn drop_region(&mut self, id: u64) {
        if let Some(m) = self.mrs.remove(&id) {
            let r = match &mut self.comm {
                Comm::Send(c) => c.dereg_mr(m),
                Comm::Recv(c) => c.dereg_mr(m),
            };
            if let Err(e) = r {
                tracing::warn!("deregistering region {id}: {e}");
            }
        }
    }
}

impl Progress {
    /// `sends[set]` / `recvs[set]`: one comm per channel.
    pub fn new(
        conn: u64,
        sends: [Vec<Box<dyn SendComm>>; 2],
        recvs: [Vec<Box<dyn RecvComm>>; 2],
        windows: (usize, usize),
        cmds: Receiver<Cmd>,
        polling: bool,
        spin: Duration,
    ) -> Self {
        let [s0, s1] = sends;
        let [r0, r1] = recvs;
        let ws = |v: Vec<Box<dyn SendComm>>, fatal| {
            v.into_iter()
                .map(|c| CommState::new(Comm::Send(c), windows.0, fatal))
                .collect()
        };
        let wr = |v: Vec<Box<dyn RecvComm>>, fatal| {
            v.into_iter()
                .map(|c| CommState::new(Comm::Recv(c), windows.1, fatal))
                .collect()
        };
        Progress {
            sends: [ws(s0, true), ws(s1, false)],
            recvs: [wr(r0, true), wr(r1, false)],
            send_cursor: [0; 2],
            recv_cursor: [0; 2],
            cmds,
            polling,
            spin,
            conn,
        }
    }

    fn deal(comms: &mut [CommState], cursor: &mut usize, ops: Vec<ChunkOp>) {
        let n = comms.len();
        for op in ops {
            comms[*cursor % n].pending.push_back(op);
            *cursor = (*cursor + 1) % n;
        }
    }

    fn all(&mut self) -> impl Iterator<Item = &mut CommState> {
        let [a, b] = &mut self.sends;
        let [c, d] = &mut self.recvs;
        a.iter_mut()
            .chain(b.iter_mut())
            .chain(c.iter_mut())
            .chain(d.iter_mut())
    }

    /// Handles one command; Err(reason) to stop.
    fn command(&mut self, cmd: Cmd) -> Result<(), String> {
        match cmd {
            Cmd::Send(set, ops) => {
                let s = set as usize;
                Self::deal(&mut self.sends[s], &mut self.send_cursor[s], ops)
            }
            Cmd::Recv(set, ops) => {
                let s = set as usize;
                Self::deal(&mut self.recvs[s], &mut self.recv_cursor[s], ops)
            }
            Cmd::DropRegion(id) => self.all().for_each(|c| c.drop_region(id)),
            Cmd::Shutdown(why) => return Err(why),
        }
        Ok(())
    }

    /// Runs until shutdown or failure; returns the reason it stopped.
    pub fn run(mut self) -> String {
        let mut last_busy = Instant::now();
        let why = loop {
            let mut busy = false;
            let mut stop = None;
            loop {
                match self.cmds.try_recv() {
                    Ok(c) => {
                        busy = true;
                        if let Err(w) = self.command(c) {
                            stop = Some(w);
                            break;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        stop = Some("connection closed".to_string());
                        break;
                    }
                }
            }
            if let Some(w) = stop {
                break w;
            }
            let mut err = None;
            for c in self.all() {
                match c.post().and_then(|p| c.test().map(|t| p || t)) {
                    Ok(p) => busy |= p,
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = err {
                break format!("transport failed: {e}");
            }
            if busy {
                last_busy = Instant::now();
            } else {
                let outstanding = self.all().any(|c| !c.inflight.is_empty());
                if outstanding && (self.polling || last_busy.elapsed() < self.spin) {
                    std::thread::yield_now();
                } else {
                    // Woken by the transport's waker or by a new command.
                    std::thread::park_timeout(Duration::from_millis(if outstanding {
                        1
                    } else {
                        50
                    }));
                }
            }
        };
        let f = Failure::Lost(format!("connection {}: {why}", self.conn));
        for c in self.all() {
            c.fail_all(&f);
        }
        // Drain commands that raced with the shutdown.
        while let Ok(c) = self.cmds.try_recv() {
            if let Cmd::Send(_, ops) | Cmd::Recv(_, ops) = c {
                for op in ops {
                    op.xfer.fail(f.clone());
                }
            }
        }
        why
    }
}
