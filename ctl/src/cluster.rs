//! Commands over a whole group: `ring` (the view and each member's share of
//! the keys) and `stat --all` (every member's statistics and a total).

use std::time::Duration;

use kv_common::mds::{MdsClient, MemberRecord, View};
use kv_common::ring::{Placement, Ring, RingMember};
use kv_common::size::format_size;
use kv_common::stats::NodeStats;
use kvclient::Conn;

/// The group's current view from the first MDS replica that answers.
pub fn fetch_view(mds: &str, group: &str, timeout: Duration) -> Result<View, String> {
    let mut c =
        MdsClient::from_csv(mds, timeout).map_err(|e| format!("--mds: {e}"))?.with_token(crate::token().cloned());
    if !kv_common::mds::valid_name(group) {
        return Err(format!("--group: {group:?} must be 1-64 of A-Z a-z 0-9 . _ -"));
    }
    c.view(group).map_err(|e| match e {
        kv_common::mds::MdsError::Denied(_) => crate::denied_line(&e.to_string()),
        e => e.to_string(),
    })
}

/// The fullest member's share of the keys over the share its weight asks
/// for (1.0 is perfect balance; with equal weights, max/mean).
pub fn imbalance(view: &View, shares: &[f64]) -> Option<f64> {
    let total: f64 = view.members.iter().map(|m| f64::from(m.weight.max(1))).sum();
    view.members
        .iter()
        .zip(shares)
        .map(|(m, s)| s / (f64::from(m.weight.max(1)) / total))
        .fold(None, |acc: Option<f64>, x| Some(acc.map_or(x, |a| a.max(x))))
}

/// Sets the group's placement rule through kv-mds; returns the new epoch.
pub fn set_placement(mds: &str, group: &str, rule: &str, timeout: Duration) -> Result<u64, String> {
    let rule = Placement::parse(rule).map_err(|e| format!("--set-placement: {e}"))?;
    let mut c =
        MdsClient::from_csv(mds, timeout).map_err(|e| format!("--mds: {e}"))?.with_token(crate::admin_token().cloned());
    c.set_placement(group, rule).map(|r| r.epoch).map_err(|e| match e {
        kv_common::mds::MdsError::Denied(_) => crate::denied_line(&e.to_string()),
        kv_common::mds::MdsError::Forbidden(_) => crate::forbidden_line(&e.to_string()),
        e => e.to_string(),
    })
}

pub fn ring(view: &View, json: bool) -> Result<u8, String> {
    let rule = view.placement()?;
    let ring = Ring::with_placement(
        view.members.iter().map(|m| RingMember { id: m.id.clone(), weight: m.weight }).collect(),
        rule,
    );
    let shares = if view.members.is_empty() { Vec::new() } else { ring.shares() };
    let fullest = imbalance(view, &shares);
    if json {
        let members: Vec<_> = view
            .members
            .iter()
            .zip(&shares)
            .map(|(m, s)| {
                serde_json::json!({
                    "id": m.id, "addr": m.addr, "weight": m.weight,
                    "vnodes": rule.points_per_weight() * u64::from(m.weight), "share": s,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"group": view.group, "epoch": view.epoch, "placement": rule.name(),
                "members": members, "max_over_fair": fullest})
        );
        return Ok(0);
    }
    println!("group {}  epoch {}  members {}  placement {rule}", view.group, view.epoch, view.members.len());
    let mut t = table(&["ID", "ADDRESS", "WEIGHT", "VNODES", "SHARE"], 2);
    for (m, s) in view.members.iter().zip(&shares) {
        t.add_row(vec![
            m.id.clone(),
            m.addr.clone(),
            m.weight.to_string(),
            (rule.points_per_weight() * u64::from(m.weight)).to_string(),
            format!("{:.1}%", s * 100.0),
        ]);
    }
    println!("{t}");
    if let Some(f) = fullest {
        println!("fullest member: {f:.3}x the share its weight asks for (max/mean with equal weights)");
    }
    Ok(0)
}

/// A static member list (`id=host:port[@weight],...`) as view records.
pub fn member_records(list: &str) -> Result<Vec<MemberRecord>, String> {
    Ok(kvclient::members::parse_members(list)?
        .into_iter()
        .map(|m| MemberRecord { id: m.id, addr: m.addr.to_string(), weight: m.weight, metrics_addr: None })
        .collect())
}

/// A plain table (columns aligned, no rules) whose columns from `numeric`
/// on are right-aligned.
pub fn table(headers: &[&str], numeric: usize) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(headers.to_vec());
    for i in numeric..headers.len() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    t
}

