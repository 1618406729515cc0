#!/usr/bin/env bash
# Builds the Debian packages (scripts/package.sh), installs them on this
# machine with dpkg, checks the installed units with systemd-analyze (offline),
# starts the installed kv-server the way its template unit does (the unit's
# ExecStart line, as the kvcellar user, with an instance config on a free
# port), round-trips a page with the installed kvctl, builds a C program
# against the installed libkvclient through pkg-config, and removes the
# packages again. Needs root. Part of scripts/test-slow.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bash scripts/package.sh
inst=pkgtest$$
work=$(mktemp -d)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  rm -f "/etc/kvcellar/kv-server-$inst.toml"
  rm -rf "/var/lib/kvcellar/$inst" "$work"
  dpkg -r kv-server kv-mds kvctl libkvclient >/dev/null 2>&1 || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
passed=0

DEBIAN_FRONTEND=noninteractive dpkg -i dist/kv-server_*.deb dist/kv-mds_*.deb dist/kvctl_*.deb dist/libkvclient_*.deb >/dev/null
ok "dpkg -i of the four packages"
getent passwd kvcellar >/dev/null || fail "no kvcellar user"
[ "$(stat -c %U /var/lib/kvcellar)" = kvcellar ] || fail "/var/lib/kvcellar not owned by kvcellar"
ok "the kvcellar system user and /var/lib/kvcellar"
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
ok "units carry the hardening and limits"

# The template unit's command line, as systemd would run it for this instance.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"/etc/kvcellar/kv-server-$inst.toml" <<TOML
listen = "127.0.0.1:$port"
dirs = ["/var/lib/kvcellar/$inst"]
cap = "64M"
TOML
install -d -o kvcellar -g kvcellar "/var/lib/kvcellar/$inst"
cmd=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/kv-server@.service | sed "s/%i/$inst/g")
runuser -u kvcellar -- $cmd >"$work/out" 2>"$work/log" &
pid=$!
for _ in $(seq 300); do grep -q "listening on" "$work/out" 2>/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
grep -q "listening on 127.0.0.1:$port" "$work/out" || fail "installed kv-server did not start: $(cat "$work/log")"
ok "installed kv-server runs as kvcellar from the template unit's ExecStart ($cmd)"
head -c 1048576 /dev/urandom >"$work/page"
/usr/bin/kvctl put --node "127.0.0.1:$port" pkg-page --file "$work/page" >/dev/null
/usr/bin/kvctl get --node "127.0.0.1:$port" pkg-page --out "$work/back"
cmp -s "$work/page" "$work/back" || fail "the page read back differs"
ok "installed kvctl round-trips a 1 MiB page"
/usr/bin/kv-mds --version | grep -q "kv-mds" || fail "installed kv-mds does not run"
ok "installed kv-mds runs"

cat >"$work/v.c" <<'C'
#include <kvclient.h>
#include <stdio.h>
int main(void) { printf("%s\n", kv_version()); return 0; }
C
cc -o "$work/v" "$work/v.c" $(pkg-config --cflags --libs kvclient) || fail "cannot build against the installed library"
[ "$("$work/v")" = "$(/usr/bin/kvctl --version | awk '{print $2}')" ] || fail "installed library version differs"
readelf -d "$work/v" | grep -q "NEEDED.*libkvclient.so.0" || fail "the program does not record the SONAME"
ok "a C program builds with pkg-config against the installed header and library (NEEDED libkvclient.so.0)"

kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
dpkg -r kv-server kv-mds kvctl libkvclient >/dev/null
[ ! -e /usr/bin/kv-server ] && [ -e /etc/kvcellar/kv-server.toml ] || fail "remove: binary left, or config not kept"
ok "dpkg -r removes the binaries and keeps /etc/kvcellar"
echo "packages: $passed passed, 0 failed"
