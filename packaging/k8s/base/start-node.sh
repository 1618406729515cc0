#!/bin/sh
# Starts kv-server in a Kubernetes pod (docs/DEPLOY.md, "Kubernetes").
# The node's id is the Kubernetes node's name, so a new pod on the same
# machine keeps the id and with it its ring points and its pages. A
# kvcellar id is 1-64 of A-Z a-z 0-9 . _ - and node names (DNS subdomains:
# a-z 0-9 . -) run to 253 characters: a longer name keeps its first 55
# and ends with '-' and 8 hex digits of its SHA-256, still unique.
# It listens and advertises on the pod's address (the host's, with host
# networking) and execs, so kv-server receives the pod's SIGTERM.
set -eu
: "${NODE_NAME:?the pod must set NODE_NAME from spec.nodeName}"
: "${POD_IP:?the pod must set POD_IP from status.podIP}"
case $POD_IP in *:*) host="[$POD_IP]" ;; *) host=$POD_IP ;; esac  # IPv6 in brackets
id=$NODE_NAME
if [ "${#id}" -gt 64 ]; then
  id="$(printf %s "$NODE_NAME" | cut -c1-55)-$(printf %s "$NODE_NAME" | sha256sum | cut -c1-8)"
fi
exec kv-server --config /etc/kvcellar/kv-server.toml \
  --listen "$host:7700" --metrics-listen "$host:9700" \
  --advertise "$host:7700" --id "$id" "$@"
