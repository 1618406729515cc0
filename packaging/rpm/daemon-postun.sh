# kv-server / kv-mds (rpm %postun): pages under /var/lib/kvcellar and the
# kvcellar user are kept (a cache refills, but an operator may want it).
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null 2>&1 || :; fi
exit 0
