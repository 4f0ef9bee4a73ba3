//! Send comms: posting sends, and the I/O thread that stages and writes
//! them.

use super::*;

pub(super) struct SendOp {
    pub(super) seq: u64,
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) kind: MemKind,
    pub(super) cell: Arc<Cell>,
}

pub(super) struct SendShared {
    pub(super) failed: Mutex<Option<String>>,
}

pub(super) struct SendState {
    pub(super) q: VecDeque<(u64, usize, Arc<Cell>)>,
    pub(super) next_seq: u64,
}

pub struct SendComm {
    pub(super) token: usize,
    pub(super) cfg: EmuConfig,
    pub(super) sock: TcpStream,
    pub(super) tx: Mutex<Option<mpsc::Sender<SendOp>>>,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
    pub(super) shared: Arc<SendShared>,
    pub(super) st: Mutex<SendState>,
    pub(super) mrs: Mutex<HashMap<usize, Mr>>,
    pub(super) gate: Arc<Gate>,
}

impl SendComm {
    pub(super) fn start(token: usize, sock: TcpStream, cfg: EmuConfig) -> R<Arc<SendComm>> {
        let shared = Arc::new(SendShared {
            failed: Mutex::new(None),
        });
        let io = sock
            .try_clone()
            .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("connect: {e}")))?;
        let (tx, rx) = mpsc::channel::<SendOp>();
        let sh = shared.clone();
        let gate = Arc::new(Gate::new(cfg.window(), cfg.lenient_progress));
        let g = gate.clone();
        let (drop_after, bufs) = (cfg.drop_after, cfg.stage_bufs);
        let thread = std::thread::Builder::new()
            .name("emu-tx".into())
            .spawn(move || {
                let sh2 = sh.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    tx_loop(io, rx, sh, g, drop_after, bufs)
                }));
                if r.is_err() {
                    sh2.failed
                        .lock()
                        .get_or_insert_with(|| "send thread panicked".into());
                }
            })
            .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("spawning the send thread: {e}")))?;
        Ok(Arc::new(SendComm {
            token,
            cfg,
            sock,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            shared,
            st: Mutex::new(SendState {
                q: VecDeque::new(),
                next_seq: 0,
            }),
            mrs: Mutex::new(HashMap::new()),
            gate,
        }))
    }
}

/// A send waiting in the send thread: `allowed` of its bytes go out (fewer
/// under fault injection), the copies of `staged` of them out of GPU memory
/// are queued.
pub(super) struct TxItem {
    pub(super) op: SendOp,
    pub(super) allowed: usize,
    pub(super) staged: usize,
}

/// A send thread's sends in order, and its staging.
pub(super) struct TxState {
    pub(super) items: VecDeque<TxItem>,
    pub(super) stage: Option<TxStage>,
    /// Bytes given to the socket or planned for it, for fault injection.
    pub(super) planned: u64,
    pub(super) drop_after: Option<u64>,
    pub(super) bufs: usize,
    pub(super) gate: Arc<Gate>,
    pub(super) sh: Arc<SendShared>,
}

impl TxState {
    /// Moves the sends posted since into `items` (without waiting).
    pub(super) fn take_posted(&mut self, rx: &mpsc::Receiver<SendOp>) {
        while let Ok(op) = rx.try_recv() {
            self.push(op);
        }
    }

    pub(super) fn push(&mut self, op: SendOp) {
        let allowed = self.drop_after.map_or(op.len, |limit| {
            (limit.saturating_sub(self.planned) as usize).min(op.len)
        });
        self.planned += allowed as u64;
        self.items.push_back(TxItem {
            op,
            allowed,
            staged: 0,
        });
    }

    /// Queues copies out of GPU memory for the sends, in order, while the
    /// stage has a free buffer. Stops at a send of another GPU: the stage
    /// is rebuilt for it once everything before it is written.
    pub(super) fn stage_ahead(&mut self) -> Result<(), String> {
        let Some(stg) = self.stage.as_mut() else {
            return Ok(());
        };
        for it in self.items.iter_mut() {
            let MemKind::Cuda(dev) = it.op.kind else {
                continue;
            };
            if dev != stg.dev() {
                break;
            }
            while it.staged < it.allowed {
                if !stg.has_room() {
                    return Ok(());
                }
                let l = stage::SLOT.min(it.allowed - it.staged);
                // SAFETY: the range lies inside the send's registration and
                // the caller keeps it until the send is reported done, which
                // is after its bytes were written (or the stage was reset).
                unsafe { stg.queue(it.op.addr + it.staged as u64, l) }?;
                it.staged += l;
            }
        }
        Ok(())
    }

