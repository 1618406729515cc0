//! `/metrics` (Prometheus text) and `/healthz` on `--metrics-listen`: a tiny
//! HTTP/1.1 responder, one request per connection, so the node needs no
//! HTTP framework.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use kv_common::stats::NodeStats;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::server::Shared;

/// Renders node statistics in the Prometheus text format.
pub fn render(s: &NodeStats) -> String {
    let mut o = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
        let _ = writeln!(o, "# HELP kvcellar_{name} {help}\n# TYPE kvcellar_{name} {kind}\nkvcellar_{name} {v}");
    };
    metric("uptime_seconds", "gauge", "Seconds since the node started.", s.uptime_secs);
    metric("used_bytes", "gauge", "Bytes of records on disk.", s.used_bytes);
    metric("capacity_bytes", "gauge", "Byte cap over all disks.", s.capacity_bytes);
    metric("objects", "gauge", "Records stored.", s.objects);
    metric("hits_total", "counter", "Gets served.", s.hits);
    metric("misses_total", "counter", "Gets not found.", s.misses);
    metric("mismatches_total", "counter", "Gets refused for another geometry.", s.mismatches);
    metric("puts_total", "counter", "Records stored by put.", s.puts);
    metric("put_duplicates_total", "counter", "Puts of keys already stored.", s.put_duplicates);
    metric("put_rejected_total", "counter", "Puts refused (full, too large, no disk).", s.put_rejected);
    metric("read_bytes_total", "counter", "Record bytes served.", s.bytes_read);
    metric("written_bytes_total", "counter", "Record bytes stored.", s.bytes_written);
    metric("evictions_total", "counter", "Records evicted under the cap.", s.evictions);
    metric("failed_disks", "gauge", "Disks out of service.", s.failed_disks);
    metric("corrupt_dropped_total", "counter", "Damaged records found and dropped.", s.corrupt_dropped);
    metric("unverified_records", "gauge", "Records recovered after a crash awaiting a payload check.", s.unverified);
    metric("mem_used_bytes", "gauge", "Bytes held by the memory tier.", s.mem_used_bytes);
    metric("mem_capacity_bytes", "gauge", "Byte cap of the memory tier (0: off).", s.mem_capacity_bytes);
    metric("mem_hits_total", "counter", "Gets served from the memory tier.", s.mem_hits);
    metric("connections", "gauge", "Client connections open.", s.connections);
    metric(
        "denied_connections_total",
        "counter",
        "Connections refused at the hello for a missing or wrong auth token.",
        s.denied_connections,
    );
    metric(
        "refused_connections_total",
        "counter",
        "Connections refused at the connection cap (--max-conns).",
        s.refused_connections,
    );
    metric(
        "v1_connections_total",
        "counter",
        "Connections accepted in protocol v1 (clients of the previous release).",
        s.v1_connections,
    );
    type PerDisk = (&'static str, &'static str, &'static str, fn(&kv_common::stats::DiskStats) -> u64);
    let per_disk: [PerDisk; 5] = [
        ("disk_used_bytes", "gauge", "Bytes of records per disk.", |d| d.used_bytes),
        ("disk_capacity_bytes", "gauge", "Byte cap per disk.", |d| d.capacity_bytes),
        ("disk_objects", "gauge", "Records per disk.", |d| d.objects),
        ("disk_evictions_total", "counter", "Evictions per disk.", |d| d.evictions),
        ("disk_failed", "gauge", "1 when a disk is out of service.", |d| u64::from(d.failed)),
    ];
    for (name, kind, help, get) in per_disk {
        let _ = writeln!(o, "# HELP kvcellar_{name} {help}\n# TYPE kvcellar_{name} {kind}");
        for d in &s.disks {
            let _ = writeln!(
                o,
                "kvcellar_{name}{{disk=\"{}\",dir=\"{}\"}} {}",
                d.id,
                d.dir.replace('\\', "\\\\").replace('"', "\\\""),
                get(d)
            );
        }
    }
    o
}

pub async fn serve(listener: TcpListener, shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let (mut s, _) = tokio::select! {
            _ = crate::server::stopped(&mut shutdown) => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut req = Vec::with_capacity(512);
            let mut chunk = [0u8; 512];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                    let n = s.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    req.extend_from_slice(&chunk[..n]);
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let line = String::from_utf8_lossy(req.split(|&b| b == b'\r').next().unwrap_or(&[])).to_string();
            let path = line.split_whitespace().nth(1).unwrap_or("");
            let path = path.split('?').next().unwrap_or("");
            // Gathering stats takes each disk's index lock: off the reactor.
            let stats = match path {
                "/metrics" | "/healthz" => {
                    let sh = shared.clone();
                    tokio::task::spawn_blocking(move || sh.stats()).await.ok()
                }
                _ => None,
            };
            let (code, ctype, body) = match (path, stats) {
                ("/metrics", Some(st)) => ("200 OK", "text/plain; version=0.0.4", render(&st)),
                ("/healthz", Some(st)) => {
                    if st.failed_disks as usize == st.disks.len() {
                        ("503 Service Unavailable", "text/plain", "no disk in service\n".to_string())
                    } else {
                        ("200 OK", "text/plain", "ok\n".to_string())
                    }
                }
                ("/metrics" | "/healthz", None) => {
                    ("500 Internal Server Error", "text/plain", "stats unavailable\n".to_string())
                }
                _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
            };
            let head = format!(
                "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}
