#!/usr/bin/env bash
# Builds kv-server, kv-mds and kvctl of an earlier release for
# tests/tests/mixed_versions.rs, once per machine: the binaries are cached
# outside the clone, keyed on the commit. Prints the directory that holds
# them (scripts/test.sh names it in KVCELLAR_PREV_BIN_DIR, v1,
# KVCELLAR_PREV2_BIN_DIR, v2, KVCELLAR_PREV3_BIN_DIR, v3, and
# KVCELLAR_PREV4_BIN_DIR, v4). The releases are built in one target
# directory, so the dependencies they share are compiled once; `--clean`
# removes it (scripts/test.sh does, once every release is built).
# Usage: scripts/prev-release.sh [v1|v2|v3|v4|--clean]   (default v1; exit 3:
# the commit is not in this clone)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-v1}" in
  # The last commit speaking only protocol v1 (the hello without a token).
  v1) PREV=32f23ef6f9e1ee8c81ee950c0b4f2f5e8f62fcab ;;
  # The last commit speaking protocol v2 (a token, no batch frames): the
  # release before this one's protocol v3.
  v2) PREV=8011e44ba3af25d42d7aeaed45735f1def53e3d3 ;;
  # The last commit speaking protocol v3 (BATCH_GET, no batch writes): the
  # release before this one's protocol v4.
  v3) PREV=4275d8eaee44a4fccfec45af96cb8899be39cd28 ;;
  # The last commit before tenants (protocol v4, one group token or none;
  # no credential tables, namespaces or quotas): the previous release of
  # this one.
  v4) PREV=23adb83eb70f051a3afa5bce9b675c20d4740aaa ;;
  --clean) PREV= ;;
  *) echo "usage: scripts/prev-release.sh [v1|v2|v3|v4|--clean]" >&2; exit 2 ;;
esac
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
shared=$CACHE/prev-release/target
# One run at a time over the shared target (two clones' test runs on one
# machine): a release unpacked while another was built could otherwise pass
# the other's newer artifacts for its own, and --clean could remove the
# target under a build.
mkdir -p "$CACHE/prev-release"
exec 9>"$CACHE/prev-release/.lock"
flock 9
if [ -z "$PREV" ]; then
  rm -rf "$shared"
  exit 0
fi
out=$CACHE/prev-release/$PREV
if [ -f "$out/.ready" ]; then
  echo "$out/bin"
  exit 0
fi
if ! git cat-file -e "$PREV^{commit}" 2>/dev/null; then
  echo "prev-release: commit $PREV is not in this clone (a shallow clone?)" >&2
  exit 3
fi
rm -rf "$out"
mkdir -p "$out/src" "$out/bin"
# -m: the files dated now, not at the commit. cargo names a workspace's own
# crates by their place in the workspace, so the releases' crates share
# names in the shared target; an older date would pass for "unchanged".
git archive "$PREV" | tar -x -m -C "$out/src"
# A target dir apart from this tree's (the binaries share names with its
# own), shared by the earlier releases; a debug build, as the tests' own
# binaries.
(cd "$out/src" && cargo build --locked -q -p kv-server -p kv-mds -p kvctl --target-dir "$shared") >&2
for b in kv-server kv-mds kvctl; do
  cp "$shared/debug/$b" "$out/bin/"
done
# Only the binaries are kept (and the shared target until --clean).
rm -rf "$out/src"
touch "$out/.ready"
echo "$out/bin"
