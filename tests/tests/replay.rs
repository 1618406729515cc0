//! `kvctl replay` against real kv-server processes: a slice of the shipped
//! trace (traces/conversation_trace.jsonl) replayed by one engine stream
//! hits exactly the ceiling the tool computes, with no wrong page
//! (docs/BENCHMARKS.md, "Trace replay").

use kv_e2e::{run, workspace_root, Node};

/// Leading-hit pages of the first 300 requests, one 512-token page a block
/// (full pages only): computed once from the trace, and independent of the
/// page size.
const SLICE_HITS: u64 = 675;
/// Full pages of the first 300 requests, and the distinct ones.
const SLICE_PAGES: u64 = 8_190;
const SLICE_DISTINCT: u64 = 7_515;

fn json(out: &str, err: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("kvctl replay --json printed no JSON ({e}): {out}\n{err}"))
}

/// Three nodes, each with one disk directory under `t` and `extra` flags.
fn three_nodes(t: &tempfile::TempDir, extra: &[&str]) -> Vec<Node> {
    (0..3)
        .map(|i| {
            let d = t.path().join(format!("n{i}"));
            let mut args = vec!["--dir", d.to_str().expect("utf-8 path"), "--no-sync", "--log-level", "warn"];
            args.extend_from_slice(extra);
            Node::start(&args)
        })
        .collect()
}

#[test]
fn a_replayed_slice_hits_its_ceiling_and_every_page_is_the_one_put() {
    let t = tempfile::tempdir().expect("tempdir");
    // 3 nodes of 128 MiB: the slice's working set is 7,515 pages of 8 KiB
    // on disk (4 KiB payload + header + key, rounded up), about 59 MiB.
    let nodes = three_nodes(&t, &["--cap", "128M"]);
    let members = Node::members(&nodes);
    let trace = workspace_root().join("traces/conversation_trace.jsonl");
    let trace = trace.to_str().expect("utf-8 path");
    let args = [
        "replay",
        "--members",
        &members,
        trace,
        "--limit",
        "300",
        "--engines",
        "1",
        "--page-bytes",
        "4K",
        "--tag",
        "e2e",
        "--json",
    ];
    let (code, out, err) = run("kvctl", &args);
    assert_eq!(code, 0, "{out}\n{err}");
    let j = json(&out, &err);
    assert_eq!(j["requests"], 300, "{j}");
    assert_eq!(j["pages"], SLICE_PAGES, "{j}");
    assert_eq!(j["working_set"]["distinct_pages"], SLICE_DISTINCT, "{j}");
    assert_eq!(j["working_set"]["footprint_bytes_per_page"], 8192, "{j}");
    assert_eq!(j["ceiling"]["hits"], SLICE_HITS, "{j}");
    assert_eq!(j["hits"], j["ceiling"]["hits"], "one stream in trace order gets every page the trace allows: {j}");
    assert_eq!(j["lru"]["hits"], SLICE_HITS, "the capacity is well above the working set: {j}");
    assert_eq!(j["lru"]["capacity_bytes"], 3 * (128u64 << 20), "{j}");
    assert_eq!(j["wrong_pages"], 0, "{j}");
    assert_eq!(j["get_missed_after_exist"], 0, "{j}");
    assert_eq!(j["failed_puts"], serde_json::json!({}), "{j}");
    assert_eq!(j["bytes_in"], SLICE_HITS * 4096, "{j}");
    // Each request's chain ended at a miss, but for those that hit all the way.
    let ended: u64 = j["chain_end"].as_object().expect("chain_end").values().map(|v| v.as_u64().unwrap_or(0)).sum();
    assert_eq!(j["chain_end"]["miss"].as_u64(), Some(ended), "{j}");
    assert!(!j["windows"].as_array().expect("windows").is_empty(), "{j}");

    // The same tag again: every page is stored now, so every page is a
    // leading hit, each read back and compared byte for byte.
    let (code, out, err) = run("kvctl", &args);
    assert_eq!(code, 0, "{out}\n{err}");
    let j = json(&out, &err);
    assert_eq!(j["hits"], SLICE_PAGES, "{j}");
    assert_eq!(j["wrong_pages"], 0, "{j}");
    assert_eq!(j["bytes_out"], 0, "nothing left to put: {j}");

    // A malformed trace: one line naming the line, exit 2.
    let bad = t.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"timestamp\": 0, \"input_length\": 600, \"hash_ids\": [1, 2]}\n{\"timestamp\": 1}\n")
        .expect("write the trace");
    let (code, _, err) = run("kvctl", &["replay", "--members", &members, bad.to_str().expect("utf-8 path")]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("bad.jsonl:2: malformed trace line"), "{err}");
}

/// Under pressure (a quarter of the slice's working set) with a memory
/// tier, the nodes keep what one LRU per node on the same ring keeps: a
/// page read from memory stays recent on its disk, every disk is full to
/// its cap, and the gets each node counted add up to the replay's.
#[test]
fn under_pressure_the_nodes_hit_what_an_lru_per_node_would() {
    let t = tempfile::tempdir().expect("tempdir");
    // The first 2,000 requests: 36,808 distinct pages of 8 KiB on disk
    // (4 KiB payload), 288 MiB; 3 nodes of 24 MiB hold a quarter of it.
    let nodes = three_nodes(&t, &["--cap", "24M", "--mem-cap", "8M"]);
    let members = Node::members(&nodes);
    let trace = workspace_root().join("traces/conversation_trace.jsonl");
    let args = [
        "replay",
        "--members",
        &members,
        trace.to_str().expect("utf-8 path"),
        "--limit",
        "2000",
        "--engines",
        "1",
        "--page-bytes",
        "4K",
        "--tag",
        "pressure",
        "--json",
    ];
    let (code, out, err) = run("kvctl", &args);
    assert_eq!(code, 0, "{out}\n{err}");
    let j = json(&out, &err);
    assert_eq!(j["wrong_pages"], 0, "{j}");
    let hits = j["hits"].as_u64().expect("hits");
    let n = &j["nodes"];
    let partitioned = n["partitioned_lru"]["hits"].as_u64().expect("partitioned hits");
    let pooled = j["lru"]["hits"].as_u64().expect("pooled hits");
    assert!(partitioned <= pooled + pooled / 100, "{n}");
    assert!(
        hits as f64 >= 0.98 * partitioned as f64,
        "the nodes hit {hits}, an LRU per node {partitioned}: capacity is lost somewhere ({n})"
    );
    let rows = n["members"].as_array().expect("members");
    assert_eq!(rows.len(), 3, "{n}");
    let gets: u64 = rows.iter().map(|r| r["gets"].as_u64().expect("every node answered")).sum();
    // A read of a hot key's copy that missed is asked at its owner too.
    let fallbacks = j["spread"]["fallbacks"].as_u64().expect("spread fallbacks");
    let asked = hits + j["get_missed_after_exist"].as_u64().unwrap_or(0) + fallbacks;
    assert_eq!(gets, asked, "the nodes' own get counts add up to the gets the replay made: {n}");
    for r in rows {
        let (used, cap) = (r["used_bytes"].as_u64().unwrap_or(0), r["capacity_bytes"].as_u64().unwrap_or(0));
        assert!(used <= cap && used as f64 >= 0.97 * cap as f64, "a node under pressure is full to its cap: {r}");
        assert!(r["evictions"].as_u64().unwrap_or(0) > 0, "{r}");
    }
    let balance = n["gets_max_over_mean"].as_f64().expect("balance");
    assert!((1.0..3.0).contains(&balance), "{n}");
}
