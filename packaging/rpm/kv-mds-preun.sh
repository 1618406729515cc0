# kv-mds (rpm %preun): on erase (not upgrade), stop the service and its instances.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
  systemctl --no-reload disable --now 'kv-mds.service'  >/dev/null 2>&1 || :
fi
exit 0