    /// Writes the payload of the oldest send: host memory straight from the
    /// buffer, GPU memory from its staged copies, queueing further copies
    /// (of this send and the next) as buffers free up.
    pub(super) fn write_front(
        &mut self,
        s: &mut &TcpStream,
        rx: &mpsc::Receiver<SendOp>,
    ) -> Result<(), String> {
        let (kind, addr, allowed) = {
            let it = &self.items[0];
            (it.op.kind, it.op.addr, it.allowed)
        };
        match kind {
            MemKind::Host => {
                // SAFETY: the range was checked against the comm's
                // registration and stays valid until the request is
                // reported done.
                let data = unsafe { std::slice::from_raw_parts(addr as *const u8, allowed) };
                for piece in data.chunks(PIECE) {
                    self.take(piece.len())?;
                    s.write_all(piece).map_err(|e| e.to_string())?;
                }
                timing::mark(Spent::Socket);
                Ok(())
            }
            MemKind::Cuda(dev) => {
                if self.stage.as_ref().is_none_or(|st| st.dev() != dev) {
                    // Everything staged before was written: nothing is queued.
                    self.stage = None;
                    self.stage = Some(TxStage::new(dev, self.bufs)?);
                }
                let mut written = 0;
                while written < allowed {
                    self.take_posted(rx);
                    self.stage_ahead()?;
                    let stg = self.stage.as_mut().ok_or("staging")?;
                    timing::mark(Spent::Other);
                    let chunk = stg.front()?;
                    timing::mark(Spent::Copies);
                    let sh = &self.sh;
                    self.gate
                        .take(chunk.len() as u64, || sh.failed.lock().is_some())?;
                    s.write_all(chunk).map_err(|e| e.to_string())?;
                    timing::mark(Spent::Socket);
                    written += chunk.len();
                    stg.pop();
                }
                Ok(())
            }
        }
    }

    /// Waits until `test` scheduled `n` more bytes.
    fn take(&self, n: usize) -> Result<(), String> {
        let sh = &self.sh;
        self.gate.take(n as u64, || sh.failed.lock().is_some())
    }

    /// No copy may read a send's memory once it is reported.
    pub(super) fn reset_stage(&mut self) {
        if let Some(st) = self.stage.as_mut() {
            st.reset();
        }
    }
}

