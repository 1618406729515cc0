#!/usr/bin/env bash
# Tests the packages in dist/ (scripts/package.sh builds them; --built skips
# that): every shipped ELF needs glibc 2.28 at most; the rpms list the
# expected files and scriptlets; the debs install on this machine with dpkg,
# the installed units pass systemd-analyze (offline), the installed kv-server
# starts the way its template unit does (the unit's ExecStart line, as the
# kvcellar user, with an instance config on a free port), the installed kvctl
# round-trips a page, a C program builds against the installed libkvclient
# through pkg-config, man pages are installed, and the packages are removed
# again; the wheel installs into a fresh venv with no Rust on PATH and
# round-trips a page through kvcellar.Client. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ "${1:-}" = "--built" ] || bash scripts/package.sh --no-image
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
inst=pkgtest$$
work=$(mktemp -d)
pid=
mds_pid=
etcd_pid=
stop() { [ -n "$1" ] && kill "$1" 2>/dev/null && wait "$1" 2>/dev/null || true; }
cleanup() {
  stop "$pid"; stop "$mds_pid"; stop "$etcd_pid"
  [ -e "$work/kv-mds.env.orig" ] && cp "$work/kv-mds.env.orig" /etc/kvcellar/kv-mds.env
  rm -f "/etc/kvcellar/kv-server-$inst.toml"
  rm -rf "/var/lib/kvcellar/$inst" "$work"
  dpkg -r kv-server kv-mds kvctl libkvclient >/dev/null 2>&1 || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
passed=0

# --- glibc baseline: the highest GLIBC_ symbol version each shipped ELF needs.
x=$work/extract
mkdir -p "$x/deb" "$x/rpm" "$x/whl"
for d in dist/*_"$version"-1_amd64.deb; do dpkg-deb -x "$d" "$x/deb"; done
for r in dist/*-"$version"-1.x86_64.rpm; do
  # rpm2cpio exits 1 on these payloads although it writes them whole; cpio checks the archive.
  (cd "$x/rpm" && { rpm2cpio "$root/$r" || true; } | cpio -idm --quiet)
done
python3 -m zipfile -e "dist/kvcellar-$version-py3-none-manylinux_2_28_x86_64.whl" "$x/whl"
n=0
while IFS= read -r f; do
  file -b "$f" | grep -q '^ELF' || continue
  need=$(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
  ver=${need#GLIBC_}
  [ "$(printf '%s\n2.28\n' "$ver" | sort -V | tail -1)" = 2.28 ] || fail "${f#"$x"/} needs $need (above 2.28)"
  n=$((n + 1))
done < <(find "$x" -type f \( -path '*/bin/*' -o -name '*.so*' \))
[ $n -eq 9 ] || fail "$n ELF files found in the packages, not 9 (3 binaries and the library in the debs and in the rpms, the wheel's library)"
ok "the $n shipped ELF files (debs, rpms, wheel) need glibc 2.28 at most"
# Built with RDMA, without linking libibverbs: it is loaded at run time when
# devices are named, so the same binaries run where rdma-core is absent.
for f in "$x/deb/usr/bin/kv-server" "$x/deb/usr/bin/kvctl" "$x/deb/usr/lib/x86_64-linux-gnu/libkvclient.so.0" \
         "$x"/whl/kvcellar/libkvclient*.so*; do
  grep -q 'libibverbs.so.1' "$f" || fail "${f#"$x"/} was not built with the rdma feature"
  ! objdump -p "$f" | grep -q 'NEEDED.*ibverbs' || fail "${f#"$x"/} links libibverbs (it must load it at run time)"
done
ok "the binaries, library and wheel carry RDMA and do not link libibverbs"

# --- rpms: files and scriptlets.
q() { rpm -qp "$@" 2>/dev/null; }
files=$(q -l "dist/kv-server-$version-1.x86_64.rpm")
for f in /usr/bin/kv-server /etc/kvcellar/kv-server.toml /usr/lib/systemd/system/kv-server.service \
         /usr/lib/systemd/system/kv-server@.service /usr/share/man/man1/kv-server.1; do
  echo "$files" | grep -qx "$f" || fail "kv-server rpm lacks $f"
done
q --configfiles "dist/kv-server-$version-1.x86_64.rpm" | grep -qx /etc/kvcellar/kv-server.toml || fail "kv-server.toml is not %config"
q -l "dist/kv-mds-$version-1.x86_64.rpm" | grep -qx /etc/kvcellar/kv-mds.env || fail "kv-mds rpm lacks its env file"
q -l "dist/kvctl-$version-1.x86_64.rpm" | grep -qx /usr/share/man/man1/kvctl-ring.1 || fail "kvctl rpm lacks its man pages"
lib=$(q -l "dist/libkvclient-$version-1.x86_64.rpm")
for f in /usr/lib64/libkvclient.so.0 /usr/lib64/libkvclient.so /usr/include/kvclient.h /usr/lib64/pkgconfig/kvclient.pc; do
  echo "$lib" | grep -qx "$f" || fail "libkvclient rpm lacks $f"
done
scripts=$(q --scripts "dist/kv-server-$version-1.x86_64.rpm")
for s in "preinstall scriptlet" "useradd -r -g kvcellar" "postinstall scriptlet" "preuninstall scriptlet" "postuninstall scriptlet"; do
  echo "$scripts" | grep -q "$s" || fail "kv-server rpm scriptlets lack '$s'"
done
q --scripts "dist/libkvclient-$version-1.x86_64.rpm" | grep -q ldconfig || fail "libkvclient rpm does not run ldconfig"
q -R "dist/kv-server-$version-1.x86_64.rpm" | grep -q 'glibc >= 2.28' || fail "kv-server rpm does not require glibc >= 2.28"
ok "rpms: files, %config, man pages, user-creating and ldconfig scriptlets, glibc >= 2.28"

DEBIAN_FRONTEND=noninteractive dpkg -i dist/kv-server_*.deb dist/kv-mds_*.deb dist/kvctl_*.deb dist/libkvclient_*.deb >/dev/null
ok "dpkg -i of the four packages"
getent passwd kvcellar >/dev/null || fail "no kvcellar user"
[ "$(stat -c %U /var/lib/kvcellar)" = kvcellar ] || fail "/var/lib/kvcellar not owned by kvcellar"
ok "the kvcellar system user and /var/lib/kvcellar"
for m in kv-server kv-mds kvctl kvctl-get kvctl-health; do
  [ -e "/usr/share/man/man1/$m.1.gz" ] || fail "no man page $m.1.gz"
done
man -w kvctl-ring >/dev/null 2>&1 || [ ! -x /usr/bin/man ] || fail "man does not find kvctl-ring"
ok "man pages installed (kv-server, kv-mds, kvctl and one per kvctl command)"
dpkg-query -W -f='${Conffiles}\n' kv-server | grep -q /etc/kvcellar/kv-server.toml || fail "kv-server.toml is not a conffile"
dpkg-query -W -f='${Conffiles}\n' kv-mds | grep -q /etc/kvcellar/kv-mds.env || fail "kv-mds.env is not a conffile"
ok "configs are conffiles (kept on upgrade)"
out=$(cd "$work" && systemd-analyze verify kv-server.service kv-mds.service "kv-server@$inst.service" 2>&1) || fail "systemd-analyze verify: $out"
ok "systemd-analyze verify of the installed units"
for u in kv-server.service kv-server@.service kv-mds.service; do
  for k in NoNewPrivileges=yes PrivateTmp=yes ProtectSystem=strict Restart=on-failure LimitNOFILE=65536 User=kvcellar; do
    grep -q "^$k" "/lib/systemd/system/$u" || fail "$u lacks $k"
  done
done
for u in kv-server.service kv-server@.service; do
  grep -q "^LimitMEMLOCK=infinity" "/lib/systemd/system/$u" || fail "$u lacks LimitMEMLOCK=infinity (RDMA pins memory)"
done
ok "units carry the hardening and limits (LimitMEMLOCK=infinity on the nodes, for RDMA)"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_line() { # wait_line FILE TEXT PID
  for _ in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 0.1; done
  return 1
}
# A real etcd on free loopback ports, and the installed kv-mds as its unit
# runs it: the unit's EnvironmentFile (the installed kv-mds.env, set to this
# etcd) and its ExecStart line, as the kvcellar user.
ep=$(free_port); pp=$(free_port); mp=$(free_port)
etcd --name t --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$ep" \
  --advertise-client-urls "http://127.0.0.1:$ep" --listen-peer-urls "http://127.0.0.1:$pp" \
  --initial-advertise-peer-urls "http://127.0.0.1:$pp" --initial-cluster "t=http://127.0.0.1:$pp" \
  --initial-cluster-state new --log-level warn >"$work/etcd.log" 2>&1 &
etcd_pid=$!
cp /etc/kvcellar/kv-mds.env "$work/kv-mds.env.orig"
sed -i "s|^KV_MDS_ARGS=.*|KV_MDS_ARGS=\"--listen 127.0.0.1:$mp --etcd 127.0.0.1:$ep --lease-ttl 3s\"|" /etc/kvcellar/kv-mds.env
envfile=$(sed -n 's/^EnvironmentFile=//p' /lib/systemd/system/kv-mds.service)
mcmd=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/kv-mds.service)
[ "$envfile" = /etc/kvcellar/kv-mds.env ] || fail "kv-mds.service reads $envfile"
(set -a; . "$envfile"; exec runuser -u kvcellar -- sh -c "exec $mcmd") >"$work/mds.out" 2>"$work/mds.log" &
mds_pid=$!
wait_line "$work/mds.out" "listening on 127.0.0.1:$mp" $mds_pid || fail "installed kv-mds did not start: $(cat "$work/mds.log")"
for _ in $(seq 100); do /usr/bin/kvctl health "127.0.0.1:$mp" >/dev/null 2>&1 && break; sleep 0.1; done
/usr/bin/kvctl health "127.0.0.1:$mp" >/dev/null || fail "installed kv-mds is not healthy"
ok "installed kv-mds runs as kvcellar from its unit's EnvironmentFile and ExecStart ($mcmd), healthy against etcd"

# The template unit's command line, as systemd would run it for this
# instance, registering with that kv-mds.
port=$(free_port)
cat >"/etc/kvcellar/kv-server-$inst.toml" <<TOML
listen = "127.0.0.1:$port"
dirs = ["/var/lib/kvcellar/$inst"]
cap = "64M"
mds = "127.0.0.1:$mp"
group = "pkgtest"
id = "n1"
advertise = "127.0.0.1:$port"
TOML
install -d -o kvcellar -g kvcellar "/var/lib/kvcellar/$inst"
cmd=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/kv-server@.service | sed "s/%i/$inst/g")
runuser -u kvcellar -- $cmd >"$work/out" 2>"$work/log" &
pid=$!
wait_line "$work/out" "listening on 127.0.0.1:$port" $pid || fail "installed kv-server did not start: $(cat "$work/log")"
ok "installed kv-server runs as kvcellar from the template unit's ExecStart ($cmd)"
head -c 1048576 /dev/urandom >"$work/page"
for _ in $(seq 100); do /usr/bin/kvctl ring --mds "127.0.0.1:$mp" --group pkgtest 2>/dev/null | grep -q n1 && break; sleep 0.1; done
/usr/bin/kvctl ring --mds "127.0.0.1:$mp" --group pkgtest | grep -q n1 || fail "the installed node did not register"
/usr/bin/kvctl put --mds "127.0.0.1:$mp" --group pkgtest pkg-page --file "$work/page" >/dev/null
/usr/bin/kvctl get --node "127.0.0.1:$port" pkg-page --out "$work/back"
cmp -s "$work/page" "$work/back" || fail "the page read back differs"
ok "installed kvctl: the node is in the ring, a 1 MiB page put through the group reads back from the node"

cat >"$work/v.c" <<'C'
#include <kvclient.h>
#include <stdio.h>
int main(void) { printf("%s\n", kv_version()); return 0; }
C
cc -o "$work/v" "$work/v.c" $(pkg-config --cflags --libs kvclient) || fail "cannot build against the installed library"
[ "$("$work/v")" = "$(/usr/bin/kvctl --version | awk '{print $2}')" ] || fail "installed library version differs"
readelf -d "$work/v" | grep -q "NEEDED.*libkvclient.so.0" || fail "the program does not record the SONAME"
ok "a C program builds with pkg-config against the installed header and library (NEEDED libkvclient.so.0)"

# --- the wheel, in a fresh venv, on a PATH without cargo or rustc.
py=$(python3 -c 'import sys; print(sys.executable)')
"$py" -m venv "$work/venv"
env -i HOME="$work" PATH=/usr/bin:/bin "$work/venv/bin/pip" install -q --no-index --disable-pip-version-check \
  "dist/kvcellar-$version-py3-none-manylinux_2_28_x86_64.whl" || fail "pip install of the wheel"
env -i HOME="$work" PATH=/usr/bin:/bin sh -c 'command -v cargo || command -v rustc' && fail "Rust is on the PATH of the wheel test"
out=$(cd "$work" && env -i HOME="$work" PATH=/usr/bin:/bin "$work/venv/bin/python" -c "
import kvcellar, kvcellar._native as n
c = kvcellar.Client('n1=127.0.0.1:$port')
page = bytes(range(256)) * 4096
assert c.put('wheel-page', page) == kvcellar.Status.OK
buf = bytearray(len(page))
r = c.get('wheel-page', buf)
assert r.ok and bytes(buf) == page, r
print(n.load()._name, kvcellar.__version__)
") || fail "the wheel's Client does not round-trip"
case "$out" in "$work/venv/"*"/kvcellar/libkvclient"*" $version") ;; *) fail "the wheel used another library: $out" ;; esac
ok "the wheel installs with pip in a fresh venv without Rust and round-trips a 1 MiB page (library: the wheel's own)"

stop "$pid"; stop "$mds_pid"; stop "$etcd_pid"; pid= mds_pid= etcd_pid=
cp "$work/kv-mds.env.orig" /etc/kvcellar/kv-mds.env
dpkg -r kv-server kv-mds kvctl libkvclient >/dev/null
[ ! -e /usr/bin/kv-server ] && [ -e /etc/kvcellar/kv-server.toml ] || fail "remove: binary left, or config not kept"
ok "dpkg -r removes the binaries and keeps /etc/kvcellar"
echo "packages: $passed passed, 0 failed"
