//! Figures of the notification flood (issue 29, defect 5), run by hand:
//! `cargo test --test notif_figures -- --ignored --nocapture`. One peer
//! sends 65,537 empty notifications while nobody takes them, then three
//! other peers send one each; prints what the target holds (RSS, threads,
//! descriptors, notifications queued) and which connections survived.
//! Uses only the public API, so that it runs on any version.

use std::time::{Duration, Instant};

use tcpx_p2p::{Config, Endpoint};

fn cfg(name: &str) -> Config {
    Config {
        ifname: Some("lo".into()),
        streams: 2,
        name: Some(name.into()),
        ..Config::default()
    }
}

fn status(key: &str) -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn counts() -> (usize, usize) {
    let n = |p| std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0);
    (n("/proc/self/task"), n("/proc/self/fd"))
}

#[test]
#[ignore]
fn figures_notification_flood() {
    let b = Endpoint::new(None, cfg("target")).unwrap();
    let addr = b.local_addr();
    let join = |name: &str| {
        let a = Endpoint::new(None, cfg(name)).unwrap();
        let ca = a
            .connect(&addr.ip().to_string(), addr.port(), None)
            .unwrap();
        let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        (a, ca, cb)
    };
    let (flood, cf, cbf) = join("flood");
    let legit: Vec<_> = (0..3).map(|i| join(&format!("legit{i}"))).collect();
    std::thread::sleep(Duration::from_millis(200));
    let (thr0, fds0) = counts();
    let rss0 = status("VmRSS:");
    let mut sent = 0;
    for _ in 0..65_537 {
        if flood.send_notif(cf, b"").is_err() {
            break;
        }
        sent += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(b.conn_failure(cbf), Ok(Some(_)) | Err(_)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    for (i, (a, ca, _)) in legit.iter().enumerate() {
        let _ = a.send_notif(*ca, &[i as u8; 16]);
    }
    std::thread::sleep(Duration::from_secs(2));
    let (thr1, fds1) = counts();
    let rss1 = status("VmRSS:");
    let kept = legit
        .iter()
        .filter(|l| matches!(b.conn_failure(l.2), Ok(None)))
        .count();
    let got = b.get_notifs();
    let from_legit = got
        .iter()
        .filter(|n| n.from_name.starts_with("legit"))
        .count();
    println!(
        "notification flood: {sent} sent by one peer; target queued {} ({} from the flood, {from_legit} of 3 from the others); \
         the others' connections kept: {kept} of 3; flood's connection: {:?}; RSS {} -> {} MiB, threads {thr0} -> {thr1}, descriptors {fds0} -> {fds1} (both sides in this process)",
        got.len(),
        got.iter().filter(|n| n.conn == cbf).count(),
        b.conn_failure(cbf).map(|f| f.is_some()),
        rss0 >> 10,
        rss1 >> 10
    );
}
