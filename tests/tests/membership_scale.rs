//! The membership tier at a few hundred nodes and a few thousand clients,
//! driven by `kv-mds-load` (docs/BENCHMARKS.md, "Membership at scale"): a
//! real 3-member etcd, two real kv-mds replicas, 300 nodes heartbeating,
//! 2,950 simulated clients (long-polls taking deltas, and plain polls) and
//! 50 clients of the client library itself. Every client reaches every new
//! epoch, none ever goes back to an older one, and no request fails. Timing
//! targets are the benchmark's (a debug build on a busy CI machine says
//! nothing about them).

#[test]
fn a_few_thousand_clients_reach_every_epoch_and_none_goes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("load.json");
    let work = dir.path().join("work");
    let log = dir.path().join("stdout");
    let errlog = dir.path().join("stderr");
    let mut child = std::process::Command::new(kv_e2e::bin("kv-mds-load"))
        .args([
            "run",
            "--nodes",
            "300",
            "--clients",
            "3000",
            "--real-clients",
            "50",
            "--per-proc",
            "1500",
            "--joins",
            "3",
            "--gap-ms",
            "4000",
            "--poll-every-ms",
            "2000",
            "--wait-ms",
            "30000",
            "--work",
            &work.display().to_string(),
            "--json",
            &json.display().to_string(),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(&errlog).expect("log"))
        .spawn()
        .expect("kv-mds-load");
    // The coordinator's parts die with it (PR_SET_PDEATHSIG) if the limit kills it.
    let st = kv_e2e::wait_deadline(&mut child, std::time::Duration::from_secs(170));
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let err = std::fs::read_to_string(&errlog).unwrap_or_default();
    assert!(st.success(), "{out}\n{err}");
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("the report")).unwrap();
    let prop = s["propagation"].as_array().expect("propagation figures");
    assert_eq!(prop.len(), 6, "3 joins, for long-polls and plain polls: {out}");
    for p in prop {
        assert_eq!(p["missing"].as_u64(), Some(0), "a client never held epoch {}: {out}", p["epoch"]);
    }
    assert_eq!(prop.iter().map(|p| p["clients"].as_u64().unwrap()).sum::<u64>() / 3, 3000, "{out}");
    let errors = s["errors"].as_object().expect("errors");
    assert!(errors.is_empty(), "requests failed or went back to an older epoch: {errors:?}\n{out}");
    // Deltas: a change costs each long-poll client a few hundred bytes.
    let per_client = s["view_bytes_per_change"].as_f64().unwrap() / 2800.0;
    assert!(per_client < 2000.0, "{per_client} bytes per client per change: {out}");
    println!("{out}");
}