/// Each member's statistics, asked of all members at once.
pub fn gather(members: &[MemberRecord], timeout: Duration) -> Vec<Result<NodeStats, String>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .map(|m| {
                s.spawn(move || {
                    let mut c = Conn::connect_with(&m.addr, timeout, crate::token()).map_err(|e| e.to_string())?;
                    c.stats().map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("stats thread failed".into()))).collect()
    })
}

/// How full a disk (or node) is against its cap, as a percentage.
pub fn full_pct(used: u64, cap: u64) -> String {
    if cap == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * used as f64 / cap as f64)
    }
}

fn hit_pct(hits: u64, misses: u64) -> f64 {
    if hits + misses == 0 {
        0.0
    } else {
        100.0 * hits as f64 / (hits + misses) as f64
    }
}

/// The share of gets served by each tier (memory, disk), over the same
/// gets as `hit_pct` (hits and misses), so the two add up to HIT%.
fn tiers(s: &NodeStats) -> (f64, f64) {
    let gets = s.hits + s.misses;
    if gets == 0 {
        return (0.0, 0.0);
    }
    let mem = 100.0 * s.mem_hits as f64 / gets as f64;
    (mem, 100.0 * s.hits.saturating_sub(s.mem_hits) as f64 / gets as f64)
}

/// Each node's tenants (quota, bytes, records, evictions and those for
/// another tenant's put, hits, misses, puts), then, with `total`, each
/// tenant over the nodes.
pub fn print_tenants(nodes: &[(String, Vec<kv_common::stats::TenantStats>)], total: bool) {
    let mut t =
        table(&["NODE", "TENANT", "QUOTA", "BYTES", "OBJECTS", "EVICTED", "FOR OTHERS", "HITS", "MISSES", "PUTS"], 2);
    let row = |node: &str, s: &kv_common::stats::TenantStats| {
        vec![
            node.to_string(),
            s.tenant.clone(),
            if s.quota == 0 { "-".into() } else { format_size(s.quota) },
            format_size(s.bytes),
            s.objects.to_string(),
            s.evictions.to_string(),
            s.evicted_for_others.to_string(),
            s.hits.to_string(),
            s.misses.to_string(),
            s.puts.to_string(),
        ]
    };
    let mut sums: std::collections::BTreeMap<String, kv_common::stats::TenantStats> = Default::default();
    for (node, tenants) in nodes {
        for s in tenants {
            t.add_row(row(node, s));
            sums.entry(s.tenant.clone()).or_default().add(s);
        }
    }
    if total {
        for (name, s) in &sums {
            t.add_row(row("TOTAL", &kv_common::stats::TenantStats { tenant: name.clone(), ..s.clone() }));
        }
    }
    println!("{t}");
}

/// `kvctl tenants`: changes one quota (an admin's call) when asked, then
/// prints the group's quotas.
pub fn tenants(
    mds: &str,
    group: &str,
    change: Option<(&str, Option<&str>)>,
    timeout: Duration,
    json: bool,
) -> Result<u8, String> {
    let token = if change.is_some() { crate::admin_token() } else { crate::token() };
    let mut c = MdsClient::from_csv(mds, timeout).map_err(|e| format!("--mds: {e}"))?.with_token(token.cloned());
    let refused = |e: kv_common::mds::MdsError| match e {
        kv_common::mds::MdsError::Denied(_) => crate::denied_line(&e.to_string()),
        kv_common::mds::MdsError::Forbidden(_) => crate::forbidden_line(&e.to_string()),
        e => e.to_string(),
    };
    let reply = match change {
        Some((tenant, quota)) => c.set_quota(group, tenant, quota).map_err(refused)?,
        None => c.quotas(group).map_err(refused)?,
    };
    if json {
        println!("{}", serde_json::json!({ "group": group, "quotas": reply.quotas }));
        return Ok(0);
    }
    if reply.quotas.is_empty() {
        println!("group {group}: no tenant has a quota (one LRU per disk for all)");
        return Ok(0);
    }
    let mut t = table(&["TENANT", "QUOTA"], 1);
    for (n, q) in &reply.quotas {
        t.add_row(vec![n.clone(), q.clone()]);
    }
    println!("group {group}: each tenant's share of every node\n{t}");
    Ok(0)
}