pub(super) fn tx_loop(
    sock: TcpStream,
    rx: mpsc::Receiver<SendOp>,
    sh: Arc<SendShared>,
    gate: Arc<Gate>,
    drop_after: Option<u64>,
    bufs: usize,
) {
    let mut tx = TxState {
        items: VecDeque::new(),
        stage: None,
        planned: 0,
        drop_after,
        bufs,
        gate,
        sh: sh.clone(),
    };
    let _account = stage::account(|| {
        let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        format!("emu tx to {peer}")
    });
    let mut s = &sock;
    loop {
        if tx.items.is_empty() {
            timing::mark(Spent::Other);
            let op = rx.recv();
            timing::mark(Spent::Waiting);
            match op {
                Ok(op) => tx.push(op),
                Err(_) => return,
            }
        }
        tx.take_posted(&rx);
        if let Some(f) = sh.failed.lock().clone() {
            tx.reset_stage();
            for it in tx.items.drain(..) {
                it.op.cell.fail(&f);
            }
            continue;
        }
        let (seq, len, allowed) = {
            let it = &tx.items[0];
            (it.op.seq, it.op.len, it.allowed)
        };
        let mut hdr = [0u8; HDR];
        hdr[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        hdr[8..16].copy_from_slice(&seq.to_le_bytes());
        hdr[16..24].copy_from_slice(&(len as u64).to_le_bytes());
        timing::mark(Spent::Other);
        let r = s.write_all(&hdr).map_err(|e| e.to_string()).and_then(|_| {
            if allowed == 0 {
                Ok(())
            } else {
                tx.write_front(&mut s, &rx)
            }
        });
        let why = match r {
            Err(e) => Some(format!("send: {e}")),
            Ok(()) if allowed < len => {
                crate::warn(&format!(
                    "fault injection: dropping the peer after {} bytes (NCCL_NET_EMU_DROP_AFTER_BYTES)",
                    tx.planned
                ));
                let _ = sock.shutdown(std::net::Shutdown::Both);
                Some(format!(
                    "connection dropped after {} bytes (fault injection)",
                    tx.planned
                ))
            }
            Ok(()) => None,
        };
        let Some(it) = tx.items.pop_front() else {
            continue;
        };
        timing::bytes(HDR + allowed);
        match why {
            None => it.op.cell.done(len, None),
            Some(w) => {
                tx.reset_stage();
                it.op.cell.fail(&w);
                sh.failed.lock().get_or_insert(w);
            }
        }
    }
}

pub fn isend(t: usize, data: u64, size: c_int, mh: usize) -> R<usize> {
    let c = match obj(t, "isend")? {
        Obj::Send(c) => c,
        _ => {
            return Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("isend on {t:#x}, which is not a send comm"),
            ))
        }
    };
    if size < 0 {
        return Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("isend of {size} bytes"),
        ));
    }
    if let Some(f) = c.shared.failed.lock().clone() {
        return Err(error(NCCL_REMOTE_ERROR, f));
    }
    let mr = find_mr(&c.mrs, mh, data, size as usize, "isend")?;
    let mut st = c.st.lock();
    if st.q.len() >= MAX_REQUESTS {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("isend: request {} in flight on send comm {t:#x}; TCPX allows {MAX_REQUESTS} per comm", st.q.len() + 1),
        ));
    }
    let seq = st.next_seq;
    st.next_seq += 1;
    let cell = Cell::new();
    let rt = token();
    registry()
        .lock()
        .reqs
        .insert(rt, ReqOwner::Send(c.clone(), seq));
    st.q.push_back((seq, rt, cell.clone()));
    c.gate.post(size as u64);
    drop(st);
    let op = SendOp {
        seq,
        addr: data,
        len: size as usize,
        kind: mr.kind,
        cell,
    };
    let sent =
        c.tx.lock()
            .as_ref()
            .map(|tx| tx.send(op).is_ok())
            .unwrap_or(false);
    if !sent {
        return Err(error(NCCL_SYSTEM_ERROR, "isend: the send thread is gone"));
    }
    Ok(rt)
}

pub(super) fn test_send(c: &Arc<SendComm>, seq: u64) -> R<Option<usize>> {
    let mut st = c.st.lock();
    let Some((head, rt, cell)) = st.q.front().cloned() else {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            "test of a send request that is not in flight",
        ));
    };
    if head != seq {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("test of send request #{seq} while #{head} is the oldest; TCPX tests only the FIFO head"),
        ));
    }
    // As tcpxTest: the comm's progress first, then the head.
    c.gate.schedule();
    let failed = c.shared.failed.lock().clone();
    match look(&cell, c.cfg.delay, failed)? {
        Seen::NotYet => Ok(None),
        Seen::Done(n) => {
            st.q.pop_front();
            drop(st);
            unregister_reqs(&[rt]);
            Ok(Some(n))
        }
    }
}

pub(super) fn close_send_comm(c: &Arc<SendComm>) {
    c.shared
        .failed
        .lock()
        .get_or_insert_with(|| "comm closed".into());
    c.gate.close();
    let _ = c.sock.shutdown(std::net::Shutdown::Both);
    c.tx.lock().take();
    join(c.thread.lock().take());
    let tokens: Vec<usize> = c.st.lock().q.drain(..).map(|(_, t, _)| t).collect();
    unregister_reqs(&tokens);
    c.mrs.lock().clear();
}

pub(super) fn join(t: Option<JoinHandle<()>>) {
    let Some(t) = t else { return };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if t.is_finished() {
        let _ = t.join();
    }
}
