#!/usr/bin/env bash
# Tests the Docker image kvcellar:<version> (scripts/package.sh builds it):
# non-root; every role by its command (kv-server, kv-mds, kvctl, python3 with
# the kvcellar package); the HEALTHCHECK of each daemon role goes healthy, and
# kv-mds's goes unhealthy when etcd is gone; a page round-trips through a
# containerized node. Containers use the host network and a real etcd on
# free loopback ports; each is removed at the end.
# Usage: scripts/test-image.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
img=kvcellar:$version
work=$(mktemp -d)
tag=kvimgtest$$
etcd_pid=
cleanup() {
  docker rm -f "$tag-mds" "$tag-node" >/dev/null 2>&1 || true
  [ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null && wait "$etcd_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; docker logs "$tag-mds" 2>&1 | tail -5; docker logs "$tag-node" 2>&1 | tail -5; exit 1; }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
passed=0
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run() { docker run --rm --network host "$img" "$@"; }
health() { docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null || echo gone; }
wait_health() { # wait_health CONTAINER STATE SECONDS
  local deadline=$((SECONDS + $3))
  while [ "$(health "$1")" != "$2" ]; do
    [ $SECONDS -lt $deadline ] || fail "$1 not $2 within $3 s (now $(health "$1"))"
    sleep 0.5
  done
}

size=$(docker image inspect -f '{{.Size}}' "$img") || fail "no image $img: run scripts/package.sh"
[ "$(run id -u)" != 0 ] || fail "the image runs as root"
# packaging/k8s/ names these ids (runAsUser, runAsGroup, fsGroup).
[ "$(run id -u):$(run id -g)" = 900:900 ] || fail "the image's kvcellar user is not 900:900"
ok "$img: $((size / 1000000)) MB, runs as $(run id -un) (uid $(run id -u))"
for b in kv-server kv-mds kvctl; do
  [ "$(run $b --version)" = "$b $version" ] || fail "$b --version in the image"
done
out=$(run python3 -c 'import kvcellar; print(kvcellar.__version__, kvcellar.library_version())')
[ "$out" = "$version $version" ] || fail "python3 role: $out"
ok "roles by command: kv-server, kv-mds, kvctl, python3 (kvcellar $version with its library)"

ep=$(free_port); pp=$(free_port); mp=$(free_port); np=$(free_port)
etcd --name t --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$ep" \
  --advertise-client-urls "http://127.0.0.1:$ep" --listen-peer-urls "http://127.0.0.1:$pp" \
  --initial-advertise-peer-urls "http://127.0.0.1:$pp" --initial-cluster "t=http://127.0.0.1:$pp" \
  --initial-cluster-state new --log-level warn >"$work/etcd.log" 2>&1 &
etcd_pid=$!
docker run -d --name "$tag-mds" --network host "$img" \
  kv-mds --listen "127.0.0.1:$mp" --etcd "127.0.0.1:$ep" --lease-ttl 3s >/dev/null
docker run -d --name "$tag-node" --network host "$img" \
  kv-server --listen "127.0.0.1:$np" --dir /var/lib/kvcellar/disk0 --cap 64M \
  --mds "127.0.0.1:$mp" --group imgtest --id n1 --advertise "127.0.0.1:$np" >/dev/null
wait_health "$tag-mds" healthy 60
wait_health "$tag-node" healthy 60
ok "HEALTHCHECK (kvctl health --local): kv-mds and kv-server containers healthy"
head -c 1048576 /dev/urandom >"$work/page"
docker run --rm -i --network host "$img" kvctl put --mds "127.0.0.1:$mp" --group imgtest img-page <"$work/page" >/dev/null
docker run --rm --network host "$img" kvctl get --mds "127.0.0.1:$mp" --group imgtest img-page >"$work/back"
cmp -s "$work/page" "$work/back" || fail "the page read back differs"
run kvctl ring --mds "127.0.0.1:$mp" --group imgtest | grep -q "n1" || fail "kvctl ring does not list the node"
ok "a 1 MiB page round-trips through the containerized node, routed by the ring from kv-mds"
# RDMA: the image carries libibverbs; with no device passed in, a client
# that names one says why in one line and still works over TCP.
err=$(docker run --rm --network host "$img" kvctl get --mds "127.0.0.1:$mp" --group imgtest \
  --options rdma_devices=mlx5_0 img-page 2>&1 >"$work/back2") || fail "kvctl with rdma_devices: $err"
cmp -s "$work/page" "$work/back2" || fail "the page read back over the RDMA fallback differs"
echo "$err" | grep -q "using TCP: .*mlx5_0: no such RDMA device" ||
  fail "the client in the image does not say why it uses TCP (libibverbs missing from the image?): $err"
ok "the image carries libibverbs: rdma_devices without a device falls back to TCP, saying why"
kill "$etcd_pid"; wait "$etcd_pid" 2>/dev/null || true; etcd_pid=
wait_health "$tag-mds" unhealthy 60
why=$(docker exec "$tag-mds" kvctl health --local) && fail "kvctl health exits 0 without etcd"
echo "$why" | grep -q "UNHEALTHY: .*etcd unavailable" || fail "kv-mds health does not say why: $why"
ok "kv-mds goes unhealthy when etcd is gone, and says why"
echo "image: $passed passed, 0 failed"
