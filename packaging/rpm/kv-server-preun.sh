# kv-server (rpm %preun): on erase (not upgrade), stop the service and its
# instances (a glob stops every loaded kv-server@NAME; disable takes no glob).
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
  systemctl --no-reload disable --now kv-server.service >/dev/null 2>&1 || :
  systemctl stop 'kv-server@*.service' >/dev/null 2>&1 || :
fi
exit 0
