# kv-server / kv-mds (rpm %pre): the service user, before files owned by it land.
getent group kvcellar >/dev/null || groupadd -r kvcellar
getent passwd kvcellar >/dev/null || \
  useradd -r -g kvcellar -d /var/lib/kvcellar -M -s /sbin/nologin -c "kvcellar cache" kvcellar
exit 0