/// Exit 0 when every member answered, 1 when some did not.
pub fn stat_all(
    group: &str,
    epoch: Option<u64>,
    members: &[MemberRecord],
    timeout: Duration,
    json: bool,
    tenants: bool,
) -> u8 {
    let stats = gather(members, timeout);
    let mut total = NodeStats::default();
    let mut down = 0;
    for s in stats.iter().flatten() {
        total.used_bytes += s.used_bytes;
        total.capacity_bytes += s.capacity_bytes;
        total.objects += s.objects;
        total.hits += s.hits;
        total.misses += s.misses;
        total.mismatches += s.mismatches;
        total.mem_hits += s.mem_hits;
        total.bytes_read += s.bytes_read;
        total.bytes_written += s.bytes_written;
        total.evictions += s.evictions;
        total.failed_disks += s.failed_disks;
        total.handoff_asks += s.handoff_asks;
        total.handoff_hits += s.handoff_hits;
        total.handoff_copies += s.handoff_copies;
        total.handoff_copy_bytes += s.handoff_copy_bytes;
        total.handoff_refused += s.handoff_refused;
        total.handoff_too_old += s.handoff_too_old;
        total.tombstones += s.tombstones;
        total.drain_pushed += s.drain_pushed;
        total.drain_push_failed += s.drain_push_failed;
        total.drain_push_owner_failed += s.drain_push_owner_failed;
        total.drain_push_left += s.drain_push_left;
        total.drain_push_owners += s.drain_push_owners;
        total.ack_memory |= s.ack_memory;
        total.acked_in_memory += s.acked_in_memory;
        total.unflushed_bytes += s.unflushed_bytes;
        total.unflushed_max_bytes += s.unflushed_max_bytes;
        total.ack_fallbacks += s.ack_fallbacks;
        total.flush_failed += s.flush_failed;
        total.flushed += s.flushed;
        total.warmed += s.warmed;
        total.warmed_read += s.warmed_read;
        total.warm_skipped += s.warm_skipped;
        total.mem_capacity_bytes += s.mem_capacity_bytes;
    }
    for s in &stats {
        down += usize::from(s.is_err());
    }
    if json {
        let rows: Vec<_> = members
            .iter()
            .zip(&stats)
            .map(|(m, s)| match s {
                Ok(s) => serde_json::json!({"id": m.id, "addr": m.addr, "reachable": true, "stats": s}),
                Err(e) => serde_json::json!({"id": m.id, "addr": m.addr, "reachable": false, "error": e}),
            })
            .collect();
        let t = serde_json::json!({
            "used_bytes": total.used_bytes, "capacity_bytes": total.capacity_bytes, "objects": total.objects,
            "hits": total.hits, "misses": total.misses, "hit_pct": hit_pct(total.hits, total.misses),
            "memory_hit_pct": tiers(&total).0, "disk_hit_pct": tiers(&total).1, "memory_hits": total.mem_hits,
            "bytes_read": total.bytes_read, "bytes_written": total.bytes_written,
            "evictions": total.evictions, "failed_disks": total.failed_disks,
            "handoff_asks": total.handoff_asks, "handoff_hits": total.handoff_hits,
            "handoff_copies": total.handoff_copies, "handoff_copy_bytes": total.handoff_copy_bytes,
            "handoff_refused": total.handoff_refused, "tombstones": total.tombstones,
            "acked_in_memory": total.acked_in_memory, "unflushed_bytes": total.unflushed_bytes,
            "ack_fallbacks": total.ack_fallbacks, "flush_failed": total.flush_failed, "flushed": total.flushed,
            "unflushed_max_bytes": total.unflushed_max_bytes,
            "warmed": total.warmed, "warmed_read": total.warmed_read, "warm_skipped": total.warm_skipped,
            "nodes": members.len(), "unreachable": down,
        });
        println!("{}", serde_json::json!({"group": group, "epoch": epoch, "nodes": rows, "total": t}));
        return u8::from(down > 0);
    }
    if let Some(e) = epoch {
        println!("group {group}  epoch {e}  members {}  unreachable {down}", members.len());
    }
    let mut t = table(
        &[
            "ID",
            "ADDRESS",
            "USED",
            "CAPACITY",
            "FULL",
            "OBJECTS",
            "HITS",
            "MISSES",
            "HIT%",
            "MEM-HIT%",
            "DISK-HIT%",
            "READ",
            "WRITTEN",
            "EVICTED",
            "FAILED",
        ],
        2,
    );
    let row = |t: &mut comfy_table::Table, id: &str, addr: &str, s: &NodeStats| {
        let (mem, disk) = tiers(s);
        t.add_row(vec![
            id.to_string(),
            addr.to_string(),
            format_size(s.used_bytes),
            format_size(s.capacity_bytes),
            full_pct(s.used_bytes, s.capacity_bytes),
            s.objects.to_string(),
            s.hits.to_string(),
            s.misses.to_string(),
            format!("{:.1}%", hit_pct(s.hits, s.misses)),
            format!("{mem:.1}%"),
            format!("{disk:.1}%"),
            format_size(s.bytes_read),
            format_size(s.bytes_written),
            s.evictions.to_string(),
            s.failed_disks.to_string(),
        ]);
    };
    for (m, s) in members.iter().zip(&stats) {
        match s {
            Ok(s) if s.draining => row(&mut t, &format!("{} (draining)", m.id), &m.addr, s),
            Ok(s) => row(&mut t, &m.id, &m.addr, s),
            Err(e) => {
                t.add_row(vec![m.id.clone(), m.addr.clone(), format!("UNREACHABLE ({e})")]);
            }
        }
    }
    let label = if down > 0 { format!("{} of {} nodes", members.len() - down, members.len()) } else { String::new() };
    row(&mut t, "TOTAL", &label, &total);
    println!("{t}");
    println!("{}", handoff_line(&total));
    if total.ack_memory {
        println!("{}", ack_line(&total));
    }
    if total.mem_capacity_bytes > 0 {
        println!("{}", warm_line(&total));
    }
    if tenants {
        let nodes: Vec<(String, Vec<kv_common::stats::TenantStats>)> = members
            .iter()
            .zip(&stats)
            .filter_map(|(m, s)| s.as_ref().ok().map(|s| (m.id.clone(), s.tenants.clone())))
            .collect();
        print_tenants(&nodes, true);
    }
    u8::from(down > 0)
}

