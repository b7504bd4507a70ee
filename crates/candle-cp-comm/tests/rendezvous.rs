//! The rendezvous that hands rank 0's NCCL id to every rank, over loopback TCP and a file, with
//! threads as ranks: every rank gets the blob, late servers are waited for, missing or
//! mismatched ranks are errors within the timeout.

use candle_cp_comm::rendezvous::{fetch, serve, Rendezvous};
use std::net::TcpListener;
use std::time::{Duration, Instant};

fn blob() -> Vec<u8> {
    (0..128u32).map(|i| (i * 7 + 3) as u8).collect()
}

/// A free loopback port (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
}

#[test]
fn tcp_every_rank_gets_rank0s_blob() {
    let world = 5;
    let port = free_port();
    let rdv = Rendezvous::Tcp { host: "127.0.0.1".into(), port };
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let rdv = rdv.clone();
                s.spawn(move || {
                    let b = blob();
                    rdv.share(r, world, (r == 0).then_some(&b[..]), 128, Duration::from_secs(20))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap(), blob(), "rank {r}");
    }
}

#[test]
fn tcp_clients_wait_for_a_late_server() {
    let port = free_port();
    let rdv = Rendezvous::Tcp { host: "localhost".into(), port };
    std::thread::scope(|s| {
        let c = {
            let rdv = rdv.clone();
            s.spawn(move || rdv.share(1, 2, None, 128, Duration::from_secs(20)))
        };
        std::thread::sleep(Duration::from_millis(300));
        let b = blob();
        rdv.share(0, 2, Some(&b), 128, Duration::from_secs(20)).unwrap();
        assert_eq!(c.join().unwrap().unwrap(), blob());
    });
}

#[test]
fn tcp_missing_rank_times_out_naming_it() {
    let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let t0 = Instant::now();
    let err = std::thread::scope(|s| {
        let c = s.spawn(move || fetch("127.0.0.1", port, 1, 3, 128, Duration::from_secs(20)));
        let e = serve(&listener, 3, &blob(), Duration::from_millis(700)).unwrap_err().to_string();
        assert_eq!(c.join().unwrap().unwrap(), blob());
        e
    });
    let dt = t0.elapsed();
    assert!(err.contains("ranks [2] did not connect"), "{err}");
    assert!(dt < Duration::from_secs(5), "took {dt:?}");
}

#[test]
fn tcp_no_server_times_out_naming_the_address() {
    let port = free_port();
    let t0 = Instant::now();
    let err = fetch("127.0.0.1", port, 2, 4, 128, Duration::from_millis(500)).unwrap_err().to_string();
    assert!(err.contains(&format!("rank 2 of 4 via 127.0.0.1:{port}")), "{err}");
    assert!(err.contains("no blob from rank 0"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn tcp_world_mismatch_fails_both_sides() {
    let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let (server, client) = std::thread::scope(|s| {
        let c = s.spawn(move || fetch("127.0.0.1", port, 1, 3, 128, Duration::from_secs(10)));
        let e = serve(&listener, 2, &blob(), Duration::from_secs(10));
        (e, c.join().unwrap())
    });
    let (se, ce) = (server.unwrap_err().to_string(), client.unwrap_err().to_string());
    assert!(se.contains("says world 3") && se.contains("rank 0 has world 2"), "{se}");
    assert!(ce.contains("says world 3"), "{ce}");
}

#[test]
fn file_rendezvous_and_argument_checks() {
    let dir = std::env::temp_dir().join(format!("candle-cp-rdv-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rdv = Rendezvous::File(dir.join("id"));
    std::thread::scope(|s| {
        let c = {
            let rdv = rdv.clone();
            s.spawn(move || rdv.share(3, 4, None, 128, Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(100));
        let b = blob();
        rdv.share(0, 4, Some(&b), 128, Duration::from_secs(10)).unwrap();
        assert_eq!(c.join().unwrap().unwrap(), blob());
    });
    let missing = Rendezvous::File(dir.join("never"));
    let e = missing.share(1, 2, None, 128, Duration::from_millis(100)).unwrap_err().to_string();
    assert!(e.contains("rank 1 of 2 found no 128-byte blob"), "{e}");
    // Rank 0 must pass the blob, the others must not; ranks and sizes are checked.
    assert!(rdv.share(0, 2, None, 128, Duration::from_millis(10)).is_err());
    assert!(rdv.share(1, 2, Some(&blob()), 128, Duration::from_millis(10)).is_err());
    assert!(rdv.share(2, 2, None, 128, Duration::from_millis(10)).is_err());
    assert!(rdv.share(0, 2, Some(&blob()[..64]), 128, Duration::from_millis(10)).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
