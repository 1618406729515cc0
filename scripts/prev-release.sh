#!/usr/bin/env bash
# Builds kv-server, kv-mds and kvctl of an earlier data-plane protocol for
# tests/tests/mixed_versions.rs, once per machine: the binaries are cached
# outside the clone, keyed on the commit. Prints the directory that holds
# them (scripts/test.sh names it in KVCELLAR_PREV_BIN_DIR, v1,
# KVCELLAR_PREV2_BIN_DIR, v2, and KVCELLAR_PREV3_BIN_DIR, v3).
# Usage: scripts/prev-release.sh [v1|v2|v3]   (default v1; exit 3: the commit
# is not in this clone)
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
  *) echo "usage: scripts/prev-release.sh [v1|v2|v3]" >&2; exit 2 ;;
esac
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
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
git archive "$PREV" | tar -x -C "$out/src"
# Its own target dir (the binaries share names with this tree's); a debug
# build, as the tests' own binaries.
(cd "$out/src" && cargo build --locked -q -p kv-server -p kv-mds -p kvctl --target-dir "$out/target") >&2
for b in kv-server kv-mds kvctl; do
  cp "$out/target/debug/$b" "$out/bin/"
done
# Only the binaries are kept.
rm -rf "$out/target" "$out/src"
touch "$out/.ready"
echo "$out/bin"
