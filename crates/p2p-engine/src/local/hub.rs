//! The hub: this endpoint's same-host listeners and its local connections.

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
            nonce: random_u64() | 1,
            conns: RwLock::new(HashMap::new()),
            gone: Mutex::new(VecDeque::new()),
            accepted: Mutex::new(VecDeque::new()),
            accepted_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            names: bound,
            acceptors: Mutex::new(Vec::new()),
            handshaking: AtomicU64::new(0),
        });
        for l in listeners {
            let weak = Arc::downgrade(&hub);
            let h = std::thread::Builder::new()
                .name("tcpx-local-accept".into())
                .spawn(move || {
                    let owner = || {
                        weak.upgrade()
                            .filter(|hub| !hub.stopping.load(Ordering::Acquire))
                    };
                    crate::accept::accept_loop(
                        "same-host connections",
                        l.incoming(),
                        owner,
                        |hub: Arc<Hub>, s| {
                            // Bounded: a flood of same-host connections
                            // takes neither every thread nor descriptor.
                            let busy = hub.handshaking.load(Ordering::Acquire) as usize;
                            let held = hub.conns.read().len();
                            if busy >= hub.p.max_handshakes || held >= hub.p.max_conns {
                                tracing::debug!(
                                    "closed a same-host connection at once: {busy} handshakes in \
                                     progress (TCPX_P2P_MAX_HANDSHAKES={}), {held} connections \
                                     held (TCPX_P2P_MAX_CONNS={})",
                                    hub.p.max_handshakes,
                                    hub.p.max_conns
                                );
                                return;
                            }
                            hub.handshaking.fetch_add(1, Ordering::AcqRel);
                            let h = hub.clone();
                            let r = std::thread::Builder::new()
                                .name("tcpx-local-hs".into())
                                .spawn(move || {
                                    h.admit(s);
                                    h.handshaking.fetch_sub(1, Ordering::AcqRel);
                                });
                            if let Err(e) = r {
                                hub.handshaking.fetch_sub(1, Ordering::AcqRel);
                                tracing::warn!("cannot spawn a same-host handshake thread: {e}");
                            }
                        },
                    );
                })
                .map_err(|e| Error::io("spawning the same-host acceptor", e))?;
            hub.acceptors.lock().push(h);
        }
        Ok(hub)
    }

    pub(super) fn admit(self: &Arc<Self>, s: UnixStream) {
        let id = self.p.next_conn.fetch_add(1, Ordering::Relaxed);
        match LocalConn::establish(id, s, false, self) {
            Ok(c) => {
                if self.stopping.load(Ordering::Acquire) {
                    c.close("endpoint closed");
                    return;
                }
                self.conns.write().insert(id, c);
                self.accepted.lock().push_back(id);
                self.accepted_cv.notify_all();
            }
            Err(e) => tracing::warn!("refused a same-host connection: {e}"),
        }
    }

    pub fn connect(self: &Arc<Self>, peer: &LocalPeer) -> Result<u64> {
        let name = name_of(peer)?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(format!("socket name {name}"), e))?;
        // The peer may still be starting: retry a refused connect briefly.
        let give_up = crate::timeout::deadline_after(self.p.timeout.min(Duration::from_secs(2)))
            .unwrap_or_else(Instant::now);
        let s = loop {
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
        let id = self.p.next_conn.fetch_add(1, Ordering::Relaxed);
        let c = LocalConn::establish(id, s, true, self)?;
        self.conns.write().insert(id, c);
        Ok(id)
    }

    pub fn accept(&self, timeout: Option<Duration>) -> Result<AcceptedLocal> {
        let deadline = crate::timeout::deadline(timeout);
        let mut q = self.accepted.lock();
        loop {
            if let Some(id) = q.pop_front() {
                drop(q);
                let c = self.get(id)?.ok_or_else(|| Error::ConnectionLost {
                    conn: id,
                    reason: "closed before it was accepted".into(),
                })?;
                return Ok(AcceptedLocal {
                    conn: id,
                    gpu_index: c.remote_gpu,
                    gpu_bdf: c.remote_bdf.clone(),
                });
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

    /// The local connection `id`: None when `id` is not a local connection;
    /// an error when it was one and failed or closed.
    pub fn get(&self, id: u64) -> Result<Option<Arc<LocalConn>>> {
        let found = self.conns.read().get(&id).cloned();
        if let Some(c) = found {
            if let Some(why) = c.failure() {
                drop(self.conns.write().remove(&id));
                self.bury(id, why.clone());
                return Err(Error::ConnectionLost {
                    conn: id,
                    reason: why,
                });
            }
            return Ok(Some(c));
        }
        match self.gone.lock().iter().find(|(g, _)| *g == id) {
            Some((_, why)) => Err(Error::ConnectionLost {
                conn: id,
                reason: why.clone(),
            }),
            None => Ok(None),
        }
    }

    pub(super) fn bury(&self, id: u64, why: String) {
        let mut g = self.gone.lock();
        g.push_back((id, why));
        if g.len() > 4096 {
            g.pop_front();
        }
    }

    /// Closes local connection `id`; false when it is not one.
    pub fn remove(&self, id: u64) -> bool {
        let c = self.conns.write().remove(&id);
        match c {
            Some(c) => {
                c.close("connection removed");
                self.bury(id, "connection removed".into());
                true
            }
            None => false,
        }
    }

    pub fn ids(&self) -> Vec<u64> {
        self.conns.read().keys().copied().collect()
    }

    /// Stops accepting and closes every local connection.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        for n in &self.names {
            if let Ok(a) = SocketAddr::from_abstract_name(n.as_bytes()) {
                let _ = UnixStream::connect_addr(&a);
            }
        }
        for h in self.acceptors.lock().drain(..) {
            let _ = h.join();
        }
        let conns: Vec<_> = self.conns.write().drain().map(|(_, c)| c).collect();
        for c in conns {
            c.close("endpoint closed");
        }
    }
}
