//! The hub: this endpoint's same-host listeners, dialing, and the
//! connections accepted until `accept_local` takes them.

use super::*;

/// Who holds a same-host name we could not bind (another user's process
/// there is a squatter: connecting peers refuse it).
fn holder(addr: &SocketAddr) -> String {
    match UnixStream::connect_addr(addr).and_then(|s| os::peer_cred(&s)) {
        Ok(c) if c.uid != os::my_uid() => format!(
            "; it is held by process {} of uid {}, another user: peers refuse it",
            c.pid, c.uid
        ),
        Ok(c) => format!("; held by process {}", c.pid),
        Err(_) => String::new(),
    }
}

impl Hub {
    /// Binds the endpoint's names and starts accepting.
    pub fn start(p: HubParams) -> Result<Arc<Hub>> {
        let mut names = vec![format!("{}:{}:{}", prefix(), p.ip, p.port)];
        if p.gpu_index >= 0 {
            names.push(name_of(&LocalPeer::Index(p.gpu_index))?);
        }
        if !p.gpu_bdf.is_empty() {
            names.push(name_of(&LocalPeer::Bdf(p.gpu_bdf.clone()))?);
        }
        let mut listeners = Vec::new();
        let mut bound = Vec::new();
        for (i, n) in names.into_iter().enumerate() {
            let addr = SocketAddr::from_abstract_name(n.as_bytes())
                .map_err(|e| Error::io(format!("socket name {n}"), e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => {
                    listeners.push(l);
                    bound.push(n);
                }
                Err(e) if i == 0 => tracing::warn!(
                    "cannot bind the same-host socket {n} ({e}){}: peers on this host cannot connect_local to this endpoint",
                    holder(&addr)
                ),
                Err(e) => tracing::info!(
                    "same-host name {n} not taken ({e}){}: another endpoint has it; connect to this one by metadata",
                    holder(&addr)
                ),
            }
        }
        let hub = Arc::new(Hub {
            p,
            nonce: crate::memory::random_u64() | 1,
            establish: OnceLock::new(),
            accepted: Mutex::new(VecDeque::new()),
            accepted_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            names: bound,
            acceptors: Mutex::new(Vec::new()),
            handshaking: AtomicU64::new(0),
        });
        for l in listeners {
            let weak = Arc::downgrade(&hub);
            let owner = move || {
                weak.upgrade()
                    .filter(|hub| !hub.stopping.load(Ordering::Acquire))
            };
            let take = |hub: Arc<Hub>, s| hub.handshake(s);
            let home =
                crate::accept::listen_on(&hub.p.workers, l, "same-host connections", owner, take)
                    .map_err(|e| Error::io("making a same-host listener non-blocking", e))?;
            hub.acceptors.lock().push(home);
        }
        Ok(hub)
    }

    /// Runs the hello and the engine's handshake of a stream a peer
    /// dialed on a thread of its own, within the handshakes' bound: a
    /// flood of same-host connections takes neither every thread nor
    /// descriptor.
    fn handshake(self: Arc<Self>, s: UnixStream) {
        let busy = self.handshaking.load(Ordering::Acquire) as usize;
        if busy >= self.p.max_handshakes {
            tracing::debug!(
                "closed a same-host connection at once: {busy} handshakes in \
                 progress (TCPX_P2P_MAX_HANDSHAKES={})",
                self.p.max_handshakes,
            );
            return;
        }
        self.handshaking.fetch_add(1, Ordering::AcqRel);
        let h = self.clone();
        let r = std::thread::Builder::new()
            .name("tcpx-local-hs".into())
            .spawn(move || {
                h.admit(s);
                h.handshaking.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = r {
            self.handshaking.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("cannot spawn a same-host handshake thread: {e}");
        }
    }

    /// Sets how a checked stream becomes a connection of the endpoint
    /// (once, as the endpoint is made).
    pub fn set_establish(&self, f: Box<Establish>) {
        let _ = self.establish.set(f);
    }

    /// The engine's handshake on a checked stream: the connection's id.
    fn establish(&self, s: UnixStream, initiator: bool) -> Result<u64> {
        match self.establish.get() {
            Some(f) if !self.stopping.load(Ordering::Acquire) => f(s, initiator),
            _ => Err(Error::invalid("the endpoint is closing")),
        }
    }

    /// A stream a peer dialed: the hello, then the engine's handshake; the
    /// connection waits for `accept_local`.
    pub(super) fn admit(self: &Arc<Self>, mut s: UnixStream) {
        let r = hello(&mut s, false, self).and_then(|h| {
            let conn = self.establish(s, false)?;
            Ok(AcceptedLocal {
                conn,
                gpu_index: h.gpu_index,
                gpu_bdf: h.gpu_bdf,
            })
        });
        match r {
            Ok(a) => {
                self.accepted.lock().push_back(a);
                self.accepted_cv.notify_all();
            }
            Err(e) => tracing::warn!("refused a same-host connection: {e}"),
        }
    }

    /// Dials the endpoint `peer` names on this host: the hello, then the
    /// engine's handshake; the connection's id.
    pub fn connect(self: &Arc<Self>, peer: &LocalPeer) -> Result<u64> {
        let name = name_of(peer)?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(format!("socket name {name}"), e))?;
        // The peer may still be starting: retry a refused connect briefly.
        let give_up = crate::timeout::deadline_after(self.p.timeout.min(Duration::from_secs(2)))
            .unwrap_or_else(Instant::now);
        let mut s = loop {
            match UnixStream::connect_addr(&addr) {
                Ok(s) => break s,
                Err(e) if e.kind() == ErrorKind::ConnectionRefused && Instant::now() < give_up => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(Error::Connect {
                        peer: format!("{peer:?} on this host"),
                        reason: format!("no endpoint listens on {name:?}: {e}"),
                    })
                }
            }
        };
        hello(&mut s, true, self)?;
        self.establish(s, true)
    }

    /// The next same-host connection a peer made (None: wait forever).
    pub fn accept(&self, timeout: Option<Duration>) -> Result<AcceptedLocal> {
        let deadline = crate::timeout::deadline(timeout);
        let mut q = self.accepted.lock();
        loop {
            if let Some(a) = q.pop_front() {
                return Ok(a);
            }
            match deadline {
                Some(d) => {
                    if self.accepted_cv.wait_until(&mut q, d).timed_out() && q.is_empty() {
                        return Err(Error::invalid("accept_local: no peer connected in time"));
                    }
                }
                None => self.accepted_cv.wait(&mut q),
            }
        }
    }

    /// Stops accepting (the endpoint closes its connections).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        for n in &self.names {
            if let Ok(a) = SocketAddr::from_abstract_name(n.as_bytes()) {
                let _ = UnixStream::connect_addr(&a);
            }
        }
        // Each listener's task wakes (a connection came), finds the hub
        // stopping and ends, its listener with it.
        let tasks: Vec<_> = self.acceptors.lock().drain(..).collect();
        crate::workers::Home::end_all_dropped(&tasks, self.p.timeout, "same-host listener");
    }
}
