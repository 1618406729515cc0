#!/usr/bin/env bash
# The main job: builds kvcellar, starts one kv-server on loopback with two
# disk directories under a work dir, and shows a page round trip and the
# node's statistics with kvctl. Stops the node when done (or on Ctrl-C);
# pass --keep to leave it running (stop it with: kill $(cat WORK/kv-server.pid)).
#
# Usage: scripts/quickstart.sh [--keep]   (work dir: $KVCELLAR_WORK, default ./.kvcellar-work)
set -euo pipefail
cd "$(dirname "$0")/.."
keep=0
[ "${1:-}" = "--keep" ] && keep=1
work=${KVCELLAR_WORK:-$PWD/.kvcellar-work}
bash scripts/deps.sh
echo "== building (release)"
cargo build --release --bins -q
bin=target/release
mkdir -p "$work"
log="$work/kv-server.log"

"$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/disk0,$work/disk1" --cap 1G \
  --mem-cap 64M --metrics-listen 127.0.0.1:0 >"$work/kv-server.out" 2>"$log" &
pid=$!
echo $pid >"$work/kv-server.pid"
stop() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait "$pid" && echo "== kv-server stopped cleanly" || echo "== kv-server exited with $?"
  fi
}
[ $keep -eq 1 ] || trap stop EXIT INT TERM

# Wait (up to 30 s) for the line that names the port it bound.
addr=""
for _ in $(seq 300); do
  addr=$(sed -n 's/^kv-server listening on //p' "$work/kv-server.out" 2>/dev/null || true)
  [ -n "$addr" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "kv-server failed to start:"; cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "kv-server did not come up in 30 s"; cat "$log"; exit 1; }
echo "== kv-server (pid $pid) serving on $addr, disks under $work"

geo=(--model-hash 20817 --page-size 64 --layer-num 61 --head-num 1 --head-dim 576 --mla)
key="quickstart-$(date +%s%N)"   # a new key each run: pages are write-once
head -c $((4 << 20)) /dev/urandom >"$work/page.bin"
echo "== kvctl put a 4 MiB page as $key"
"$bin/kvctl" put --node "$addr" "${geo[@]}" --file "$work/page.bin" "$key"
echo "== kvctl get it back and compare"
"$bin/kvctl" get --node "$addr" "${geo[@]}" --out "$work/page.out" "$key"
if cmp -s "$work/page.bin" "$work/page.out"; then
  echo "round trip: 4194304 bytes identical (header, key, geometry and CRC verified)"
else
  echo "round trip FAILED: the page read back differs"; exit 1
fi
echo "== kvctl exist with another model's geometry (a guarded miss)"
"$bin/kvctl" exist --node "$addr" --model-hash 1 "$key" || true
echo "== kvctl stat"
"$bin/kvctl" stat "$addr"
maddr=$(grep -o 'metrics listening.*addr=[0-9.:]*' "$log" | sed 's/.*addr=//' || true)
if [ -n "$maddr" ]; then
  echo "== metrics at http://$maddr/metrics (excerpt)"
  curl -s "http://$maddr/metrics" 2>/dev/null | grep -E "^kvcellar_(objects|hits_total|used_bytes) " || true
fi
if [ $keep -eq 1 ]; then
  echo "== left running (pid $pid); stop with: kill \$(cat $work/kv-server.pid)"
fi