/// What the ring handoff did at a node (or in total): keys asked there
/// after a miss at their owner and found, copies stored there and refused,
/// tombstones held (docs/ARCHITECTURE.md, "Ring transitions").
pub fn handoff_line(s: &NodeStats) -> String {
    let mut line = format!(
        "handoff  asked {}  found {}  copies stored {} ({})  refused {} (deleted) {} (too old)  tombstones {}",
        s.handoff_asks,
        s.handoff_hits,
        s.handoff_copies,
        format_size(s.handoff_copy_bytes),
        s.handoff_refused,
        s.handoff_too_old,
        s.tombstones,
    );
    let pushes = s.drain_pushed + s.drain_push_failed + s.drain_push_owner_failed + s.drain_push_left;
    if pushes > 0 || s.drain_push_owners > 0 {
        line.push_str(&format!(
            "  drain: pushed {} to {} owners, refused {}, failed {}, left {}",
            s.drain_pushed, s.drain_push_owners, s.drain_push_failed, s.drain_push_owner_failed, s.drain_push_left
        ));
    }
    line
}

/// Puts acknowledged from memory (`--ack memory` on some node): how many,
/// the bytes not yet on a disk against their bound, the puts that waited
/// for media at the bound, and pages the flushers could not write.
pub fn ack_line(s: &NodeStats) -> String {
    format!(
        "ack memory  acknowledged {}  unflushed {} of {}  on media at the bound {}  not written {}",
        s.acked_in_memory,
        format_size(s.unflushed_bytes),
        format_size(s.unflushed_max_bytes),
        s.ack_fallbacks,
        s.flush_failed
    )
}

/// Prefetch warming at a node with a memory tier (docs/ARCHITECTURE.md,
/// "Prefetch warming").
pub fn warm_line(s: &NodeStats) -> String {
    format!("warming  pages warmed {}  then read {}  not warmed (budget) {}", s.warmed, s.warmed_read, s.warm_skipped)
}
