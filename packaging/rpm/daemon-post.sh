# kv-server / kv-mds (rpm %post): the state directory. Units are installed,
# not enabled: the operator sets /etc/kvcellar first.
install -d -o kvcellar -g kvcellar -m 0750 /var/lib/kvcellar
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null 2>&1 || :; fi
exit 0
